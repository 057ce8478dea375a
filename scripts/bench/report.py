#!/usr/bin/env python3
"""Combine a `tessera bench report --output-json` result with a transformers baseline
(scripts/bench/transformers_latency.py) into one record with ratios against the targets.

    report.py --tessera TESSERA.json --transformers TRANSFORMERS.json --out bench/results/NAME.json

Figures (tessera statistic vs transformers statistic), with issue 11's targets:
  batch-1 decode tok/s      median of tessera's decode_tok_s; vs the roofline
                            (transformers' copy bandwidth / bytes read per token), target >= 0.90,
                            and vs transformers static-cache+compile / eager medians, no target
  TTFT ms                   tessera's median, target <= 7 ms; vs transformers both ways, no target
  prefill 4096 tok/s        tessera's tok_s vs transformers' best-of-N tok_s, target >= 1.25, both
                            against the default forward (logits at every position) and against
                            logits_to_keep=1 (the last position only, what a serving prefill needs)
  batch-64 decode tok/s     medians, vs transformers eager, target >= 6
A missing scenario or value gives null figures and "met": null.
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(path):
    with open(path) as f:
        return json.load(f)


def num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def med(v):
    """Median of a list of numbers, or the number itself; None when absent."""
    if isinstance(v, list):
        xs = [x for x in v if num(x) is not None]
        return statistics.median(xs) if xs else None
    return num(v)


def get(d, *path):
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def first(*vals):
    for v in vals:
        if v is not None:
            return v
    return None


def git_commit():
    try:
        r = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                    "--untracked-files=no"], capture_output=True, text=True,
                                   timeout=30)
            return r.stdout.strip(), (bool(dirty.stdout.strip()) if dirty.returncode == 0
                                      else None)
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("TESSERA_COMMIT"), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tessera", required=True, help="tessera bench report --output-json file")
    ap.add_argument("--transformers", required=True, help="transformers_latency.py output")
    ap.add_argument("--out", required=True, help="combined JSON to write")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is not met")
    args = ap.parse_args()

    ts = load(args.tessera)
    hf = load(args.transformers)
    tsc = ts.get("scenarios") or {}
    hsc = hf.get("scenarios") or {}

    # Roofline from the measured copy bandwidth and tessera's bytes per token.
    bw = num(get(hf, "copy_bandwidth", "bytes_per_s"))
    bpt = first(num(ts.get("decode_bytes_per_token")), num(hf.get("decode_bytes_per_token")))
    bpt_source = ("tessera" if num(ts.get("decode_bytes_per_token")) is not None
                  else "transformers" if bpt is not None else None)
    roofline = bw / bpt if bw and bpt else None

    t_b1 = med(get(tsc, "batch1_decode", "decode_tok_s"))
    t_ttft = med(get(tsc, "batch1_decode", "ttft_ms"))
    h_b1c = first(num(get(hsc, "batch1_decode_compiled", "decode_tok_s_median")),
                  med(get(hsc, "batch1_decode_compiled", "decode_tok_s")))
    h_b1e = first(num(get(hsc, "batch1_decode_eager", "decode_tok_s_median")),
                  med(get(hsc, "batch1_decode_eager", "decode_tok_s")))
    h_ttft_c = first(num(get(hsc, "batch1_decode_compiled", "ttft_ms_median")),
                     med(get(hsc, "batch1_decode_compiled", "ttft_ms")))
    h_ttft_e = first(num(get(hsc, "batch1_decode_eager", "ttft_ms_median")),
                     med(get(hsc, "batch1_decode_eager", "ttft_ms")))
    t_pf = first(num(get(tsc, "prefill_4096", "tok_s")))
    if t_pf is None:  # derive from the times if only they are there
        ms = med(get(tsc, "prefill_4096", "ms"))
        n = num(get(tsc, "prefill_4096", "input_len")) or 4096
        t_pf = n / (ms / 1e3) if ms else None
    h_pf = num(get(hsc, "prefill_4096", "tok_s"))
    h_pf_last = num(get(hsc, "prefill_4096_last_logits", "tok_s"))
    t_b64 = med(get(tsc, "batch64_decode", "decode_tok_s"))
    h_b64 = first(num(get(hsc, "batch64_decode_eager", "decode_tok_s_median")),
                  med(get(hsc, "batch64_decode_eager", "decode_tok_s")))

    def ratio(a, b):
        return a / b if a is not None and b else None

    figures = []

    def fig(name, unit, t, h, r, target, note=None, at_most=False):
        # at_most: the target bounds tessera's own figure from above (a latency), not the ratio.
        v = t if at_most else r
        met = None
        if v is not None and target is not None:
            met = v <= target if at_most else v >= target
        figures.append({"figure": name, "unit": unit, "tessera": t, "transformers": h,
                        "ratio": r, "target": target,
                        "target_is": "tessera <= target" if at_most else "ratio >= target",
                        "met": met, "note": note})

    fig("batch-1 decode vs roofline", "tok/s", t_b1, roofline, ratio(t_b1, roofline), 0.90,
        f"roofline = copy bandwidth / decode bytes per token ({bpt_source})")
    fig("batch-1 decode vs transformers static+compile", "tok/s", t_b1, h_b1c,
        ratio(t_b1, h_b1c), None,
        None if h_b1c is not None else "transformers compiled run missing or failed")
    fig("batch-1 decode vs transformers eager", "tok/s", t_b1, h_b1e, ratio(t_b1, h_b1e), None)
    fig("TTFT (128 prompt)", "ms", t_ttft, None, None, 7.0, at_most=True)
    fig("TTFT (128 prompt), transformers compiled / tessera", "ms", t_ttft, h_ttft_c,
        ratio(h_ttft_c, t_ttft), None, "ratio > 1: tessera faster")
    fig("TTFT (128 prompt), transformers eager / tessera", "ms", t_ttft, h_ttft_e,
        ratio(h_ttft_e, t_ttft), None, "ratio > 1: tessera faster")
    fig("prefill 4096", "tok/s", t_pf, h_pf, ratio(t_pf, h_pf), 1.25,
        "transformers: default forward, logits at every position")
    fig("prefill 4096 vs transformers last-position logits", "tok/s", t_pf, h_pf_last,
        ratio(t_pf, h_pf_last), 1.25, "transformers forward with logits_to_keep=1")
    fig("batch-64 decode vs transformers eager", "tok/s", t_b64, h_b64, ratio(t_b64, h_b64),
        6.0)

    commit, dirty = git_commit()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"gpu": first(ts.get("device"), hf.get("gpu")),
                    "hostname": first(ts.get("hostname"), hf.get("hostname"),
                                      socket.gethostname())},
        "git_commit": commit,
        "git_dirty": dirty,
        "commands": {"tessera": ts.get("command"), "transformers": hf.get("command")},
        "model": {"tessera": ts.get("model"), "transformers": hf.get("model")},
        "copy_bandwidth_bytes_per_s": bw,
        "decode_bytes_per_token": bpt,
        "decode_bytes_per_token_source": bpt_source,
        "roofline_tok_s": roofline,
        "statistics": "tessera: median of its per-iteration lists (tok_s as given for prefill); "
                      "transformers: medians for decode/TTFT, best-of-N for prefill",
        "figures": figures,
        "targets_met": all(f["met"] for f in figures if f["target"] is not None)
        if all(f["met"] is not None for f in figures if f["target"] is not None) else None,
        "inputs": {"tessera": ts, "transformers": hf},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    def f(v):
        if v is None:
            return "n/a"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"

    print(f"{result['machine']['gpu']}  commit {commit or 'unknown'}"
          f"{' (dirty)' if dirty else ''}  {result['date']}")
    if bw:
        print(f"copy bandwidth {bw / 1e9:.0f} GB/s, {bpt or 0:.4g} bytes/token -> "
              f"roofline {f(roofline)} tok/s")
    print()
    print("| figure | tessera | transformers | ratio | target | met |")
    print("|---|---|---|---|---|---|")
    for x in figures:
        op = "<=" if x["target_is"].startswith("tessera <=") else ">="
        tgt = f"{op} {x['target']:g}" if x["target"] is not None else "-"
        met = f(x["met"]) if x["target"] is not None else "-"
        print(f"| {x['figure']} ({x['unit']}) | {f(x['tessera'])} | {f(x['transformers'])} | "
              f"{f(x['ratio'])} | {tgt} | {met} |")
    print(f"\nwrote {args.out}")
    if args.strict and result["targets_met"] is not True:
        sys.exit(1)


if __name__ == "__main__":
    main()
