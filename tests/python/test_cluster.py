"""The cluster from Python: init / nodes / cluster_resources / shutdown, TP and PP on CPU
actors, a head joined by address, what happens to actors on close, on a dead actor and on
Ctrl-C, and the command-line entry points."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

import tessera
from tessera import LLM, SamplingParams
from conftest import python_env, tessera_binary

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = ["The quick brown fox", "Hello, my name is", "1, 2, 3,"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by its parent daemon) has exited too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds=20.0):
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def live_actor_pids(owner="tessera (python)"):
    return [a["pid"] for n in tessera.nodes() for a in n["Actors"]
            if a["state"] != "dead" and a["owner"] == owner]


@pytest.fixture
def local_cluster():
    info = tessera.init()
    yield info
    tessera.shutdown()


def test_init_nodes_resources_shutdown(local_cluster, tiny_model):
    assert tessera.is_initialized() and local_cluster["local_node"]
    with pytest.raises(RuntimeError, match="already"):
        tessera.init()
    assert tessera.init(ignore_reinit_error=True) == local_cluster
    nodes = tessera.nodes()
    assert len(nodes) == 1
    head = nodes[0]
    assert head["Alive"] and head["IsHead"] and head["NodeID"]
    assert head["Draining"] is False
    assert head["Resources"]["CPU"] >= 1 and head["Resources"]["memory"] > 0
    res = tessera.cluster_resources()
    assert res["CPU"] == head["Resources"]["CPU"]
    assert res["node:" + head["NodeManagerAddress"]] == 1.0
    # An LLM made after init() places its actors on this node; close() stops them.
    llm = LLM(tiny_model, device="cpu", max_model_len=256)
    pids = live_actor_pids()
    assert len(pids) == 1 and alive(pids[0])
    llm.close()
    llm.close()  # idempotent
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x", GREEDY)
    tessera.shutdown()
    assert not tessera.is_initialized()
    with pytest.raises(RuntimeError, match="init"):
        tessera.nodes()


def test_deleting_an_llm_frees_its_actors(local_cluster, tiny_model):
    llm = LLM(tiny_model, device="cpu", max_model_len=256)
    pids = live_actor_pids()
    assert pids
    del llm
    assert wait_gone(pids) == []


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(pipeline_parallel_size=2)])
def test_tp_and_pp_match_one_rank(llm, tiny_model, parallel):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(tiny_model, device="cpu", max_model_len=512, **parallel) as split:
        info = split.model_info
        assert info["tensor_parallel_size"] * info["pipeline_parallel_size"] == 2
        got = [o.outputs[0].token_ids for o in split.generate(PROMPTS, GREEDY)]
    assert got == want


def test_dead_actor_raises_naming_the_rank(local_cluster, tiny_model):
    llm = LLM(tiny_model, device="cpu", max_model_len=512, tensor_parallel_size=2)
    pids = live_actor_pids()
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="rank") as err:
        llm.generate(PROMPTS * 4, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert "signal 9" in str(err.value) or "killed" in str(err.value) or "died" in str(
        err.value), str(err.value)
    llm.close()
    assert wait_gone(pids) == []


CTRL_C_CHILD = textwrap.dedent("""
    import json, sys, time
    import tessera
    from tessera import LLM, SamplingParams
    tessera.init()
    llm = LLM(sys.argv[1], device="cpu", max_model_len=512)
    node = tessera.nodes()[0]
    pids = [a["pid"] for a in node["Actors"] if a["state"] != "dead"]
    print(json.dumps({"actors": pids}), flush=True)
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    try:
        llm.generate(["a b c"] * 32, long, use_tqdm=False)
        print("finished before Ctrl-C", flush=True)
    except KeyboardInterrupt:
        t = time.time()
        out = llm.generate("x", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        print(json.dumps({"interrupted": True, "after_s": time.time() - t,
                          "tokens": len(out[0].outputs[0].token_ids)}), flush=True)
    llm.generate(["a b c"] * 32, long, use_tqdm=False)  # a second Ctrl-C ends the script
""")


def test_ctrl_c_aborts_the_requests_and_leaves_no_actor(tiny_model):
    child = subprocess.Popen([sys.executable, "-c", CTRL_C_CHILD, tiny_model],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=python_env())
    try:
        actors = json.loads(child.stdout.readline())["actors"]
        assert actors and all(alive(p) for p in actors)
        time.sleep(1.0)
        child.send_signal(signal.SIGINT)
        line = child.stdout.readline()
        assert line, child.stderr.read()
        after = json.loads(line)
        assert after["interrupted"] and after["tokens"] == 2
        # The aborted requests did not run on: the next call was served at once.
        assert after["after_s"] < 5.0
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode != 0 and "KeyboardInterrupt" in err
    assert wait_gone(actors) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head(tmp_path):
    """A head started as a user starts one (`tessera start --head`), with a token file."""
    token = tmp_path / "token"
    token.write_text("py-test-token-" + "7" * 40 + "\n")
    token.chmod(0o600)
    port = free_port()
    proc = subprocess.Popen([tessera_binary(), "start", "--head", "--block", "--port", str(port),
                             "--temp-dir", str(tmp_path / "root"), "--cluster-token-file",
                             str(token)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.1)
    yield f"127.0.0.1:{port}", str(token)
    proc.terminate()
    proc.wait(timeout=30)


def test_join_by_address(head, tiny_model):
    address, token = head
    with pytest.raises(ValueError):
        tessera.init(address=address, cluster_token_file=os.devnull)
    tessera.init(address=address, cluster_token_file=token)
    try:
        assert tessera.init(ignore_reinit_error=True)["local_node"] is False
        assert tessera.nodes()[0]["Address"] == address
        with LLM(tiny_model, device="cpu", max_model_len=256, tensor_parallel_size=2) as llm:
            assert len(live_actor_pids()) == 2
            assert llm.generate("hi", GREEDY)[0].finished
    finally:
        tessera.shutdown()


# ---- the command-line entry points


def test_python_m_tessera_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "tessera", "--version"], capture_output=True,
                       text=True, env=python_env())
    assert r.returncode == 0 and tessera.__version__ in r.stdout + r.stderr


def test_vllm_api_server_command_line(tiny_model):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tessera.entrypoints.openai.api_server", "--host", "127.0.0.1",
         "--port", str(port), "--model", tiny_model, "--device", "cpu", "--max-model-len",
         "256", "--trust-remote-code"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=python_env())
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    models = json.load(r)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, server.stderr.read()
                time.sleep(0.2)
        assert models["data"][0]["id"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
