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
