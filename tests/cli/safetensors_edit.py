#!/usr/bin/env python3
"""Writes a changed copy of a safetensors file, for tests that need broken model files.

  safetensors_edit.py IN OUT [--keep PREFIX]... [--fill NAME VALUE]... [--set NAME INDEX VALUE]...

--keep: only tensors whose names start with one of the prefixes (default: all).
--fill: every element of tensor NAME becomes VALUE ("nan", "inf", "-inf" or a number).
--set: element INDEX (flat) of tensor NAME becomes VALUE.
F32, F16, BF16 and I64 tensors can be changed; the rest are copied as they are.
"""
import argparse
import json
import struct
import sys


def encode(dtype, value):
    if dtype == "F32":
        return struct.pack("<f", value)
    if dtype == "F16":
        return struct.pack("<e", value)
    if dtype == "BF16":
        return struct.pack("<f", value)[2:]  # the high half of the float32
    if dtype == "I64":
        return struct.pack("<q", int(value))
    sys.exit(f"cannot write values of dtype {dtype}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--keep", action="append", default=[])
    p.add_argument("--fill", nargs=2, action="append", default=[])
    p.add_argument("--set", nargs=3, action="append", default=[])
    a = p.parse_args()
    data = open(a.src, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    meta = header.pop("__metadata__", None)
    tensors = {}
    for name, e in header.items():
        if a.keep and not any(name.startswith(k) for k in a.keep):
            continue
        b, end = e["data_offsets"]
        tensors[name] = (e, bytearray(body[b:end]))
    for name, value in a.fill:
        e, raw = tensors[name]
        one = encode(e["dtype"], float(value))
        raw[:] = one * (len(raw) // len(one))
    for name, index, value in a.set:
        e, raw = tensors[name]
        one = encode(e["dtype"], float(value))
        i = int(index) * len(one)
        raw[i : i + len(one)] = one
    out_header = {} if meta is None else {"__metadata__": meta}
    out_body = bytearray()
    for name, (e, raw) in tensors.items():
        out_header[name] = {"dtype": e["dtype"], "shape": e["shape"],
                            "data_offsets": [len(out_body), len(out_body) + len(raw)]}
        out_body += raw
    h = json.dumps(out_header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(a.dst, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + bytes(out_body))


if __name__ == "__main__":
    main()
