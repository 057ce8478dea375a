#!/usr/bin/env python3
"""The batch-1 decode chain block by block: where each kernel's blocks ran and when.

  MOE_BENCH_BLOCKS=blocks.csv tests/moe_bench --batch 1     (a build with TESSERA_BLOCK_TRACE=ON)
  block_trace.py blocks.csv [OUT.json]

moe_bench's model chain records, for every block of its eight kernels, its SM, the global
timer at its start, when its PDL wait returned and at its end (kernels/cuda/block_trace.cuh). A
kernel's end is its last block's. For each kernel of the layer this prints the median over the
last layers, against the end of the kernel before it ("prev"): how many blocks it has and how
many started before prev ended (placed early), its first / median / last block's start, its
median wait return (the PDL boundary as the blocks see it), and its first / median / last block's
end (the spread of its tail); then the most blocks one SM held. A kernel that marks points
between its wait and its end (Mark::at: the attention after its q is ready and after its keys)
gets their medians too ("at0", "at1").
"""
import csv
import json
import statistics
import sys
from collections import defaultdict

# The record's kernel ids (kernels/cuda/block_trace.h) in the layer's order.
LAYER = [("qkv", 1), ("attention", 4), ("combine", 5), ("o", 3), ("router", 2), ("route", 6),
         ("gate_up", 7), ("down", 8)]
GAP_NS = 8000  # a kernel's launches a layer apart: ends further apart than this are two launches


def instances(rows):
    """Each kernel's launches: its records grouped by end time."""
    by_kernel = defaultdict(list)
    for r in rows:
        by_kernel[r["kernel"]].append(r)
    out = []
    for kernel, recs in by_kernel.items():
        recs.sort(key=lambda r: r["end"])
        group = [recs[0]]
        for r in recs[1:]:
            if r["end"] - group[-1]["end"] > GAP_NS:
                out.append((kernel, group))
                group = []
            group.append(r)
        out.append((kernel, group))
    out.sort(key=lambda kg: max(r["end"] for r in kg[1]))
    return out


def layers(insts):
    """Runs of the eight kernels in the layer's order, each with the launch before it."""
    ids = [k for _, k in LAYER]
    found = []
    for i in range(1, len(insts) - len(ids) + 1):
        if [insts[i + j][0] for j in range(len(ids))] == ids and insts[i - 1][0] == ids[-1]:
            found.append(insts[i - 1:i + len(ids)])
    return found


def main():
    rows = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(sys.argv[1]))]
    if not rows:
        raise SystemExit("block_trace.py: no records (is moe_bench built with "
                         "TESSERA_BLOCK_TRACE?)")
    found = layers(instances(rows))
    if len(found) < 48:
        raise SystemExit(f"block_trace.py: {len(found)} whole layers in the records (want >= 48)")
    found = found[-480:]
    table = {}
    for at, (label, _) in enumerate(LAYER, start=1):
        stats = defaultdict(list)
        for layer in found:
            prev_end = max(r["end"] for r in layer[at - 1][1])
            blocks = layer[at][1]
            starts = sorted(r["start"] - prev_end for r in blocks)
            ends = sorted(r["end"] - prev_end for r in blocks)
            waits = sorted(r["waited"] - prev_end for r in blocks if r["waited"])
            per_sm = defaultdict(int)
            for r in blocks:
                per_sm[r["sm"]] += 1
            stats["blocks"].append(len(blocks))
            stats["placed_early"].append(sum(s < 0 for s in starts))
            stats["start_first"].append(starts[0])
            stats["start_median"].append(starts[len(starts) // 2])
            stats["start_last"].append(starts[-1])
            if waits:
                stats["wait_median"].append(waits[len(waits) // 2])
                stats["wait_last"].append(waits[-1])
            stats["end_first"].append(ends[0])
            stats["end_median"].append(ends[len(ends) // 2])
            stats["end_last"].append(ends[-1])
            for i in (0, 1):
                marks = sorted(r[f"at{i}"] - prev_end for r in blocks if r.get(f"at{i}"))
                if marks:
                    stats[f"at{i}_median"].append(marks[len(marks) // 2])
            stats["sms"].append(len(per_sm))
            stats["most_on_one_sm"].append(max(per_sm.values()))
        table[label] = {k: statistics.median(v) / (1 if k in ("blocks", "placed_early", "sms",
                                                                  "most_on_one_sm") else 1e3)
                        for k, v in stats.items()}
    period = statistics.median(max(r["end"] for r in l[-1][1]) - max(r["end"] for r in l[0][1])
                               for l in found) / 1e3
    print(f"{len(found)} layers; the layer's period {period:.2f} us; times in us after the end of "
          "the kernel before")
    print(f"{'kernel':9} {'blocks':>6} {'early':>5} {'start first/med/last':>22} "
          f"{'wait med/last':>14} {'end first/med/last':>20} {'SMs':>4} {'max/SM':>6}")
    for label, t in table.items():
        w = (f"{t['wait_median']:6.2f}/{t['wait_last']:<6.2f}" if "wait_median" in t
             else f"{'-':>14}")
        print(f"{label:9} {t['blocks']:6.0f} {t['placed_early']:5.0f} "
              f"{t['start_first']:7.2f}/{t['start_median']:6.2f}/{t['start_last']:<6.2f} {w} "
              f"{t['end_first']:6.2f}/{t['end_median']:6.2f}/{t['end_last']:<6.2f} "
              f"{t['sms']:4.0f} {t['most_on_one_sm']:6.0f}")
        if "at0_median" in t or "at1_median" in t:
            print(f"{'':9} marks between: " + ", ".join(
                f"at{i} {t[f'at{i}_median']:.2f}" for i in (0, 1) if f"at{i}_median" in t))
    if len(sys.argv) > 2:
        json.dump({"layers": len(found), "period_us": period, "kernels": table},
                  open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
