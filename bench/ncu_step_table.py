#!/usr/bin/env python3
"""Per-kernel table of one decode step from an Nsight Compute CSV (--csv --page raw with
gpu__time_duration, dram__bytes_read/write, launch__registers_per_thread): each kernel timed
alone, its DRAM bytes and bandwidth. The step is the span between the last two embedding
kernels (the final decode step of the run).
Usage: bench/ncu_step_table.py NCU.csv"""
import csv
import io
import re
import sys


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


text = open(sys.argv[1]).read()
text = text[text.index('"ID"'):]
rows = list(csv.reader(io.StringIO(text)))
head, rows = rows[0], rows[2:]  # the second row holds the units
ix = {n: i for i, n in enumerate(head)}
kernels = []
for r in rows:
    name = re.sub(r"\(.*", "", r[ix["Kernel Name"]]).removeprefix("void ")
    name = name.replace("recur::", "").replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    kernels.append((name[:80], num(r[ix["gpu__time_duration.sum"]]) / 1e3,
                    num(r[ix["dram__bytes_read.sum"]]) + num(r[ix["dram__bytes_write.sum"]]),
                    r[ix["Grid Size"]], r[ix["Block Size"]], r[ix["launch__registers_per_thread"]]))
starts = [i for i, k in enumerate(kernels) if "embedding" in k[0]]
if len(starts) < 2:
    sys.exit("fewer than two embedding kernels: no whole step in the file")
step = kernels[starts[-2]:starts[-1]]
total_us = sum(k[1] for k in step)
total_mb = sum(k[2] for k in step) / 1e6
print(f"{'us':>8} {'MB':>8} {'GB/s':>6} {'grid':>14} {'block':>12} {'regs':>4}  kernel")
for name, us, b, grid, block, regs in step:
    bw = b / (us * 1e-6) / 1e9 if us else 0.0
    print(f"{us:8.2f} {b / 1e6:8.2f} {bw:6.0f} {grid:>14} {block:>12} {regs:>4}  {name}")
print(f"step: {len(step)} kernels, {total_us:.1f} us timed alone, {total_mb:.1f} MB "
      f"({total_mb / total_us * 1e3:.0f} GB/s over the sum)")
