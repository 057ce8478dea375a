"""scripts/pack-device's BLOCK_TRACE_BUILD without a GPU, on made-up builds in a copy of the
tree (the script packs the tree it sits in): a build that was not configured with
-DTESSERA_BLOCK_TRACE=ON is refused with the way to make one, before a device call would find
out; a block-trace build's moe_bench is packed as .device/tests/moe_bench_blocks."""

import os
import shutil
import subprocess
from pathlib import Path

PACK_DEVICE = Path(__file__).resolve().parents[2] / "scripts" / "pack-device"


def made_up_build(path, block_trace):
    """A build directory with the two binaries pack-device copies and a moe_bench."""
    (path / "bin").mkdir(parents=True)
    (path / "tests").mkdir()
    for name in ("bin/tessera", "bin/tessera-actor", "tests/moe_bench"):
        f = path / name
        f.write_text(f"#!/bin/sh\necho {path.name} {name}\n")
        f.chmod(0o755)
    (path / "CMakeCache.txt").write_text(
        f"TESSERA_BLOCK_TRACE:BOOL={'ON' if block_trace else 'OFF'}\n")


def test_block_trace_build_is_packed_or_refused_with_how_to_make_one(tmp_path):
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "tests" / "assets" / "tokenizers").mkdir(parents=True)
    shutil.copy(PACK_DEVICE, tree / "scripts" / "pack-device")
    made_up_build(tree / "build", block_trace=False)
    made_up_build(tree / "build-blk", block_trace=True)
    args = ["bash", str(tree / "scripts" / "pack-device"), str(tree / "build"), "cuda"]

    # An ordinary build named as the block-trace one: refused, naming the way to make one.
    env = dict(os.environ, BLOCK_TRACE_BUILD=str(tree / "build"))
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "-DTESSERA_BLOCK_TRACE=ON" in r.stderr and "ninja moe_bench" in r.stderr
    assert not (tree / ".device" / "tests" / "moe_bench_blocks").exists()

    # The block-trace build's moe_bench goes in beside the ordinary one.
    env = dict(os.environ, BLOCK_TRACE_BUILD=str(tree / "build-blk"))
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    tests = tree / ".device" / "tests"
    assert "build-blk tests/moe_bench" in (tests / "moe_bench_blocks").read_text()
    assert "build tests/moe_bench" in (tests / "moe_bench").read_text()
    assert (tree / ".devpack" / "pack.tar.xz").stat().st_size > 0
