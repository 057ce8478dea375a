#!/usr/bin/env python3
"""Summary of scripts/gpu-check's decode-ab part: batch-1 decode of two builds side by side.

  decode_ab.py RUN_DIR WORK_DIR BANDWIDTH_GBS OUT.json

RUN_DIR holds `tessera bench report` JSONs named PRESET-SIDE-ROUND.json (SIDE old or new) and
PRESET-SIDE-1-async.json (--async-scheduling); WORK_DIR/PRESET-config/config.json are the configs
they ran. For each preset: each round's median tok/s of both builds, the median over the rounds,
new / old, the GPU forward and step medians, and (BANDWIDTH_GBS > 0) the roofline fractions
(roofline.py). Prints a table; exits 1 when a run is missing.
"""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import roofline  # noqa: E402  (beside this script)


def main():
    run_dir, work, bw, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    runs = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "*.json"))):
        m = re.match(r"(.+)-(old|new)-(\d+)(-async)?\.json$", os.path.basename(path))
        if not m:
            continue
        preset, side, rnd, is_async = m.group(1), m.group(2), int(m.group(3)), bool(m.group(4))
        runs.setdefault(preset, []).append((side, rnd, is_async, json.load(open(path))))
    if not runs:
        print(f"decode_ab.py: no reports in {run_dir}")
        return 1
    summary = {"copy_bandwidth_gbs": bw, "presets": {}}
    missing = 0
    print(f"{'preset':16} {'mode':6} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} "
          f"{'old roof':>9} {'new roof':>9}")
    for preset, rs in sorted(runs.items()):
        config_path = os.path.join(work, f"{preset}-config", "config.json")
        config = json.load(open(config_path)) if os.path.exists(config_path) else None
        entry = {}
        for mode in ("sync", "async"):
            sides = {}
            for side in ("old", "new"):
                mine = sorted((r for r in rs if r[0] == side and r[2] == (mode == "async")),
                              key=lambda r: r[1])
                if not mine:
                    # No async runs at all: gpu-check's DECODE_AB_ASYNC=0 left them out.
                    if mode == "sync" or any(r[2] for r in rs):
                        missing += 1
                    continue
                b1 = [r[3]["scenarios"]["batch1_decode"] for r in mine]
                rounds = [statistics.median(b["decode_tok_s"]) for b in b1]
                s = {"rounds_tok_s": rounds, "median_tok_s": statistics.median(rounds),
                     "gpu_forward_ms": [b.get("gpu_forward_ms_median") for b in b1],
                     "step_ms": [b.get("step_ms_median") for b in b1],
                     "device": mine[0][3].get("device"),
                     "command": mine[0][3].get("command")}
                if config is not None and bw > 0:
                    # The bytes a step reads are the same in every round: the first one's, at
                    # the median over the rounds.
                    r = roofline.roofline(mine[0][3], config, bw, 0.0, preset)
                    r["decode_tok_s"] = s["median_tok_s"]
                    r["fraction"] = s["median_tok_s"] / r["roofline_tok_s"]
                    s["roofline"] = r
                sides[side] = s
            if len(sides) == 2:
                sides["new_over_old"] = sides["new"]["median_tok_s"] / sides["old"]["median_tok_s"]
                roof = [f"{sides[x]['roofline']['fraction']:.3f}" if "roofline" in sides[x] else "-"
                        for x in ("old", "new")]
                print(f"{preset:16} {mode:6} {sides['old']['median_tok_s']:10.1f} "
                      f"{sides['new']['median_tok_s']:10.1f} {sides['new_over_old']:8.3f} "
                      f"{roof[0]:>9} {roof[1]:>9}")
            entry[mode] = sides
        summary["presets"][preset] = entry
    json.dump(summary, open(out, "w"), indent=2)
    print(f"wrote {out}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
