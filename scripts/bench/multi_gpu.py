#!/usr/bin/env python3
"""The figures of scripts/gpu-check's `multi` part (issue 31: two or more GPUs), gathered into one
JSON with "gpu_count" and each target met or not.

    multi_gpu.py --dir OUT/bench/multi --gpus N --serve-log LOG --allreduce-log LOG --out OUT.json

Reads what the part wrote into --dir: parity_MODEL_PLAN.json (scripts/goldens/gpu_parity.py at
each plan; parity_llama3-8b_two_nodes.json across two daemons), report_MODEL_PLAN.json (`tessera
bench report`), throughput_llama3-8b_PLAN.json (`tessera bench throughput`), rank_kill_tp2.json
(scripts/bench/rank_kill.py); `serve -tp 2`'s "ready in S s" from --serve-log; the custom
all-reduce's timing tables from --allreduce-log (custom_all_reduce_test's TimingReport). A figure
whose run is missing is listed with "met": null (its step has failed on its own). Exit status 1
iff a measured target is missed.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

TABLE = re.compile(r"custom all-reduce, bf16, (\d+) ranks on (distinct GPUs|SHARED GPUs)")
ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+(\S+)\s+(\S+)\s+([\d.]+) GB/s")


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def med(xs):
    return statistics.median(xs) if xs else None


def report_figures(r):
    """Batch-1 decode tok/s and TTFT, batch-64 decode tok/s, the 4096 prefill's ms."""
    if r is None:
        return None
    s = r.get("scenarios", {})
    b1, b64 = s.get("batch1_decode", {}), s.get("batch64_decode", {})
    pre = s.get("prefill_4096", {})
    return {"batch1_tok_s": med(b1.get("decode_tok_s", [])),
            "ttft_ms": med(b1.get("ttft_ms", [])),
            "batch64_tok_s": med(b64.get("decode_tok_s", [])),
            "prefill_4096_ms": med(pre.get("ms", [])),
            "device": r.get("device"), "command": r.get("command")}


def allreduce_tables(text):
    """{ranks: [{bytes, one_shot, two_shot, auto, algo, plus_norm, fused, nccl}]} of the tables on
    distinct GPUs (a shared GPU's figures mean nothing)."""
    tables, rows = {}, None
    for line in text.splitlines():
        m = TABLE.search(line)
        if m:
            rows = [] if m.group(2) == "distinct GPUs" else None
            if rows is not None:
                tables[int(m.group(1))] = rows
            continue
        m = ROW.match(line)
        if m and rows is not None:
            f = m.groups()
            rows.append({"bytes": int(f[0]), "one_shot_us": float(f[1]), "two_shot_us": float(f[2]),
                         "auto_us": float(f[3]), "auto_algo": f[4], "plus_norm_us": float(f[5]),
                         "fused_us": float(f[6]),
                         "nccl_us": None if f[7] == "-" else float(f[7])})
    return tables


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--serve-log", default="")
    ap.add_argument("--allreduce-log", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    d = Path(a.dir)
    out = {"gpu_count": a.gpus, "parity": {}, "decode": {}, "throughput": {}, "targets": []}
    targets = out["targets"]

    def target(name, value, goal, met):
        targets.append({"name": name, "value": value, "goal": goal,
                        "met": None if value is None else bool(met)})

    # Parity: each plan against transformers, and its tokens against TP=1's.
    for f in sorted(d.glob("parity_*.json")):
        name = f.stem[len("parity_"):]
        model, plan = ((name.removesuffix("_two_nodes"), "two_nodes")
                       if name.endswith("_two_nodes") else name.rsplit("_", 1))
        r = load(f)
        if r is None:
            continue
        out["parity"].setdefault(model, {})[plan] = {
            "pass": r.get("pass"), "verdicts": [c.get("verdict") for c in r.get("cases", [])],
            "identical_prefix": [c.get("identical_prefix") for c in r.get("cases", [])],
            "ids": [c.get("tessera_output_ids") for c in r.get("cases", [])]}
    for model, plans in out["parity"].items():
        base = plans.get("tp1", {}).get("ids")
        for plan, p in plans.items():
            ids = p.pop("ids")
            if base is not None and plan != "tp1":
                p["same_tokens_as_tp1"] = [x == y for x, y in zip(ids, base)]
            target(f"{model} {plan} greedy parity with transformers", p["pass"], True, p["pass"])

    for f in sorted(d.glob("report_*.json")):
        model, plan = f.stem[len("report_"):].rsplit("_", 1)
        fig = report_figures(load(f))
        if fig is not None:
            out["decode"].setdefault(model, {})[plan] = fig
    l8 = out["decode"].get("llama3-8b", {})
    one = (l8.get("tp1") or {}).get("batch1_tok_s")
    for tp in (2, 4, 8):
        t = (l8.get(f"tp{tp}") or {}).get("batch1_tok_s")
        if one and t:
            l8[f"tp{tp}_over_tp1"] = t / one
    two = l8.get("tp2_over_tp1")
    target("llama3-8b TP=2 batch-1 decode over TP=1", two, ">= 1.8", two is not None and two >= 1.8)
    l70 = out["decode"].get("llama3-70b", {}).get("tp4")
    if a.gpus >= 4:
        tok = l70 and l70["batch1_tok_s"]
        ttft = l70 and l70["ttft_ms"]
        target("llama3-70b TP=4 batch-1 decode tok/s", tok, ">= 110",
               tok is not None and tok >= 110)
        target("llama3-70b TP=4 TTFT ms", ttft, "<= 60", ttft is not None and ttft <= 60)

    for f in sorted(d.glob("throughput_*.json")):
        plan = f.stem.rsplit("_", 1)[1]
        r = load(f)
        if r is not None:
            out["throughput"][plan] = r.get("output_tokens_per_second")
    th = out["throughput"]
    if th.get("tp1") and th.get("pp2"):
        th["pp2_over_tp1"] = th["pp2"] / th["tp1"]
    if th.get("tp2") and th.get("dp2"):
        th["dp2_over_tp2"] = th["dp2"] / th["tp2"]
    pp = th.get("pp2_over_tp1")
    target("llama3-8b PP=2 throughput over one GPU", pp, ">= 1.7", pp is not None and pp >= 1.7)

    ready = None
    if a.serve_log and Path(a.serve_log).exists():
        m = re.search(r"ready in ([\d.]+) s", Path(a.serve_log).read_text(errors="replace"))
        ready = float(m.group(1)) if m else None
    out["serve_ready_tp2_s"] = ready
    target("serve -tp 2 ready s", ready, "<= 20", ready is not None and ready <= 20)

    kill = load(d / "rank_kill_tp2.json")
    out["rank_kill"] = kill and {k: kill.get(k) for k in
                                 ("named", "named_after_s", "healthy_again_after_s",
                                  "unstreamed_at_kill", "checks", "pass")}
    target("a rank SIGKILLed mid-step: named in 2 s, restarted, no unstreamed request lost",
           kill and kill.get("pass"), True, kill and kill.get("pass"))

    tables = {}
    if a.allreduce_log and Path(a.allreduce_log).exists():
        tables = allreduce_tables(Path(a.allreduce_log).read_text(errors="replace"))
    out["allreduce"] = {str(w): rows for w, rows in tables.items()}
    for w, rows in tables.items():
        faster = [r["bytes"] for r in rows
                  if r["nccl_us"] is not None and r["nccl_us"] < r["auto_us"]]
        out["allreduce"][f"{w}_nccl_faster_from_bytes"] = min(faster) if faster else None
    small = next((r for r in tables.get(2, []) if r["bytes"] == 8192), None)
    fused = small and small["fused_us"]
    target("custom all-reduce + add + RMSNorm, 2 ranks, 8 KiB, us in a graph", fused, "<= 5",
           fused is not None and fused <= 5)

    missed = [t["name"] for t in targets if t["met"] is False]
    out["missed"] = missed
    Path(a.out).write_text(json.dumps(out, indent=2))
    for t in targets:
        state = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"{state:12s} {t['name']}: {t['value']} (goal {t['goal']})")
    print(f"multi_gpu: {a.gpus} GPU(s); {len(missed)} target(s) missed; {a.out}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
