"""Fixtures of the Python module's tests: the built package (PYTHONPATH, set by ctest or
scripts/test-python), a tiny seeded Llama checkpoint written by `tessera make-model`, and one
LLM on the CPU backend shared by the tests that only generate."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tessera
from tessera import _tessera

SOURCE = Path(__file__).resolve().parents[2]
TOKENIZER = SOURCE / "tests" / "assets" / "tokenizers" / "llama3"


def tessera_binary() -> str:
    return tessera._binary()


def run_tessera(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([tessera_binary(), *args], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    if not (TOKENIZER / "tokenizer.json").exists():
        pytest.fail(f"{TOKENIZER} is missing: run scripts/fetch-test-assets")
    out = tmp_path_factory.mktemp("model") / "tiny"
    r = run_tessera("make-model", "--arch", "llama", "--preset", "tiny", "--tokenizer",
                    str(TOKENIZER), "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return str(out)


# Module scope: tessera.shutdown() (test_cluster) closes every open LLM, as Ray's does.
@pytest.fixture(scope="module")
def llm(tiny_model):
    with tessera.LLM(tiny_model, device="cpu", max_model_len=512) as model:
        yield model


def python_env() -> dict:
    """The environment a child Python needs to import the package under test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env
