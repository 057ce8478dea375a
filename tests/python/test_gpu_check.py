"""scripts/gpu-check without a GPU: its failure digest, from the decode-ab part run on binaries that
fail (a made-up kernel_bench printing a googletest failure among many lines, and no tessera at
all; a device run returns only the end of its output, so the failed steps' first failure
messages and their names must come last); its trace part on a made-up nsys and a made-up CUPTI
run; and its blocks part on a made-up moe_bench_blocks."""

import json
import os
import subprocess
from pathlib import Path

from test_bench_scripts import BLOCKS, CHAIN, blocks_csv, chain_csv

GPU_CHECK = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def test_failed_steps_and_their_first_failures_come_last(tmp_path):
    bin_dir, tests_dir, out = tmp_path / "bin", tmp_path / "tests", tmp_path / "out"
    bin_dir.mkdir()
    tests_dir.mkdir()
    bench = tests_dir / "kernel_bench"
    # A failure message followed by more lines than a step's log tail shows.
    bench.write_text("#!/bin/sh\necho '[ RUN      ] Kernel.Case'\n"
                     "echo 'kernel_test.cpp:12: Failure'\necho 'Expected equality: 1 and 2'\n"
                     "i=0; while [ $i -lt 60 ]; do echo \"filler $i\"; i=$((i+1)); done\n"
                     "exit 1\n")
    bench.chmod(0o755)
    env = dict(os.environ, OLD_BIN_DIR=str(tmp_path / "old"), GPU_CHECK_PARTS="decode-ab",
               DECODE_AB_PRESETS="llama3-8b", DECODE_AB_ROUNDS="1", DECODE_AB_ASYNC="0",
               WORK_DIR=str(tmp_path / "work"))
    r = subprocess.run(["bash", str(GPU_CHECK), str(bin_dir), str(tests_dir), str(out)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    steps = ("kernel_bench_bw decode_ab_llama3-8b_old_1 decode_ab_llama3-8b_new_1 "
             "decode_ab_summary")
    assert lines[-1].startswith(f"gpu-check: 4 failure(s) ({steps})"), lines[-1]
    first = next(i for i, line in enumerate(lines)
                 if line.startswith("--- kernel_bench_bw failed"))
    digest = "\n".join(lines[first:])
    # The googletest failure, though 60 lines before the log's end, and each step's own error.
    assert "kernel_test.cpp:12: Failure" in digest and "Expected equality: 1 and 2" in digest
    assert "filler 59" not in digest
    assert digest.count("tessera: No such file or directory") == 2
    assert "decode_ab.py: no reports" in digest


def test_steps_filter_runs_only_the_named_steps(tmp_path):
    # GPU_CHECK_STEPS picks steps by name within the parts: the decode-ab part on binaries that
    # do not exist runs only its summary, which fails alone; the others say they were skipped.
    env = dict(os.environ, OLD_BIN_DIR=str(tmp_path / "old"), GPU_CHECK_PARTS="decode-ab",
               DECODE_AB_PRESETS="llama3-8b", DECODE_AB_ROUNDS="1", DECODE_AB_ASYNC="0",
               WORK_DIR=str(tmp_path / "work"), GPU_CHECK_STEPS="decode_ab_summ.*")
    args = ["bash", str(GPU_CHECK), str(tmp_path / "bin"), str(tmp_path / "tests"),
            str(tmp_path / "out")]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("gpu-check: 1 failure(s) (decode_ab_summary)"), lines[-1]
    for name in ("kernel_bench_bw", "decode_ab_llama3-8b_old_1", "decode_ab_llama3-8b_new_1"):
        assert f"--- {name}: skipped (not in GPU_CHECK_STEPS)" in lines, r.stdout
        assert not (tmp_path / "out" / f"{name}.log").exists()
    # Not a regular expression: refused before any step, naming it (it would skip every step).
    env["GPU_CHECK_STEPS"] = "decode_ab_(summary"
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "GPU_CHECK_STEPS='decode_ab_(summary' is not an extended regular expression" in r.stderr
    assert "===" not in r.stdout


def test_trace_part_reads_the_chains_timeline_by_nsys_or_cupti(tmp_path):
    tests_dir, out, work = tmp_path / "tests", tmp_path / "out", tmp_path / "work"
    tests_dir.mkdir()
    trace = tmp_path / "made-up.csv"
    chain_csv(trace, 60)
    # The made-up nsys: `profile` checks what gpu-check asks for (moe_bench's chain alone, graph
    # nodes traced) and writes the report; `stats` writes the kernels' CSV where it is told to.
    nsys = tmp_path / "nsys"
    nsys.write_text(f"""#!/bin/bash
set -e
case $1 in
  profile)
    [[ $MOE_BENCH_PROFILE == 1 && " $* " == *" --capture-range=cudaProfilerApi "* &&
       " $* " == *" --cuda-graph-trace=node "* && " $* " == *"/moe_bench --batch 1 "* ]]
    while [[ $1 != -o ]]; do shift; done
    touch "$2.nsys-rep" ;;
  stats)
    while [[ $1 != -o ]]; do shift; done
    [[ -f $3 ]]
    cp {trace} "$2_cuda_gpu_trace.csv" ;;
  *) exit 2 ;;
esac
""")
    nsys.chmod(0o755)
    env = dict(os.environ, GPU_CHECK_PARTS="trace", WORK_DIR=str(work), NSYS=str(nsys))
    args = ["bash", str(GPU_CHECK), str(tmp_path / "bin"), str(tests_dir), str(out)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("gpu-check: 0 failure(s)")
    got = json.loads((out / "bench" / "chain-trace.json").read_text())
    assert got["layers"] == 59
    assert abs(got["period_us"] - sum(cost for _, _, cost in CHAIN)) < 1e-9
    # No nsys where NSYS points and no CUPTI library: the step fails and says what to do.
    env["NSYS"] = str(tmp_path / "no-nsys")
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "install Nsight Systems, set NSYS to its path, or build with CUPTI" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("gpu-check: 1 failure(s) (chain_trace)")
    # No nsys but the CUPTI library beside the tests: moe_bench runs with the library injected
    # and writes the same CSV where KERNEL_TRACE_CSV says (here a made-up moe_bench does).
    (tests_dir / "libkernel_trace.so").write_bytes(b"")
    moe_bench = tests_dir / "moe_bench"
    moe_bench.write_text(f"""#!/bin/bash
set -e
[[ $MOE_BENCH_PROFILE == 1 && $CUDA_INJECTION64_PATH == {tests_dir}/libkernel_trace.so &&
   "$*" == "--batch 1" ]]
[[ -z $NO_TRACE ]] && cp {trace} "$KERNEL_TRACE_CSV"
exit 0
""")
    moe_bench.chmod(0o755)
    (out / "bench" / "chain-trace.json").unlink()
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the kernel timeline comes from CUPTI" in r.stdout
    assert json.loads((out / "bench" / "chain-trace.json").read_text())["layers"] == 59
    # The library wrote nothing (CUPTI refused): a failure that says so, not a stale CSV read.
    env["NO_TRACE"] = "1"
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "CUPTI wrote no kernel trace" in r.stdout


def test_blocks_part_reads_the_chains_blocks_or_says_how_to_build_them(tmp_path):
    tests_dir, out, work = tmp_path / "tests", tmp_path / "out", tmp_path / "work"
    tests_dir.mkdir()
    env = dict(os.environ, GPU_CHECK_PARTS="blocks", WORK_DIR=str(work))
    args = ["bash", str(GPU_CHECK), str(tmp_path / "bin"), str(tests_dir), str(out)]
    # No block-trace build packed: the step fails and says how to make one.
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "-DTESSERA_BLOCK_TRACE=ON" in r.stdout and "BLOCK_TRACE_BUILD" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("gpu-check: 1 failure(s) (chain_blocks)")
    # A made-up moe_bench_blocks writes its records where MOE_BENCH_BLOCKS says.
    records = tmp_path / "made-up-blocks.csv"
    blocks_csv(records, 60)
    fake = tests_dir / "moe_bench_blocks"
    fake.write_text(f"""#!/bin/bash
set -e
[[ -n $MOE_BENCH_BLOCKS && "$*" == "--batch 1" ]]
cp {records} "$MOE_BENCH_BLOCKS"
""")
    fake.chmod(0o755)
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((out / "bench" / "blocks.json").read_text())
    assert got["layers"] == 59
    assert abs(got["period_us"] - sum(c for *_, c in BLOCKS)) < 1e-9


# ---- the multi part (issue 31) on made-up GPUs, binaries and parity script ----

FAKE_TESSERA = r'''#!/usr/bin/env python3
import http.server, json, os, re, signal, sys
a = sys.argv[1:]
log = os.environ["FAKE_LOG"]
def opt(name):
    return a[a.index(name) + 1] if name in a else None
def plan():
    j = " ".join(a)
    tp = int((re.search(r"-tp (\d+)", j) or [0, 1])[1])
    pp = int((re.search(r"-pp (\d+)", j) or [0, 1])[1])
    dp = int((re.search(r"-dp (\d+)", j) or [0, 1])[1])
    return tp, pp, dp
with open(log, "a") as f:
    f.write(" ".join(a) + "\n")
if a[0] == "make-model":
    os.makedirs(opt("--out"), exist_ok=True)
    open(os.path.join(opt("--out"), "config.json"), "w").write("{}")
elif a[:2] == ["bench", "report"]:
    tp, pp, _ = plan()
    speed = {1: 1.0, 2: float(os.environ.get("FAKE_TP2_SPEEDUP", "1.9")), 4: 3.4, 8: 6.0}[tp]
    big = "70b" in opt("--model")
    tok = (30.0 if big else 200.0) * speed
    r = {"device": "NVIDIA H200", "command": " ".join(a), "scenarios": {
        "batch1_decode": {"decode_tok_s": [tok, tok * 1.01, tok * 0.99],
                          "ttft_ms": [50.0 if big else 6.0] * 3},
        "batch64_decode": {"decode_tok_s": [9000.0 * speed] * 2},
        "prefill_4096": {"ms": [100.0 / speed] * 5}}}
    json.dump(r, open(opt("--output-json"), "w"))
elif a[:2] == ["bench", "throughput"]:
    tp, pp, dp = plan()
    tok = {(1, 1, 1): 9000.0, (2, 1, 1): 14000.0, (1, 2, 1): 16000.0,
           (1, 1, 2): 17000.0}[(tp, pp, dp)]
    json.dump({"output_tokens_per_second": tok}, open(opt("--output-json"), "w"))
elif a[0] == "serve":
    assert "-tp 2" in " ".join(a), a
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    s = http.server.HTTPServer(("127.0.0.1", int(opt("--port"))), H)
    signal.signal(signal.SIGINT, lambda *x: os._exit(0))
    s.serve_forever()
elif a[0] == "doctor":
    if "--json" in a:
        print(json.dumps({"findings": []}))
elif a[0] == "start":
    d = os.path.join(opt("--temp-dir"), "session_1", "logs")
    os.makedirs(d, exist_ok=True)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    with open(os.path.join(d, "daemons.txt"), "a") as f:
        f.write(f"{'head' if '--head' in a else 'member'} {gpu}\n")
    if os.environ.get("NCCL_P2P_DISABLE") == "1" and os.environ.get("NCCL_SHM_DISABLE") == "1":
        open(os.path.join(d, f"actor-{gpu}.log"), "w").write(
            "NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0\n")
'''

FAKE_PARITY = r'''#!/usr/bin/env python3
import json, os, sys
a = sys.argv[1:]
out, extra = a[a.index("--out") + 1], a[a.index("--extra-args") + 1] if "--extra-args" in a else ""
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(f"parity {os.path.basename(out)} [{extra}]\n")
ids = [[5, 6, 7], [8, 9]] if "-pp 2" not in extra else [[5, 6, 7], [8, 4]]
json.dump({"pass": True, "cases": [{"verdict": "pass", "identical_prefix": len(i),
                                    "tessera_output_ids": i} for i in ids]}, open(out, "w"))
'''

FAKE_ALLREDUCE = r'''#!/bin/sh
echo "[ RUN      ] CustomAllReduce.TimingReport"
echo "custom all-reduce, bf16, 2 ranks on distinct GPUs, inside a CUDA graph of 20 calls:"
echo "   bytes one-shot two-shot auto auto algo + norm fused NCCL NCCL/auto busbw"
echo "   8192  3.10  4.20  3.10 one-shot  5.90  4.10 12.00 3.87   2.6 GB/s"
echo "   65536 4.00  4.80  4.00 one-shot  6.90  5.20 14.00 3.50  16.4 GB/s"
echo "   8388608 80.00 40.00 40.00 two-shot 45.00 44.00 35.00 0.88 209.7 GB/s"
echo "  target: <= 5 us at 8 KiB fused"
'''


def multi_fixture(tmp_path, gpus):
    bin_dir, tests_dir, fake = tmp_path / "bin", tmp_path / "tests", tmp_path / "fake"
    for d in (bin_dir, tests_dir, fake):
        d.mkdir(exist_ok=True)
    for path, text in ((bin_dir / "tessera", FAKE_TESSERA), (fake / "parity.py", FAKE_PARITY),
                       (tests_dir / "custom_all_reduce_test", FAKE_ALLREDUCE),
                       (fake / "nvidia-smi",
                        "#!/bin/sh\ni=0\nwhile [ $i -lt $FAKE_GPUS ]; do\n"
                        "  case \"$1\" in -L) echo \"GPU $i: NVIDIA H200 (UUID: GPU-$i)\" ;;\n"
                        "  --query-gpu=name) echo 'NVIDIA H200' ;; esac\n  i=$((i+1))\ndone\n")):
        path.write_text(text)
        path.chmod(0o755)
    env = dict(os.environ, GPU_CHECK_PARTS="multi", WORK_DIR=str(tmp_path / "work"),
               GPU_PARITY=str(fake / "parity.py"), FAKE_LOG=str(tmp_path / "calls.log"),
               FAKE_GPUS=str(gpus), PATH=f"{fake}:{os.environ['PATH']}", MULTI_PROMPTS="10",
               # rank_kill.py needs a real server: tests/python/test_rank_kill.py runs it.
               GPU_CHECK_STEPS="make_.*|multi_(gpu_count|allreduce|parity_.*|report_.*|"
                               "throughput_.*|serve_ready_tp2|two_nodes|doctor|summary)")
    args = ["bash", str(GPU_CHECK), str(bin_dir), str(tests_dir), str(tmp_path / "out")]
    return args, env


def test_multi_part_gathers_issue_31s_figures_and_fails_a_missed_target(tmp_path):
    args, env = multi_fixture(tmp_path, 2)
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("gpu-check: 0 failure(s)"), r.stdout
    got = json.loads((tmp_path / "out" / "bench" / "multi-gpu.json").read_text())
    assert got["gpu_count"] == 2 and got["missed"] == []
    # Every plan two GPUs allow, parity against transformers, and PP=2's second prompt differing
    # from TP=1's tokens (the made-up script's) shows in same_tokens_as_tp1.
    for m in ("llama3-8b", "qwen3-8b"):
        assert sorted(got["parity"][m]) == (["pp2", "tp1", "tp2", "two_nodes"] if m == "llama3-8b"
                                            else ["pp2", "tp1", "tp2"])
    assert got["parity"]["llama3-8b"]["pp2"]["same_tokens_as_tp1"] == [True, False]
    assert got["parity"]["qwen3-8b"]["tp2"]["same_tokens_as_tp1"] == [True, True]
    calls = (tmp_path / "calls.log").read_text()
    assert "parity parity_llama3-8b_tp2.json [-tp 2]" in calls
    assert "parity parity_qwen3-8b_pp2.json [-pp 2]" in calls
    assert "parity parity_llama3-8b_two_nodes.json [--address 127.0.0.1:6391 -tp 2]" in calls
    assert "tp4" not in calls and "llama3-70b" not in calls  # two GPUs: no 4-GPU plan
    assert "doctor --temp-dir" in calls and "-tp auto" in calls
    assert json.loads((tmp_path / "out" / "bench" / "multi" / "doctor.json").read_text())
    decode = got["decode"]["llama3-8b"]
    assert abs(decode["tp2_over_tp1"] - 1.9) < 1e-9 and decode["tp1"]["ttft_ms"] == 6.0
    assert abs(got["throughput"]["pp2_over_tp1"] - 16000 / 9000) < 1e-9
    assert abs(got["throughput"]["dp2_over_tp2"] - 17000 / 14000) < 1e-9
    assert 0 <= got["serve_ready_tp2_s"] < 20
    # The two daemons saw one GPU each; NCCL's socket transport was found in their logs.
    two = (tmp_path / "out" / "multi_two_nodes.log").read_text()
    assert "via NET/Socket" in two
    logs = tmp_path / "out" / "two_nodes_logs"
    assert (logs / "daemons.txt").read_text() == "head 0\nmember 1\n"
    assert sorted(p.name for p in logs.glob("actor-*.log")) == ["actor-0.log", "actor-1.log"]
    rows = got["allreduce"]["2"]
    assert [row["bytes"] for row in rows] == [8192, 65536, 8388608]
    assert rows[0]["fused_us"] == 4.1 and rows[0]["nccl_us"] == 12.0
    assert got["allreduce"]["2_nccl_faster_from_bytes"] == 8388608
    names = [t["name"] for t in got["targets"] if t["met"] is None]
    assert names == ["a rank SIGKILLed mid-step: named in 2 s, restarted, no unstreamed request "
                     "lost"]  # its step was left out above

    # TP=2 only 1.5x TP=1: the summary fails, naming the target.
    env.update(FAKE_TP2_SPEEDUP="1.5", GPU_CHECK_STEPS="multi_(gpu_count|report_.*|summary)")
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("gpu-check: 1 failure(s) (multi_summary)")
    assert "MISSED       llama3-8b TP=2 batch-1 decode over TP=1: 1.5" in r.stdout

    # The slice gpu-check's header gives as an example: the llama3-8b parity and the two nodes.
    env.update(FAKE_TP2_SPEEDUP="1.9", GPU_CHECK_STEPS=(
        "make_llama3_8b|multi_(gpu_count|parity_llama3-8b_.*|two_nodes|summary)"))
    r = subprocess.run(args[:-1] + [str(tmp_path / "slice")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "slice" / "bench" / "multi-gpu.json").read_text())
    assert list(got["parity"]) == ["llama3-8b"] and got["decode"] == {}
    assert sorted(got["parity"]["llama3-8b"]) == ["pp2", "tp1", "tp2", "two_nodes"]

    # One GPU: the part says what it needs and runs nothing else.
    env.update(FAKE_GPUS="1", GPU_CHECK_STEPS="multi_gpu_count")
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert "the multi part needs 2 or more GPUs; this machine has 1" in r.stdout
