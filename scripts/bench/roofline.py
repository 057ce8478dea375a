#!/usr/bin/env python3
"""Batch-1 decode against the HBM roofline, from a `tessera bench report` JSON.

The roofline is the copy bandwidth (kernel_bench's, measured in the same run) over the bytes a
decode step must read: the active parameters `bench report` counts (decode_bytes_per_token) and
the KV cache at the run's mean context, where a sliding-window layer reads at most its window
(the full-context figure is given beside it).

  roofline.py REPORT.json CONFIG.json BANDWIDTH_GBS OUT.json TARGET

writes OUT.json, prints one line, and exits 1 when the fraction is below TARGET (0: report only).
scripts/gpu-check's `models` and `decode-ab` parts call it.
"""
import json
import statistics
import sys


def sliding(c, i):
    """Whether layer i slides, as ModelConfig reads each architecture's layer pattern."""
    if "layer_types" in c:
        return c["layer_types"][i] == "sliding_attention"
    arch = c["architectures"][0]
    window = c.get("sliding_window") or 0
    if arch.startswith("Gemma3"):
        return (i + 1) % c.get("sliding_window_pattern", 6) != 0
    if arch.startswith("Gemma2"):
        return i % 2 == 0
    return arch.startswith(("Mistral", "Phi3")) and window > 0


def roofline(report, c, bw_gbs, target, model=""):
    """The figures of one report against the roofline, as a dict."""
    bw = bw_gbs * 1e9
    b1 = report["scenarios"]["batch1_decode"]
    tok_s = statistics.median(b1["decode_tok_s"])
    context = b1["input_len"] + b1["output_len"] / 2  # mean tokens attended per decode step
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    layers = c["num_hidden_layers"]
    window = c.get("sliding_window") or 0
    per_key = 2 * c["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    kv_full = layers * per_key * context
    kv = sum(per_key * (min(window, context) if window and sliding(c, i) else context)
             for i in range(layers))
    step = report["decode_bytes_per_token"] + kv
    roof = bw / step
    return {"model": model, "architecture": c["architectures"][0], "decode_tok_s": tok_s,
            "copy_bandwidth_gbs": bw_gbs, "active_weight_bytes": report["decode_bytes_per_token"],
            "mean_context": context, "kv_bytes": kv, "kv_bytes_full_context": kv_full,
            "sliding_layers": sum(1 for i in range(layers) if window and sliding(c, i)),
            "sliding_window": window, "bytes_per_step": step, "roofline_tok_s": roof,
            "fraction": tok_s / roof, "target": target}


def main():
    report, config = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
    target = float(sys.argv[5])
    r = roofline(report, config, float(sys.argv[3]), target, sys.argv[2])
    json.dump(r, open(sys.argv[4], "w"), indent=2)
    print(f"batch-1 decode {r['decode_tok_s']:.1f} tok/s at context {r['mean_context']:.0f}; "
          f"{r['bytes_per_step'] / 1e9:.3f} GB a step ({r['active_weight_bytes'] / 1e9:.3f} GB "
          f"active weights + {r['kv_bytes'] / 1e6:.1f} MB KV; "
          f"{r['kv_bytes_full_context'] / 1e6:.1f} MB without the windows) at "
          f"{r['copy_bandwidth_gbs']:.0f} GB/s: roofline {r['roofline_tok_s']:.1f} tok/s, "
          f"fraction {r['fraction']:.3f} (target {target})")
    return 0 if r["fraction"] >= target else 1


if __name__ == "__main__":
    sys.exit(main())
