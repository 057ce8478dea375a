"""scripts/bench/rank_kill.py (gpu-check's `multi` part runs it at -tp 2 on two GPUs) on the CPU
backend, against a real `tessera serve -tp 2` of the tiny model: one of its two actor processes
is SIGKILLed while four requests stream and four wait; the server must name the rank, restart
the group, and complete every request that had not streamed."""

import json
import socket
import subprocess
import sys
from pathlib import Path

from conftest import tessera_binary

RANK_KILL = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "rank_kill.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_kill(model, out, *more):
    return subprocess.run([sys.executable, str(RANK_KILL), "--tessera", tessera_binary(),
                           "--model", model, "--out", str(out), "--extra-args",
                           "--device cpu -tp 2", "--port", str(free_port()), *more],
                          capture_output=True, text=True, timeout=600)


def test_a_killed_rank_is_named_its_group_restarts_and_no_unstreamed_request_is_lost(
        tiny_model, tmp_path):
    out = tmp_path / "kill.json"
    r = rank_kill(tiny_model, out)
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "kill.json.server.log").read_text()
    got = json.loads(out.read_text())
    assert got["pass"] and all(got["checks"].values()), got["checks"]
    assert got["actors_before"] == 2
    assert got["named"] in ("rank 0", "rank 1") and got["named_after_s"] <= 2.0
    assert got["engine_restarts_total"] == 1
    running = [q for q in got["requests"] if q["kind"] == "running"]
    queued = [q for q in got["requests"] if q["kind"] == "queued"]
    # The running ones had streamed and failed with the rank's death (their clients saw part of
    # an answer); the queued ones had not, and all completed after the restart.
    assert len(running) == 4 and all(q["streamed_before_kill"] for q in running)
    assert all(q["error"] and got["named"] in q["error"]["message"] for q in running), running
    assert len(queued) == 4 and got["unstreamed_at_kill"] == 4
    assert all(not q["streamed_before_kill"] and q["status"] == 200 and q["tokens"] == 64 and
               q["finish_reason"] == "length" for q in queued), queued
    assert "rank_kill: " + got["named"] in r.stdout

    # A deadline no server meets: that check fails, and with it the exit status.
    r = rank_kill(tiny_model, tmp_path / "again.json", "--named-within", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL rank named within 0.0 s" in r.stdout
    assert not json.loads((tmp_path / "again.json").read_text())["pass"]
