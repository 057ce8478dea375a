#!/usr/bin/env python3
"""Starts `tessera serve` on a model, checks it as a client would, and loads it.

  serve_check.py --tessera BIN --model DIR --out OUT.json [--extra-args "..."]

Checks (each must hold, else exit 1): /health is 200; a greedy completion asked twice gives the
same text and the second finds its prompt in the prefix cache; a stream adds up to the
non-streaming answer and ends in [DONE]; chat answers as the assistant. Then the load: for each
concurrency C, C clients stream requests of --input-len random-word prompts and --output-len
tokens (ignore_eos) until --num-prompts are done; output tokens/s, TTFT and inter-token latency
percentiles through HTTP. Python's standard library only (the GPU machine has no network).
"""
import argparse
import http.client
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time


def post(port, path, body, stream=False):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if not stream:
        data = resp.read()
        conn.close()
        return resp.status, json.loads(data)
    return resp, conn


def stream_events(resp):
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def health(port):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return 0


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def kill_under_load(port, server_pid, body, expected_text):
    """SIGKILLs the (first) actor while 32 streams run; times the 503 and the way back."""
    import os
    import signal
    actors = [a for d in children(server_pid) for a in children(d)]
    if not actors:
        return {"ok": False, "why": "no actor process found"}
    outcomes = []

    def stream():
        try:
            resp, c = post(port, "/v1/completions",
                           {"prompt": "Keep going", "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}, stream=True)
            status = "done"
            for e in stream_events(resp):
                if e is not None and "error" in e:
                    status = "error: " + e["error"]["message"][:120]
            c.close()
            outcomes.append(status)
        except Exception as ex:  # noqa: BLE001
            outcomes.append("exception: " + str(ex)[:120])

    threads = [threading.Thread(target=stream) for _ in range(32)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    t0 = time.time()
    os.kill(actors[0], signal.SIGKILL)
    down = None
    while time.time() - t0 < 30:
        if health(port) == 503:
            down = time.time() - t0
            break
        time.sleep(0.05)
    up = None
    while time.time() - t0 < 300:
        if health(port) == 200:
            up = time.time() - t0
            break
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=120)
    s, again = post(port, "/v1/completions", body)
    same = s == 200 and again["choices"][0]["text"] == expected_text
    errors = sum(1 for o in outcomes if o.startswith("error"))
    return {"ok": down is not None and up is not None and same and errors == len(outcomes),
            "seconds_to_503": down, "seconds_to_200": up, "same_answer_after": same,
            "streams_failed_naming_cause": errors, "streams": len(outcomes),
            "sample_error": next((o for o in outcomes if o.startswith("error")), None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra-args", default="")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--kill-actor", action="store_true",
                    help="then SIGKILL the actor under load: /health must turn 503, come back "
                         "200, and answer as before")
    a = ap.parse_args()

    cmd = [a.tessera, "serve", a.model, "--port", "0", "--dtype", "bfloat16"] + a.extra_args.split()
    t0 = time.time()
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    port = None
    for line in server.stdout:
        m = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        print("serve_check: the server did not start", file=sys.stderr)
        return 1
    ready_s = time.time() - t0
    print(f"ready in {ready_s:.1f} s on port {port}")
    failures = []
    results = {"command": " ".join(cmd), "ready_seconds": ready_s, "checks": {}, "load": []}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        results["checks"]["health"] = ok
        ok or failures.append("health")

        prompt = "The history of the city begins " + " ".join(f"w{i}" for i in range(200))
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        s1, r1 = post(port, "/v1/completions", body)
        s2, r2 = post(port, "/v1/completions", body)
        same = s1 == s2 == 200 and r1["choices"][0]["text"] == r2["choices"][0]["text"]
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"] if s2 == 200 else 0
        results["checks"]["prefix_cache_same_text"] = same
        results["checks"]["prefix_cache_cached_tokens"] = cached
        same or failures.append("prefix cache changed the answer")
        cached > 0 or failures.append("no prefix cache hit")

        resp, c = post(port, "/v1/completions", dict(body, stream=True), stream=True)
        text, done = "", False
        for e in stream_events(resp):
            if e is None:
                done = True
            elif e["choices"]:
                text += e["choices"][0]["text"]
        c.close()
        ok = done and text == r1["choices"][0]["text"]
        results["checks"]["stream_equals_whole"] = ok
        ok or failures.append("stream differs")

        s, chat = post(port, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        ok = s == 200 and chat["choices"][0]["message"]["role"] == "assistant"
        results["checks"]["chat"] = ok
        ok or failures.append("chat")

        rng = random.Random(0)
        words = [f"x{rng.randrange(5000)}" for _ in range(200000)]
        for conc in [int(x) for x in a.concurrency.split(",")]:
            n = a.num_prompts if conc > 1 else min(16, a.num_prompts)
            lock = threading.Lock()
            todo = list(range(n))
            ttft, itl, out_tokens, errors = [], [], [0], [0]

            def client():
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop()
                    start = rng.randrange(len(words) - a.input_len)
                    p = " ".join(words[start:start + a.input_len // 2])
                    t = time.time()
                    try:
                        resp, c = post(port, "/v1/completions",
                                       {"prompt": p, "max_tokens": a.output_len,
                                        "ignore_eos": True, "stream": True, "temperature": 0.8},
                                       stream=True)
                        last, first = t, None
                        count = 0
                        for e in stream_events(resp):
                            if e is not None and "error" in e:
                                raise RuntimeError(e["error"]["message"])
                            if e is None or not e["choices"]:
                                continue
                            now = time.time()
                            if first is None:
                                first = now
                                with lock:
                                    ttft.append(now - t)
                            else:
                                with lock:
                                    itl.append(now - last)
                            last = now
                            count += 1
                        c.close()
                        with lock:
                            out_tokens[0] += count
                    except Exception as ex:  # noqa: BLE001
                        with lock:
                            errors[0] += 1
                        print("request failed:", ex, file=sys.stderr)

            t = time.time()
            threads = [threading.Thread(target=client) for _ in range(conc)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            dt = time.time() - t
            row = {"concurrency": conc, "requests": n, "seconds": dt,
                   "output_tokens": out_tokens[0], "output_tok_per_s": out_tokens[0] / dt,
                   "errors": errors[0],
                   "ttft_p50_ms": 1000 * (percentile(ttft, 50) or 0),
                   "ttft_p99_ms": 1000 * (percentile(ttft, 99) or 0),
                   "itl_p50_ms": 1000 * (percentile(itl, 50) or 0),
                   "itl_p99_ms": 1000 * (percentile(itl, 99) or 0)}
            print(json.dumps(row))
            results["load"].append(row)
            errors[0] == 0 or failures.append(f"{errors[0]} failed requests at concurrency {conc}")
        if a.kill_actor:
            kill = kill_under_load(port, server.pid, body, r1["choices"][0]["text"])
            results["kill_actor"] = kill
            kill["ok"] or failures.append("recovery after a killed actor: " + json.dumps(kill))
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/metrics")
        results["metrics"] = [l for l in conn.getresponse().read().decode().splitlines()
                              if l.startswith("vllm:") and "_bucket" not in l]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    results["failures"] = failures
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print("failures:", failures or "none")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
