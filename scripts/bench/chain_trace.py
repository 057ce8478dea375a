#!/usr/bin/env python3
"""Where a layer of the batch-1 decode chain goes, kernel by kernel, from an nsys timeline.

  MOE_BENCH_PROFILE=1 nsys profile --capture-range=cudaProfilerApi --cuda-graph-trace=node \\
      -o chain tests/moe_bench --batch 1
  nsys stats -r cuda_gpu_trace -f csv -o chain chain.nsys-rep
  chain_trace.py chain_cuda_gpu_trace.csv [OUT.json]

moe_bench's model chain (the layer as the CUDA model runs it: q|k|v's GEMV with the input norm,
the attention with its rope, the combine, o, the router's GEMV with the post-attention norm, the
routing, gate_up, down + combine) is captured 48 layers a graph and replayed. Under programmatic
dependent launch a kernel starts while the one before runs (its blocks wait at
griddepcontrol.wait), so its start says when it was placed, not when it could work; its end is
what the chain waits for. For each kernel of the layer this prints the median over the layers of
the last replays: its end after the previous kernel's end (its cost on the chain's critical
path), its start against that previous end (negative: placed early) and its duration. The eight
ends add up to the layer's period.
"""
import csv
import json
import statistics
import sys

# The layer's kernels in order, each recognised by a piece of its (demangled) name; the norm
# GEMVs (q|k|v, router) and o share gemv_kernel and are told apart by their place.
LAYER = ["qkv", "attention", "combine", "o", "router", "route", "gate_up", "down"]


def kind(name):
    for piece, label in (("route_kernel", "route"), ("gemv_gate_up", "gate_up"),
                         ("gemv_down_combine", "down"), ("attention_combine", "combine"),
                         ("paged_attention", "attention"), ("gemv_kernel", "gemv")):
        if piece in name:
            return label
    return "other"


def column(header, prefix):
    for i, h in enumerate(header):
        if h.startswith(prefix):
            return i
    raise SystemExit(f"chain_trace.py: no column starting with {prefix!r} in {header}")


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    header, body = rows[0], rows[1:]
    start_at, dur_at, name_at = column(header, "Start"), column(header, "Duration"), \
        column(header, "Name")
    kernels = sorted((int(float(r[start_at])), int(float(r[dur_at])), kind(r[name_at]))
                     for r in body if len(r) > name_at and r[dur_at])
    kernels = [(s, s + d, k) for s, d, k in kernels if k != "other"]
    # A layer is the eight kernels around a routing kernel: five before it, two after.
    layers = []
    for i, (_, _, k) in enumerate(kernels):
        if k != "route" or i < 6 or i + 2 >= len(kernels):
            continue
        window = kernels[i - 6:i + 3]  # the previous layer's down, then this layer's eight
        kinds = [w[2] for w in window]
        if kinds == ["down", "gemv", "attention", "combine", "gemv", "gemv", "route", "gate_up",
                     "down"]:
            layers.append(window)
    if len(layers) < 48:
        raise SystemExit(f"chain_trace.py: {len(layers)} whole layers in the trace (want >= 48)")
    layers = layers[-480:]  # the last ten replays (the first may be cold)
    table = {}
    for at, label in enumerate(LAYER, start=1):
        cost = [w[at][1] - w[at - 1][1] for w in layers]
        early = [w[at][0] - w[at - 1][1] for w in layers]
        dur = [w[at][1] - w[at][0] for w in layers]
        table[label] = {"end_after_previous_end_us": statistics.median(cost) / 1e3,
                        "start_after_previous_end_us": statistics.median(early) / 1e3,
                        "duration_us": statistics.median(dur) / 1e3}
    period = statistics.median(w[-1][1] - w[0][1] for w in layers) / 1e3
    print(f"{len(layers)} layers; the layer's period (down's end to down's end) {period:.2f} us")
    print(f"{'kernel':10} {'end - prev end':>15} {'start - prev end':>17} {'duration':>9}")
    for label, t in table.items():
        print(f"{label:10} {t['end_after_previous_end_us']:15.2f} "
              f"{t['start_after_previous_end_us']:17.2f} {t['duration_us']:9.2f}")
    if len(sys.argv) > 2:
        json.dump({"layers": len(layers), "period_us": period, "kernels": table},
                  open(sys.argv[2], "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
