#!/usr/bin/env python3
"""A rank of a served model SIGKILLed mid-step, as a user meets it: `tessera serve` must name the
rank within a deadline, start its group again, and lose no request that had not streamed.

    rank_kill.py --tessera BIN --model DIR --out OUT.json [--extra-args "-tp 2"] [--port 8131]
                 [--running 4] [--queued 4] [--max-tokens 1500] [--queued-tokens 64]
                 [--named-within 2.0]

The server runs with --max-num-seqs RUNNING. RUNNING streamed completions start and each streams
a token; then QUEUED more are sent, and wait behind them. One of the server's actor processes
(`tessera-actor` below the server) is SIGKILLed. Checked, each a line of OUT.json's "checks":
- the server's log names the dead rank ("an actor of the served model died: rank N: ...") within
  --named-within seconds of the kill;
- /health answers 200 again and /metrics counts the restart (tessera:engine_restarts_total);
- every request that had streamed nothing at the kill ends with status 200 and all its tokens
  (a request that had streamed may fail: its client has seen part of an answer);
- a request sent after the restart completes.
Exit status 0 iff every check passes. scripts/gpu-check's `multi` part runs it at -tp 2 on two
GPUs; tests/python/test_rank_kill.py runs it on the CPU backend.
"""
import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

NAMED = re.compile(r"an actor of the served model died: (rank \d+)")


def http(url, timeout=30.0):
    """(status, text) of a GET; (0, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, str(e)


class Stream(threading.Thread):
    """One streamed completion: its status, when its first token came, its tokens, how it ended."""

    def __init__(self, base, model, prompt, max_tokens):
        super().__init__(daemon=True)
        self.body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                     "temperature": 0, "ignore_eos": True,
                     "stream_options": {"include_usage": True}}
        self.url, self.max_tokens = base + "/v1/completions", max_tokens
        self.status, self.first_token, self.tokens, self.finish, self.error = 0, None, 0, None, None

    def run(self):
        req = urllib.request.Request(self.url, data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                self.status = r.status
                for raw in r:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    if event.get("usage"):
                        self.tokens = event["usage"].get("completion_tokens", 0)
                    for choice in event.get("choices", []):
                        if self.first_token is None:
                            self.first_token = time.monotonic()
                        if choice.get("finish_reason"):
                            self.finish = choice["finish_reason"]
        except urllib.error.HTTPError as e:
            self.status, self.error = e.code, e.read().decode(errors="replace")[:300]
        except (OSError, ValueError) as e:
            self.error = self.error or f"{type(e).__name__}: {e}"

    def record(self, t_kill):
        streamed = self.first_token is not None and self.first_token < t_kill
        return {"streamed_before_kill": streamed, "status": self.status, "tokens": self.tokens,
                "max_tokens": self.max_tokens, "finish_reason": self.finish, "error": self.error}


def descendants(pid):
    """The pids below pid, from /proc."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


def actors_below(pid):
    out = []
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(argv0) == "tessera-actor":
            out.append(p)
    return sorted(out)


def wait_for(pred, seconds, step=0.05):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def metric(base, name):
    status, text = http(base + "/metrics")
    if status != 200:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra-args", default="", help="more `tessera serve` args (shlex-split)")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--queued", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1500, help="each running request's tokens")
    ap.add_argument("--queued-tokens", type=int, default=64)
    ap.add_argument("--named-within", type=float, default=2.0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    a = ap.parse_args()

    base = f"http://127.0.0.1:{a.port}"
    log_path = a.out + ".server.log"
    cmd = [a.tessera, "serve", a.model, "--port", str(a.port), "--max-num-seqs", str(a.running),
           "--max-model-len", "2048", *shlex.split(a.extra_args)]
    result = {"command": " ".join(shlex.quote(c) for c in cmd), "checks": {}}
    checks = result["checks"]
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        wait_for(lambda: http(base + "/health", timeout=2)[0] == 200 or server.poll() is not None,
                 a.ready_timeout, 0.5)
        if server.poll() is not None or http(base + "/health", timeout=2)[0] != 200:
            raise SystemExit(f"rank_kill: the server did not become ready; its log: {log_path}")
        result["ready_s"] = time.monotonic() - t0
        model = json.loads(http(base + "/v1/models")[1])["data"][0]["id"]
        actors = actors_below(server.pid)
        result["actors_before"] = len(actors)
        if not actors:
            raise SystemExit("rank_kill: no tessera-actor process below the server")

        running = [Stream(base, model, f"Story number {i}: once upon a time", a.max_tokens)
                   for i in range(a.running)]
        for s in running:
            s.start()
        if not wait_for(lambda: all(s.first_token is not None or not s.is_alive()
                                    for s in running), 600):
            raise SystemExit("rank_kill: the running requests streamed nothing in 600 s")
        queued = [Stream(base, model, f"Queued request {i} says", a.queued_tokens)
                  for i in range(a.queued)]
        for s in queued:
            s.start()
        # Queued behind the running ones (--max-num-seqs): waiting, none streamed.
        wait_for(lambda: (metric(base, "vllm:num_requests_waiting") or 0) >= a.queued, 10)
        if any(not s.is_alive() for s in running):
            raise SystemExit("rank_kill: a running request ended before the kill: raise "
                             "--max-tokens")

        victim = actors_below(server.pid)[-1]
        offset = os.path.getsize(log_path)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        named = [None]

        def find_name():
            with open(log_path, errors="replace") as f:
                f.seek(offset)
                m = NAMED.search(f.read())
            if m:
                named[0] = m.group(1)
            return m is not None

        wait_for(find_name, 30, 0.01)
        named_s = time.monotonic() - t_kill
        result["killed_pid"] = victim
        result["named"] = named[0]
        result["named_after_s"] = named_s if named[0] else None
        checks["rank named within %.1f s" % a.named_within] = (
            named[0] is not None and named_s <= a.named_within)

        for s in running + queued:
            s.join(900)
        back = wait_for(lambda: http(base + "/health", timeout=2)[0] == 200, 900, 0.5)
        result["healthy_again_after_s"] = time.monotonic() - t_kill if back else None
        restarts = metric(base, "tessera:engine_restarts_total")
        result["engine_restarts_total"] = restarts
        checks["group restarted (/health 200, a restart counted)"] = bool(back and restarts and
                                                                           restarts >= 1)
        result["requests"] = [dict(s.record(t_kill), kind="running") for s in running] + \
            [dict(s.record(t_kill), kind="queued") for s in queued]
        unstreamed = [r for r in result["requests"] if not r["streamed_before_kill"]]
        result["unstreamed_at_kill"] = len(unstreamed)
        checks["every request that had not streamed completed"] = bool(unstreamed) and all(
            r["status"] == 200 and r["error"] is None and r["tokens"] == r["max_tokens"]
            for r in unstreamed)
        after = Stream(base, model, "After the restart,", 16)
        after.run()
        checks["a request after the restart completed"] = (after.status == 200 and
                                                           after.error is None and
                                                           after.tokens == 16)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
    result["pass"] = all(checks.values())
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"rank_kill: {result['named']} named after "
          f"{result['named_after_s'] if result['named_after_s'] is not None else '-'} s; "
          f"{result['unstreamed_at_kill']} requests had not streamed at the kill; "
          f"{'pass' if result['pass'] else 'FAIL'} ({a.out})")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
