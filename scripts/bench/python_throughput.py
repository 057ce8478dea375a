#!/usr/bin/env python3
"""Offline throughput from a Python script (tessera.LLM.generate) beside `tessera bench
throughput` on the same requests, in one run: the binding's cost is the difference.

    python3 scripts/bench/python_throughput.py --model DIR [--num-prompts 1000]
        [--input-len 1000] [--output-len 1000] [--output-json FILE] [-- ENGINE FLAGS...]

Both get the same prompts (random token ids, written as a --dataset-path file) and the same
sampling: temperature 1.0, request i seeded with seed + i, EOS ignored (bench throughput's).
The CLI runs first, then the script's LLM in this process; each loads the model itself and only
generation is timed. ENGINE FLAGS (e.g. --kv-cache-dtype fp8) go to both: to the CLI as they are
and to LLM() as keywords.
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import tessera
from tessera import LLM, SamplingParams


def engine_keywords(flags):
    """CLI flags ("--kv-cache-dtype fp8", "--enforce-eager") as LLM keywords."""
    out, i = {}, 0
    while i < len(flags):
        name = flags[i].lstrip("-").replace("-", "_")
        if "=" in name:
            name, value = name.split("=", 1)
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            i += 1
        else:
            value = True
        out[name] = value
        i += 1
    return out


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("engine", nargs=argparse.REMAINDER,
                        help="-- then engine flags for both (e.g. --kv-cache-dtype fp8)")
    args = parser.parse_args()
    flags = [f for f in args.engine if f != "--"]

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for p in prompts:
            f.write(json.dumps({"prompt_token_ids": p, "output_len": args.output_len}) + "\n")
        dataset = f.name

    cli_cmd = [tessera._binary(), "bench", "throughput", "--model", args.model,
               "--dataset-path", dataset, "--num-prompts", str(args.num_prompts),
               "--seed", str(args.seed), "--json", *flags]
    print("cli:", " ".join(cli_cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cli_cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"tessera bench throughput failed:\n{r.stderr}")
    cli = json.loads(r.stdout)
    os.unlink(dataset)

    llm = LLM(args.model, **engine_keywords(flags))
    params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.output_len,
                             ignore_eos=True) for i in range(args.num_prompts)]
    print(f"python: LLM.generate of {args.num_prompts} prompts", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    llm.close()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    python = {"elapsed_s": elapsed, "output_tokens": out_tokens,
              "output_tokens_per_second": out_tokens / elapsed,
              "total_tokens_per_second": (out_tokens + args.num_prompts * args.input_len) /
              elapsed}
    cli_rate = cli["output_tokens_per_second"]
    result = {
        "what": "offline throughput: a Python script (tessera.LLM) beside tessera bench "
                "throughput, same prompts and sampling, one run",
        "machine": platform.node(), "commit": commit(),
        "command": " ".join([sys.executable] + sys.argv),
        "shape": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                  "output_len": args.output_len, "engine_flags": flags},
        "cli": cli, "python": python,
        "python_over_cli": python["output_tokens_per_second"] / cli_rate,
    }
    print(f"cli {cli_rate:.0f} output tok/s, python "
          f"{python['output_tokens_per_second']:.0f} output tok/s: python / cli "
          f"{result['python_over_cli']:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
