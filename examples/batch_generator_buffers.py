"""The mlx-lm BatchGenerator report, on recur: one prompt [1..8] in a BatchGenerator, tokens
taken with next_generated() until --tokens, with the engine's live buffer count printed as it
goes. In mlx-lm the count grew with every token; here it must be the same at token 2,000 and
at the end.

    PYTHONPATH=build/python:python python3 examples/batch_generator_buffers.py \
        [--model models/qwen3next-seed-48L] [--tokens 20000]
"""

import argparse
import sys
import time

import recur


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/qwen3next-seed-48L")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--every", type=int, default=1000, help="a progress line every N tokens")
    args = ap.parse_args()

    model, _ = recur.load(args.model, max_context=args.tokens + 16)
    gen = recur.BatchGenerator(model, max_tokens=args.tokens)
    gen.insert([[1, 2, 3, 4, 5, 6, 7, 8]])
    n = 0
    start = time.perf_counter()
    at_2000 = None
    while responses := gen.next_generated():
        n += len(responses)
        if n % args.every == 0 or n == args.tokens:
            s = gen.stats()
            print(f"tokens {n:6d}  live buffers {s.live_buffers}  live bytes {s.live_bytes}  "
                  f"allocations {s.allocs_total}  {n / (time.perf_counter() - start):.0f} tok/s",
                  flush=True)
        if n == 2000:
            at_2000 = gen.stats().live_buffers
    end = gen.stats().live_buffers
    gen.close()
    if at_2000 is not None:
        same = at_2000 == end
        print(f"live buffers at 2,000: {at_2000}, at {n:,}: {end}: "
              f"{'identical' if same else 'DIFFERENT'}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
