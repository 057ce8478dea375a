#!/usr/bin/env python3
"""Greedy-decoding parity of `tessera generate` on the GPU against Hugging Face transformers
(run on the GPU machine, which has torch and transformers).

    gpu_parity.py --tessera BIN --model DIR --out OUT.json [--max-tokens 64] [--dtype bfloat16]
                  [--extra-args "..."]

One tessera process decodes four fixed prompts greedily (--temperature 0 --ignore-eos
--logprobs 2 --json; one JSON object per prompt per stdout line, in prompt order). Then the
same checkpoint is loaded with transformers in the same dtype on the GPU, and for each prompt
transformers greedily generates the same number of tokens from tessera's own prompt ids
(batch 1, no padding), keeping the raw logits of every step.

Verdict per prompt: identical token sequences pass. Otherwise, at the first divergence i, the
divergence is accepted iff transformers' own top-1/top-2 logit margin at step i is at most
--ulps (default 2) units in the last place of the compute dtype at the top-1 logit's magnitude
(2**(floor(log2|top1|) - mantissa_bits), 7 mantissa bits for bfloat16): the two candidates are
then tied to rounding and either engine may legitimately pick either. Two, not one: when each
engine's two logits are within an ulp of the same values, their margins can differ by two ulps
(each logit off by one, in opposite directions). One ulp was the rule until the Hopper prefill
attention kernel, whose error against the fp32 CPU oracle equals the tile kernel's
(CudaPagedAttention.HopperPrefillMatchesCpu), diverged at margins of exactly two ulps where the
tile kernel's divergences had happened to stay within one. A real fault diverges at margins far
above that. Tokens after the first divergence are not compared (the contexts differ). Exit
status 0 iff every prompt passes.
"""
import argparse
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

# Plain English prompts of about 5, 20, 60 and 200 words.
PROMPTS = [
    "The old lighthouse keeper said",
    "Write a short story about a cat who learns to play the piano in a small town "
    "near the sea.",
    "In the early years of the twentieth century, railways changed the way people lived "
    "and worked. Goods that once took weeks to cross a country could now arrive in days, "
    "and towns that had been isolated for centuries suddenly found themselves connected to "
    "distant cities. Historians still argue about which of these changes mattered most, "
    "and why.",
    "Every spring, the village at the foot of the mountains held a market that lasted for "
    "three days. Farmers came down from the high pastures with cheese, wool and honey, and "
    "traders arrived from the coast with salt, dried fish and bolts of bright cloth. The "
    "square filled with wooden stalls, and the narrow streets around it smelled of bread, "
    "smoke and wet straw. Children ran between the carts, chasing dogs and each other, while "
    "their parents argued over prices in a mixture of dialects that only the oldest "
    "merchants fully understood. On the second evening there was always music: a fiddler, "
    "two drummers and a woman who sang old songs about floods, lost sheep and soldiers who "
    "never came home. People said that the market had been held in the same place for five "
    "hundred years, although nobody could point to a document that proved it. One year a "
    "young engineer arrived with plans for a new road through the valley. He promised that "
    "the journey to the coast would take hours instead of days, and that the village would "
    "grow rich. The elders listened politely, asked many careful questions, and then invited "
    "him to stay for the music before they gave their answer. What did they decide, and what "
    "happened to the market afterwards?",
]

DTYPES = {  # --dtype -> (torch dtype, explicit mantissa bits)
    "bfloat16": (torch.bfloat16, 7),
    "bf16": (torch.bfloat16, 7),
    "float16": (torch.float16, 10),
    "half": (torch.float16, 10),
    "fp16": (torch.float16, 10),
    "float32": (torch.float32, 23),
    "fp32": (torch.float32, 23),
}


def ulp_at(value, mantissa_bits):
    """One unit in the last place of a float with `mantissa_bits` explicit bits at |value|."""
    a = abs(value)
    if a == 0.0 or not math.isfinite(a):
        return 0.0
    return 2.0 ** (math.floor(math.log2(a)) - mantissa_bits)


def run_tessera(args):
    cmd = [args.tessera, "generate", "--model", args.model]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    cmd += ["--temperature", "0", "--max-tokens", str(args.max_tokens), "--ignore-eos",
            "--logprobs", "2", "--dtype", args.dtype, "--json"]
    cmd += shlex.split(args.extra_args or "")
    print("+", shlex.join(cmd), flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"gpu_parity: tessera timed out after {args.timeout} s\nstderr:\n{e.stderr}")
    except OSError as e:
        sys.exit(f"gpu_parity: cannot run {args.tessera}: {e}")
    wall = time.time() - t0
    if proc.stderr:
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"gpu_parity: tessera exited with status {proc.returncode}\n"
                 f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    results, other = [], []
    for line in proc.stdout.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                results.append(json.loads(s))
                continue
            except json.JSONDecodeError as e:
                sys.exit(f"gpu_parity: bad JSON line from tessera ({e}): {s[:400]}")
        other.append(line)
    if other:
        print(f"gpu_parity: warning: {len(other)} non-JSON stdout line(s) from tessera ignored",
              file=sys.stderr)
    if len(results) != len(PROMPTS):
        sys.exit(f"gpu_parity: expected {len(PROMPTS)} JSON objects on tessera's stdout, got "
                 f"{len(results)}\nstdout:\n{proc.stdout[-4000:]}")
    for i, r in enumerate(results):
        for key in ("prompt_ids", "output_ids", "logprobs"):
            if key not in r:
                sys.exit(f"gpu_parity: tessera result {i} has no '{key}'")
    return cmd, results, proc.stderr, other, wall


def tessera_margin(entry):
    """Tessera's top-1 minus top-2 logprob (= the logit margin, since log-softmax shifts all
    logits equally) from one logprobs entry {"token", "logprob", "top": [[id, lp], ...]}."""
    top = entry.get("top") or []
    if len(top) < 2:
        return None, [t[0] for t in top]
    return float(top[0][1]) - float(top[1][1]), [int(t[0]) for t in top]


def compare(idx, tres, model, tokenizer, args, mantissa_bits, pad_id):
    prompt_ids = [int(t) for t in tres["prompt_ids"]]
    tess = [int(t) for t in tres["output_ids"]]
    tess_lp = tres.get("logprobs") or []
    n = args.max_tokens
    res = {
        "index": idx,
        "prompt": PROMPTS[idx],
        "prompt_tokens": len(prompt_ids),
        "prompt_ids": prompt_ids,
        "tessera_output_ids": tess,
        "tessera_text": tres.get("text"),
        "tessera_finish_reason": tres.get("finish_reason"),
    }
    if tokenizer is not None:
        try:
            hf_prompt = tokenizer(PROMPTS[idx], add_special_tokens=True)["input_ids"]
            res["hf_tokenizer_prompt_ids_match"] = list(hf_prompt) == prompt_ids
        except Exception as e:  # informational only
            res["hf_tokenizer_prompt_ids_match"] = f"error: {e}"

    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device="cuda")
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False, temperature=None, top_p=None, top_k=None,
            num_beams=1, repetition_penalty=1.0,
            max_new_tokens=n, min_new_tokens=n,
            eos_token_id=None, pad_token_id=pad_id,
            output_scores=True, output_logits=True, return_dict_in_generate=True,
        )
    hf = out.sequences[0, len(prompt_ids):].tolist()
    raw = out.logits if out.logits is not None else out.scores
    logits = torch.stack([l[0] for l in raw]).float()  # [steps, vocab], fp32 of model-dtype logits
    top2 = torch.topk(logits, 2, dim=-1)
    hf_argmax = top2.indices[:, 0].tolist()
    res["hf_output_ids"] = hf
    # generate()'s choices should be the argmax of the raw logits; a logits processor (e.g. a
    # min-length EOS mask from a model generation config) would break that. Flag it.
    res["hf_tokens_not_raw_argmax"] = [i for i, (a, b) in enumerate(zip(hf, hf_argmax)) if a != b]
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()

    steps = min(len(tess), len(hf))
    first = next((i for i in range(steps) if tess[i] != hf[i]), None)
    prefix = first if first is not None else steps
    res["identical_prefix"] = prefix
    res["first_divergence"] = first

    # Logprob agreement over the identical prefix (informational).
    if prefix > 0 and tess_lp:
        k = min(prefix, len(tess_lp))
        lsm = torch.log_softmax(logits[:k], dim=-1)
        ids = torch.tensor(tess[:k], device=lsm.device)
        hf_lp = lsm.gather(1, ids[:, None])[:, 0].tolist()
        diffs = [abs(float(tess_lp[i]["logprob"]) - hf_lp[i]) for i in range(k)]
        res["prefix_logprob_max_abs_diff"] = max(diffs)
        res["prefix_logprob_mean_abs_diff"] = sum(diffs) / len(diffs)
        res["prefix_min_hf_top2_margin"] = min(margins[:k])

    if first is None:
        if len(tess) == n and len(hf) == n:
            res.update(verdict="pass", reason="identical")
        else:
            res.update(verdict="fail",
                       reason=f"length mismatch: tessera {len(tess)}, transformers {len(hf)}, "
                              f"wanted {n}")
        return res

    lg = logits[first]
    top1_v, top2_v = float(top2.values[first, 0]), float(top2.values[first, 1])
    top1_id, top2_id = int(top2.indices[first, 0]), int(top2.indices[first, 1])
    margin = top1_v - top2_v
    resolution = ulp_at(top1_v, mantissa_bits)
    ulps = args.ulps
    tok = tess[first]
    tok_logit = float(lg[tok])
    t_margin, t_top = (None, [])
    if first < len(tess_lp):
        t_margin, t_top = tessera_margin(tess_lp[first])
    acceptable = margin <= ulps * resolution
    res.update({
        "divergence": {
            "position": first,
            "tessera_token": tok,
            "hf_token": hf[first],
            "hf_top1": {"id": top1_id, "logit": top1_v},
            "hf_top2": {"id": top2_id, "logit": top2_v},
            "hf_margin": margin,
            "resolution": resolution,
            "resolution_formula": f"2**(floor(log2(|top1|)) - {mantissa_bits})",
            "tessera_token_is_hf_top2": tok == top2_id,
            "hf_logit_of_tessera_token": tok_logit,
            "hf_rank_of_tessera_token": int((lg > lg[tok]).sum()),
            "hf_top1_minus_tessera_token": top1_v - tok_logit,
            "tessera_logprob_margin": t_margin,
            "tessera_top_ids": t_top,
        },
        "verdict": "pass" if acceptable else "fail",
        "reason": (f"divergence within {ulps} ulps (near-tie)" if acceptable
                   else f"divergence with margin above {ulps} ulps"),
    })
    return res


def fmt(v, spec=".4g"):
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tessera", required=True, help="path to the tessera binary")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--out", required=True, help="JSON report to write")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--extra-args", default="", help="more tessera generate args (shlex-split)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the tessera run")
    ap.add_argument("--ulps", type=float, default=2,
                    help="accepted transformers top1-top2 margin at a divergence, in ulps")
    args = ap.parse_args()
    torch_dtype, mantissa_bits = DTYPES[args.dtype]

    if not torch.cuda.is_available():
        sys.exit("gpu_parity: CUDA is not available to torch")

    cmd, tess_results, tess_stderr, tess_other, tess_wall = run_tessera(args)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype).cuda().eval()
    tokenizer = None
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as e:
        print(f"gpu_parity: note: no HF tokenizer ({e}); prompt-id check skipped", file=sys.stderr)
    cfg = model.config
    pad_id = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0
    gen_cfg = model.generation_config.to_dict() if model.generation_config is not None else None

    cases = []
    try:
        for i, tres in enumerate(tess_results):
            cases.append(compare(i, tres, model, tokenizer, args, mantissa_bits, pad_id))
    finally:
        attn_impl = getattr(cfg, "_attn_implementation", None)
        del model
        torch.cuda.empty_cache()

    ok = all(c["verdict"] == "pass" for c in cases)

    hdr = ["#", "prompt tok", "same prefix", "1st diverg", "hf margin", "resolution",
           "tess=hf top2", "tess lp margin", "verdict"]
    rows = []
    for c in cases:
        d = c.get("divergence") or {}
        rows.append([str(c["index"]), str(c["prompt_tokens"]),
                     f"{c['identical_prefix']}/{args.max_tokens}",
                     fmt(c["first_divergence"]), fmt(d.get("hf_margin")),
                     fmt(d.get("resolution")), fmt(d.get("tessera_token_is_hf_top2")),
                     fmt(d.get("tessera_logprob_margin")), c["verdict"]])
    widths = [max([len(h)] + [len(r[j]) for r in rows]) for j, h in enumerate(hdr)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(hdr, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    for c in cases:
        extra = []
        if c.get("hf_tokens_not_raw_argmax"):
            extra.append(f"transformers picked non-argmax tokens at {c['hf_tokens_not_raw_argmax']}")
        if c.get("hf_tokenizer_prompt_ids_match") not in (None, True):
            extra.append(f"HF tokenizer prompt ids match: {c['hf_tokenizer_prompt_ids_match']}")
        if "prefix_logprob_max_abs_diff" in c:
            extra.append(f"prefix logprob |diff| max {c['prefix_logprob_max_abs_diff']:.3g}")
        print(f"  [{c['index']}] {c['reason']}" + ("; " + "; ".join(extra) if extra else ""))
    print(f"\nOVERALL: {'PASS' if ok else 'FAIL'}")

    report = {
        "model_dir": os.path.abspath(args.model),
        "architecture": (getattr(cfg, "architectures", None) or [None])[0],
        "model_type": getattr(cfg, "model_type", None),
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "tessera_command": shlex.join(cmd),
        "tessera_stderr": tess_stderr,
        "tessera_non_json_stdout": tess_other,
        "tessera_wall_s": tess_wall,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "hostname": socket.gethostname(),
        "hf_attn_implementation": attn_impl,
        "hf_generation_config": gen_cfg,
        "acceptance": "identical tokens, or at the first divergence transformers' top1-top2 "
                      f"logit margin <= {args.ulps} ulps of the dtype at |top1|",
        "prompts": PROMPTS,
        "cases": cases,
        "pass": ok,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
