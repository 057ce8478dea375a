"""scripts/bench/roofline.py and decode_ab.py (gpu-check's models and decode-ab parts) on made-up
`tessera bench report` JSONs: the roofline's bytes (sliding layers read at most their window),
the fraction against the target and its exit status, and decode-ab's medians and ratios; and
chain_trace.py on a made-up nsys kernel trace; block_trace.py on made-up block records."""

import csv
import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def report(tok_s, weight_bytes=20_000_000_000, input_len=128, output_len=256):
    return {"decode_bytes_per_token": weight_bytes, "device": "test", "command": "made up",
            "scenarios": {"batch1_decode": {"decode_tok_s": tok_s, "input_len": input_len,
                                            "output_len": output_len,
                                            "gpu_forward_ms_median": 1.0, "step_ms_median": 1.1}}}


GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 512, "num_attention_heads": 8,
          "head_dim": 64, "num_key_value_heads": 2, "num_hidden_layers": 4, "sliding_window": 64}


def run(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True)


def test_roofline_counts_the_window_and_the_target(tmp_path):
    rep, cfg = tmp_path / "r.json", tmp_path / "config.json"
    rep.write_text(json.dumps(report([90.0, 100.0, 95.0])))
    cfg.write_text(json.dumps(GEMMA2))
    out = tmp_path / "roof.json"
    r = run(SCRIPTS / "roofline.py", rep, cfg, 2000, out, 0.5)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    context = 128 + 256 / 2
    per_key = 2 * 2 * 64 * 2
    # Gemma 2: even layers slide (window 64 < context 256), odd ones read the whole context.
    kv = 2 * per_key * 64 + 2 * per_key * context
    assert got["kv_bytes"] == kv
    assert got["kv_bytes_full_context"] == 4 * per_key * context
    assert got["sliding_layers"] == 2
    assert got["decode_tok_s"] == 95.0  # the median
    roof = 2000e9 / (20_000_000_000 + kv)
    assert abs(got["fraction"] - 95.0 / roof) < 1e-12
    # Above the fraction reached: exit 1.
    assert run(SCRIPTS / "roofline.py", rep, cfg, 2000, out, 0.99).returncode == 1


def test_decode_ab_gives_medians_ratios_and_fails_on_a_missing_run(tmp_path):
    runs, work = tmp_path / "runs", tmp_path / "work"
    runs.mkdir()
    (work / "gemma2-9b-config").mkdir(parents=True)
    (work / "gemma2-9b-config" / "config.json").write_text(json.dumps(GEMMA2))
    rounds = {("old", 1): [100.0], ("old", 2): [104.0], ("new", 1): [110.0], ("new", 2): [112.0]}
    for (side, rnd), tok_s in rounds.items():
        (runs / f"gemma2-9b-{side}-{rnd}.json").write_text(json.dumps(report(tok_s)))
    for side, tok_s in (("old", [101.0]), ("new", [120.0])):
        (runs / f"gemma2-9b-{side}-1-async.json").write_text(json.dumps(report(tok_s)))
    out = tmp_path / "ab.json"
    r = run(SCRIPTS / "decode_ab.py", runs, work, 2000, out)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())["presets"]["gemma2-9b"]
    assert got["sync"]["old"]["rounds_tok_s"] == [100.0, 104.0]
    assert got["sync"]["old"]["median_tok_s"] == 102.0
    assert got["sync"]["new"]["median_tok_s"] == 111.0
    assert abs(got["sync"]["new_over_old"] - 111.0 / 102.0) < 1e-12
    assert abs(got["async"]["new_over_old"] - 120.0 / 101.0) < 1e-12
    roof = got["sync"]["new"]["roofline"]
    assert abs(roof["fraction"] - 111.0 / roof["roofline_tok_s"]) < 1e-12
    (runs / "gemma2-9b-old-1-async.json").unlink()
    assert run(SCRIPTS / "decode_ab.py", runs, work, 2000, out).returncode == 1


def test_decode_ab_without_async_runs_is_complete(tmp_path):
    # gpu-check's DECODE_AB_ASYNC=0 runs no --async-scheduling round: not a missing run, while a
    # missing sync run (or one async side of two) still is.
    runs, work = tmp_path / "runs", tmp_path / "work"
    runs.mkdir()
    for side, tok_s in (("old", [100.0]), ("new", [110.0])):
        (runs / f"llama3-8b-{side}-1.json").write_text(json.dumps(report(tok_s)))
    out = tmp_path / "ab.json"
    r = run(SCRIPTS / "decode_ab.py", runs, work, 0, out)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())["presets"]["llama3-8b"]
    assert abs(got["sync"]["new_over_old"] - 1.1) < 1e-12
    assert "new_over_old" not in got["async"]
    (runs / "llama3-8b-new-1-async.json").write_text(json.dumps(report([1.0])))
    assert run(SCRIPTS / "decode_ab.py", runs, work, 0, out).returncode == 1
    (runs / "llama3-8b-new-1-async.json").unlink()
    (runs / "llama3-8b-new-1.json").unlink()
    assert run(SCRIPTS / "decode_ab.py", runs, work, 0, out).returncode == 1


# A made-up `nsys stats -r cuda_gpu_trace -f csv` of moe_bench's chain: per layer the eight
# kernels, each placed 1 us before the previous one ends (PDL) and ending `cost` us after it.
CHAIN = [("qkv", "gemv_kernel<__nv_bfloat16, __nv_bfloat16, 4, 2, true, 1>", 6.0),
         ("attention", "paged_attention_kernel<__nv_bfloat16, 128, false, true, true>", 5.0),
         ("combine", "attention_combine_kernel<__nv_bfloat16, 128>", 1.5),
         ("o", "gemv_kernel<__nv_bfloat16, __nv_bfloat16, 4, 4, false, 4>", 5.5),
         ("router", "gemv_kernel<__nv_bfloat16, float, 2, 2, true, 4>", 2.0),
         ("route", "route_kernel<float, 128>", 1.75),
         ("gate_up", "gemv_gate_up_kernel<__nv_bfloat16, 2, 1>", 18.0),
         ("down", "gemv_down_combine_kernel<__nv_bfloat16, 8, 2>", 6.25)]


def chain_csv(path, layers, drop=None):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Start (ns)", "Duration (ns)", "CorrId", "Strm", "Name"])
        end = 1_000_000
        w.writerow([end - 5000, 2000, 0, 7, "void memcpy_kernel()"])  # not the chain's
        for layer in range(layers):
            for label, name, cost in CHAIN:
                if (layer, label) == drop:
                    continue
                start, end = end - 1000, end + int(cost * 1000)
                w.writerow([start, end - start, 0, 7, f"void tessera::cuda::{name}(Params)"])


def test_chain_trace_gives_each_kernels_cost_on_the_critical_path(tmp_path):
    trace, out = tmp_path / "chain_cuda_gpu_trace.csv", tmp_path / "chain.json"
    chain_csv(trace, 60, drop=(30, "combine"))  # a layer out of shape is left out
    r = run(SCRIPTS / "chain_trace.py", trace, out)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["layers"] == 58  # 59 layers follow a down; the one without its combine is out
    for label, _, cost in CHAIN:
        k = got["kernels"][label]
        assert abs(k["end_after_previous_end_us"] - cost) < 1e-9, label
        assert abs(k["start_after_previous_end_us"] + 1.0) < 1e-9, label
        assert abs(k["duration_us"] - (cost + 1.0)) < 1e-9, label
    assert abs(got["period_us"] - sum(c for _, _, c in CHAIN)) < 1e-9
    # Too few whole layers for a step: an error, not a table.
    chain_csv(trace, 20)
    r = run(SCRIPTS / "chain_trace.py", trace, out)
    assert r.returncode != 0 and "whole layers" in r.stdout + r.stderr


# The layer's kernels as block_trace.h numbers them: (label, id, blocks, cost in us after the
# previous kernel's end).
BLOCKS = [("qkv", 1, 4, 6.0), ("attention", 4, 2, 4.0), ("combine", 5, 2, 2.0), ("o", 3, 4, 2.5),
          ("router", 2, 2, 3.0), ("route", 6, 1, 2.5), ("gate_up", 7, 6, 18.0),
          ("down", 8, 4, 10.0)]


def blocks_csv(path, layers, drop=None):
    """Made-up block records: in each launch half the blocks (rounded down) start 3 us before the
    kernel before ends, the rest 1 us after; every wait returns 0.5 us after that end; block b
    ends b x 100 ns before the launch's end; block b of a launch runs on SM b (two per SM past
    the third)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "sm", "block", "start", "waited", "end", "at0", "at1"])
        prev_end = 1_000_000
        for layer in range(layers):
            for label, kid, n, cost in BLOCKS:
                if (layer, label) == drop:
                    continue
                end = prev_end + int(cost * 1000)
                for b in range(n):
                    start = prev_end - 3000 if b < n // 2 else prev_end + 1000
                    # The attention marks two points: 1 and 2 us after the kernel before ends.
                    marks = [prev_end + 1000, prev_end + 2000] if label == "attention" else [0, 0]
                    w.writerow([kid, b % 3, b, start, prev_end + 500, end - 100 * b] + marks)
                prev_end = end


def test_block_trace_places_each_block_against_the_kernel_before(tmp_path):
    records, out = tmp_path / "blocks.csv", tmp_path / "blocks.json"
    blocks_csv(records, 60, drop=(30, "router"))  # a layer out of shape is left out
    r = run(SCRIPTS / "block_trace.py", records, out)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["layers"] == 58  # 59 follow a down; the router-less one is out
    assert abs(got["period_us"] - sum(c for *_, c in BLOCKS)) < 1e-9
    for label, _, n, cost in BLOCKS:
        k = got["kernels"][label]
        assert k["blocks"] == n and k["placed_early"] == n // 2, label
        assert k["start_first"] == (-3.0 if n > 1 else 1.0), label
        assert abs(k["wait_median"] - 0.5) < 1e-9, label
        assert abs(k["end_last"] - cost) < 1e-9, label
        assert abs(k["end_first"] - (cost - 0.1 * (n - 1))) < 1e-9, label
        assert k["sms"] == min(n, 3) and k["most_on_one_sm"] == (n + 2) // 3, label
        assert ("at0_median" in k) == (label == "attention"), label
    assert got["kernels"]["attention"]["at0_median"] == 1.0
    assert got["kernels"]["attention"]["at1_median"] == 2.0
    # Too few whole layers: an error, not a table.
    blocks_csv(records, 20)
    r = run(SCRIPTS / "block_trace.py", records, out)
    assert r.returncode != 0 and "whole layers" in r.stdout + r.stderr
