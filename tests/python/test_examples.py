"""The example driver scripts of examples/python, run as a user runs them, against the tiny
model on the CPU."""

import re
import subprocess
import sys

from conftest import SOURCE, python_env
from test_cluster import head  # noqa: F401 (fixture)

EXAMPLES = SOURCE / "examples" / "python"


def run_example(name, *args):
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                       text=True, env=python_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_offline_inference(tiny_model):
    out = run_example("offline_inference.py", "--model", tiny_model)
    assert out.count("Generated text:") == 4


def test_chat(tiny_model):
    out = run_example("chat.py", "--model", tiny_model)
    assert "<|start_header_id|>user<|end_header_id|>" in out
    assert out.count("Generated text:") == 3


def test_streaming(tiny_model):
    out = run_example("streaming.py", "--model", tiny_model)
    assert out.startswith("Once upon a time")
    assert re.search(r"\[(length, 48|stop, \d+) tokens\]", out), out


def test_cluster_tensor_parallel(head, tiny_model):  # noqa: F811
    address, token = head
    out = run_example("cluster_tensor_parallel.py", "--model", tiny_model, "--address", address,
                      "--cluster-token-file", token)
    assert f"at {address}" in out and "plan: stage 0" in out
    assert out.count("Generated text:") == 2
