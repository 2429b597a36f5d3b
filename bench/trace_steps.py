#!/usr/bin/env python3
"""Per-kernel times inside decode graphs, from a trace build's stamps.

A build with -DRECUR_CUDA_TRACE=ON run with RECUR_CUDA_TRACE_OUT=FILE writes each captured
decode graph's kernels (in node order) and, for every kernel launch, the moments its first
block reached and left its wait for the kernel before (grid_dependency_sync). Replays of a
graph are found by matching the launches' grids to the graph's node list; for each node this
prints medians over the replays of:
  step   the time from this kernel's wait ending to the next one's (its share of the step),
  slack  how long its first block waited (it arrived early: its pre-wait work was hidden).
Usage: trace_steps.py FILE [--tokens N]   (N: the graph's token count, default the first)
"""
import statistics
import sys


def parse(path):
    graphs, stamps, cur = [], [], None
    with open(path) as f:
        for line in f:
            if line.startswith("graph "):
                cur = {"tokens": int(line.split()[1]), "nodes": []}
                graphs.append(cur)
            elif line.startswith("node "):
                parts = line.split()
                if "grid" in parts:
                    gi = parts.index("grid")
                    name = " ".join(parts[1:gi])
                    grid = parts[gi + 1]
                    threads = int(parts[gi + 3])
                else:
                    name, grid, threads = " ".join(parts[1:]), None, None
                cur["nodes"].append((name, grid, threads))
            elif line.startswith("stamps "):
                continue
            else:
                a, b, grid, threads = line.split()
                stamps.append((int(a), int(b), grid, int(threads)))
    return graphs, stamps


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    tokens = None
    if "--tokens" in args:
        i = args.index("--tokens")
        tokens = int(args[i + 1])
        del args[i : i + 2]
    graphs, stamps = parse(args[0])
    graph = next((g for g in graphs if tokens is None or g["tokens"] == tokens), None)
    if graph is None:
        print("no such graph")
        return 1
    # Kernels that stamp: every node that is a kernel (non-kernel nodes never stamp).
    nodes = [n for n in graph["nodes"] if n[1] is not None]
    sig = [(n[1], n[2]) for n in nodes]
    L = len(sig)
    replays = []
    i = 0
    while i + L <= len(stamps):
        if all((stamps[i + j][2], stamps[i + j][3]) == sig[j] for j in range(L)):
            replays.append(i)
            i += L
        else:
            i += 1
    # The next stamp after a replay starts the next step's kernel 0 (if it follows at once).
    print(f"graph of {graph['tokens']} token(s): {L} kernels; {len(replays)} replays found "
          f"in {len(stamps)} stamps")
    if len(replays) < 3:
        return 1
    replays = replays[1:]  # the first replay may follow the capture
    starts = set(replays)
    step_times = []
    per = [[] for _ in range(L)]
    slack = [[] for _ in range(L)]
    for r in replays:
        if r + L < len(stamps):
            step_times.append(stamps[r + L][1] - stamps[r][1])
        for j in range(L):
            a, b = stamps[r + j][0], stamps[r + j][1]
            slack[j].append(b - a)
            if r + j + 1 < len(stamps) and (j + 1 < L or r + L in starts):
                per[j].append(stamps[r + j + 1][1] - b)
    med = lambda v: statistics.median(v) / 1000 if v else float("nan")
    print(f"step (kernel 0 to kernel 0 of the next replay): median {med(step_times):.2f} us over "
          f"{len(step_times)}")
    print(f"{'#':>3} {'step us':>8} {'slack us':>8}  kernel (grid)")
    groups = {}
    for j, (name, grid, threads) in enumerate(nodes):
        short = name.replace("(anonymous namespace)::", "")
        short = short[: short.find("(")] if "(" in short else short
        print(f"{j:3d} {med(per[j]):8.2f} {med(slack[j]):8.2f}  {short[:70]} ({grid})")
        key = short[:60]
        groups.setdefault(key, [0.0, 0])
        groups[key][0] += med(per[j]) if per[j] else 0.0
        groups[key][1] += 1
    print("\nby kernel (sum of medians, us):")
    for key, (tot, cnt) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{tot:8.2f} {cnt:3d}x  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
