#!/usr/bin/env python3
"""Hugging Face transformers baseline latency/throughput on the current GPU, in bfloat16, for
the checkpoint that `tessera bench report` measures (run on the GPU machine).

    transformers_latency.py --model DIR --out OUT.json [--quick] [--skip-compile]

Measures, in this order (the JSON is rewritten after each step, so a crash keeps the rest):
  copy_bandwidth           device-to-device copy of an 8 GiB buffer; (read+write bytes)/time,
                           best of 10 after warm-up, CUDA events.
  batch1_decode_eager      generate(), dynamic cache, batch 1, 128 seeded random prompt ids,
                           256 new greedy tokens.
  batch64_decode_eager     the same with 64 prompts of 128 random ids.
  prefill_4096             one forward over 4096 ids, use_cache=False, logits for every
                           position (matches the FLOP formula), best of 5 after warm-up.
  prefill_4096_last_logits the same with logits_to_keep=1 (what a serving prefill computes).
  batch1_decode_compiled   static cache + torch.compile(model.forward, mode="reduce-overhead",
                           fullgraph=True), warmed up twice, then timed like the eager run. If
                           that raises, the error is recorded and transformers' own
                           auto-compile of static-cache generate() is tried instead.

Decode timing: a streamer receives the prompt, then each generated token as generate() copies
it to the host (`.cpu()`, which synchronizes). TTFT = first token's arrival - generate() call
(prefill + first token + generate's setup). Decode tok/s = batch * (new_tokens - 1) /
(last token's arrival - first token's arrival). min_new_tokens = max_new_tokens and
eos_token_id=None, so no sequence stops early.
"""
import argparse
import json
import math
import os
import platform
import shlex
import socket
import statistics
import sys
import time
import traceback

import torch
import transformers
from transformers import AutoModelForCausalLM

try:
    from transformers.generation.streamers import BaseStreamer
except Exception:  # pragma: no cover - very old/new layouts
    BaseStreamer = object

SEED = 1234
INPUT_LEN = 128


class TimingStreamer(BaseStreamer):
    """Records the host time of every put(): the first is the prompt, then one per step."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def write(out, data):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, out)


def err_text():
    return traceback.format_exc()[-3000:]


def f4(v):
    return f"{v:.4g}" if isinstance(v, (int, float)) else "n/a"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def copy_bandwidth(gib, iters):
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    del src, dst
    torch.cuda.empty_cache()
    best = min(ms)
    bps = 2 * n / (best / 1e3)
    return {"bytes": n, "iterations": iters, "ms": ms, "best_ms": best,
            "bytes_per_s": bps, "gb_s": bps / 1e9,
            "method": "torch dst.copy_(src) of a uint8 CUDA buffer; bandwidth = 2*bytes "
                      "(read+write) / best time; CUDA events; 3 warm-up copies"}


def random_ids(batch, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).cuda()


def gen_kwargs(new_tokens, pad_id):
    return dict(do_sample=False, temperature=None, top_p=None, top_k=None, num_beams=1,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                eos_token_id=None, pad_token_id=pad_id, return_dict_in_generate=False)


def timed_generate(model, ids, new_tokens, pad_id):
    """One generate() call; returns (ttft_ms, decode_s, decode_tok_s, total_s, n_generated)."""
    streamer = TimingStreamer()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                             **gen_kwargs(new_tokens, pad_id))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    generated = out.shape[1] - ids.shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"generated {generated} tokens, wanted {new_tokens}")
    toks = streamer.times[1:]  # [0] is the prompt
    if len(toks) != new_tokens:
        print(f"warning: streamer saw {len(toks)} token steps for {new_tokens} tokens",
              file=sys.stderr)
    if len(toks) < 2:  # no per-token timestamps: whole call, no TTFT split
        return None, t1 - t0, ids.shape[0] * new_tokens / (t1 - t0), t1 - t0, generated
    ttft_ms = (toks[0] - t0) * 1e3
    decode_s = toks[-1] - toks[0]
    tok_s = ids.shape[0] * (len(toks) - 1) / decode_s if decode_s > 0 else None
    return ttft_ms, decode_s, tok_s, t1 - t0, generated


def decode_scenario(model, batch, new_tokens, iters, warmups, warm_tokens, vocab, pad_id):
    ids = random_ids(batch, INPUT_LEN, vocab, SEED)
    for _ in range(warmups):
        timed_generate(model, ids, warm_tokens, pad_id)
    ttft, dec_s, tok_s, total = [], [], [], []
    for _ in range(iters):
        a, b, c, d, _ = timed_generate(model, ids, new_tokens, pad_id)
        ttft.append(a)
        dec_s.append(b)
        tok_s.append(c)
        total.append(d)
    return {"batch_size": batch, "input_len": INPUT_LEN, "output_len": new_tokens,
            "iterations": iters, "warmups": warmups, "warmup_output_len": warm_tokens,
            "ttft_ms": ttft, "decode_s": dec_s, "decode_tok_s": tok_s, "total_s": total,
            "ttft_ms_median": median(ttft), "decode_tok_s_median": median(tok_s),
            "step_ms_median": (1e3 * median(dec_s) / (new_tokens - 1)) if new_tokens > 1
            and median(dec_s) is not None else None}


def prefill_scenario(model, length, iters, vocab, flops, last_logits_only):
    ids = random_ids(1, length, vocab, SEED + 1)
    kw = {"use_cache": False}
    if last_logits_only:
        kw["logits_to_keep"] = 1
    with torch.inference_mode():
        for _ in range(2):
            model(ids, **kw)
        torch.cuda.synchronize()
        ms = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = model(ids, **kw)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
            del out
    torch.cuda.empty_cache()
    best = min(ms)
    return {"input_len": length, "iterations": iters, "ms": ms, "best_ms": best,
            "median_ms": median(ms), "tok_s": length / (best / 1e3), "flops": flops,
            "tflops": flops / (best / 1e3) / 1e12, "logits": "last position only"
            if last_logits_only else "all positions", "kwargs": kw}


def compiled_loop(model, P, vocab):
    """gpt-fast style: a StaticCache, the prompt through the eager model, then one compiled
    (mode="reduce-overhead", CUDA-graphed) forward per new token in a Python loop, with
    torch.compiler.cudagraph_mark_step_begin() before each call and greedy argmax on the GPU."""
    from transformers import StaticCache
    new = P["b1_tokens"]
    ids = random_ids(1, INPUT_LEN, vocab, SEED)
    try:
        cache = StaticCache(config=model.config, max_cache_len=INPUT_LEN + new + 8)
    except TypeError:
        cache = StaticCache(config=model.config, max_batch_size=1,
                            max_cache_len=INPUT_LEN + new + 8, device="cuda",
                            dtype=torch.bfloat16)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def one(n_new):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            # The cache's tensors are created inside inference mode: reset them there too.
            cache.reset()
            pos = torch.arange(INPUT_LEN, device="cuda")
            logits = model(ids, cache_position=pos, past_key_values=cache, use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for i in range(n_new - 1):
                torch.compiler.cudagraph_mark_step_begin()
                p = torch.tensor([INPUT_LEN + i], device="cuda")
                logits = step(tok, cache_position=p, past_key_values=cache, use_cache=True).logits
                tok = logits[:, -1:].argmax(-1).clone()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (n_new - 1) / (t2 - t1)

    for _ in range(P["compile_warmups"]):
        one(16)
    ttft, tok_s = [], []
    for _ in range(P["compiled_iters"]):
        a, b = one(new)
        ttft.append(a)
        tok_s.append(b)
    return {"batch_size": 1, "input_len": INPUT_LEN, "output_len": new,
            "iterations": P["compiled_iters"], "ttft_ms": ttft, "decode_tok_s": tok_s,
            "ttft_ms_median": median(ttft), "decode_tok_s_median": median(tok_s),
            "variant": "loop",
            "variant_description": compiled_loop.__doc__.strip().replace("\n", " ")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--quick", action="store_true", help="few iterations/tokens (smoke test)")
    ap.add_argument("--skip-compile", action="store_true", help="no static-cache compile run")
    ap.add_argument("--scenarios", default="all",
                    help="comma list of b1_eager,b64_eager,prefill,compiled (default all)")
    ap.add_argument("--compile-variants", default="loop,manual,auto",
                    help="compiled batch-1 variants to try in order (first that works counts)")
    args = ap.parse_args()
    want = lambda name: args.scenarios == "all" or name in args.scenarios.split(",")
    if not torch.cuda.is_available():
        sys.exit("transformers_latency: CUDA is not available to torch")

    q = args.quick
    P = {
        "copy_gib": 1 if q else 8, "copy_iters": 3 if q else 10,
        "b1_tokens": 32 if q else 256, "b1_iters": 1 if q else 3,
        "b64_batch": 64, "b64_tokens": 16 if q else 256, "b64_iters": 1 if q else 3,
        "b64_warmups": 1 if q else 2, "b64_warm_tokens": 4 if q else 64,
        "prefill_len": 4096, "prefill_iters": 2 if q else 5,
        "compile_warmups": 2, "compiled_iters": 1 if q else 3,
    }
    torch.manual_seed(SEED)
    dev = torch.cuda.get_device_properties(0)
    data = {
        "command": shlex.join([sys.executable] + sys.argv),
        "model": os.path.abspath(args.model),
        "dtype": "bfloat16",
        "quick": q,
        "parameters_of_run": P,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_bytes": dev.total_memory,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                     "python": platform.python_version()},
        "methods": {
            "decode": "generate() with a streamer timestamping each token as it is copied to "
                      "the host; TTFT = first token - call; decode tok/s = batch*(new-1) / "
                      "(last token - first token)",
            "prefill": "model(ids, use_cache=False) timed with CUDA events, best of N after 2 "
                       "warm-ups; tok/s and TFLOP/s from the best time",
            "bytes_per_token": "all parameters except the input embedding x element size; a "
                               "tied embedding counts once (lm_head reads it); KV-cache reads "
                               "not included",
        },
        "scenarios": {},
        "errors": {},
    }
    out = args.out
    write(out, data)

    # 1. HBM copy bandwidth, before the model takes memory.
    try:
        data["copy_bandwidth"] = copy_bandwidth(P["copy_gib"], P["copy_iters"])
        print(f"copy bandwidth: {data['copy_bandwidth']['gb_s']:.0f} GB/s", flush=True)
    except Exception:
        data["errors"]["copy_bandwidth"] = err_text()
        print(data["errors"]["copy_bandwidth"], file=sys.stderr)
    write(out, data)

    # 2. Model, parameter accounting.
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    data["load_s"] = time.time() - t0
    cfg = model.config
    vocab = cfg.vocab_size
    pad_id = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0
    embed = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings()
    tied = out_emb is not None and out_emb.weight.data_ptr() == embed.data_ptr()
    params = list(model.parameters())  # tied tensors appear once
    total = sum(p.numel() for p in params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    non_embed = total - embed.numel()
    matmul_params = non_embed + (embed.numel() if tied else 0)
    bytes_per_token = matmul_params * embed.element_size()
    layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    S = P["prefill_len"]
    attn_flops = 4 * layers * heads * head_dim * S * S // 2
    prefill_flops = 2 * matmul_params * S + attn_flops
    data.update({
        "architecture": (getattr(cfg, "architectures", None) or [None])[0],
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "config": {"hidden_size": cfg.hidden_size, "num_hidden_layers": layers,
                   "num_attention_heads": heads,
                   "num_key_value_heads": getattr(cfg, "num_key_value_heads", heads),
                   "head_dim": head_dim, "intermediate_size": getattr(cfg, "intermediate_size",
                                                                      None),
                   "vocab_size": vocab, "tie_word_embeddings": tied},
        "params": {"total": total, "input_embedding": embed.numel(),
                   "without_input_embedding": non_embed, "tied_embeddings": tied,
                   "read_per_token": matmul_params},
        "weight_bytes": weight_bytes,
        "decode_bytes_per_token": bytes_per_token,
        "prefill_flops_formula": "2 * P * S + 4 * layers * heads * head_dim * S^2 / 2, "
                                 "P = params without the input embedding (+ the embedding "
                                 "again when tied, for lm_head), S = input_len",
    })
    bw = (data.get("copy_bandwidth") or {}).get("bytes_per_s")
    data["roofline_tok_s"] = bw / bytes_per_token if bw else None
    print(f"params {total / 1e9:.3f} B, weights {weight_bytes / 2**30:.2f} GiB, "
          f"{bytes_per_token / 1e9:.3f} GB read per decode token, roofline "
          f"{data['roofline_tok_s'] or 0:.1f} tok/s", flush=True)
    write(out, data)

    def run(name, fn):
        try:
            data["scenarios"][name] = fn()
            s = data["scenarios"][name]
            print(f"{name}: " + ", ".join(f"{k} {s[k]:.4g}" for k in
                                          ("ttft_ms_median", "decode_tok_s_median", "tok_s",
                                           "tflops") if isinstance(s.get(k), (int, float))),
                  flush=True)
        except Exception:
            data["errors"][name] = err_text()
            data["scenarios"][name] = {"error": data["errors"][name][-500:]}
            print(f"{name} failed:\n{data['errors'][name]}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        write(out, data)

    model.generation_config.cache_implementation = None

    # 3. Eager batch 1.
    if want("b1_eager"):
        run("batch1_decode_eager", lambda: decode_scenario(
            model, 1, P["b1_tokens"], P["b1_iters"], 1, 8, vocab, pad_id))
    # 4. Eager batch 64 (warmed up at batch 64 first: the first run grows the allocator).
    if want("b64_eager"):
        run("batch64_decode_eager", lambda: decode_scenario(
            model, P["b64_batch"], P["b64_tokens"], P["b64_iters"], P["b64_warmups"],
            P["b64_warm_tokens"], vocab, pad_id))
    # 5. Prefill 4096.
    if want("prefill"):
        run("prefill_4096", lambda: prefill_scenario(
            model, S, P["prefill_iters"], vocab, prefill_flops, False))
        lm_head_params = out_emb.weight.numel() if out_emb is not None else 0
        flops_last = prefill_flops - 2 * lm_head_params * (S - 1)
        run("prefill_4096_last_logits", lambda: prefill_scenario(
            model, S, P["prefill_iters"], vocab, flops_last, True))

    # 6. Static cache + torch.compile, batch 1.
    if not args.skip_compile and want("compiled"):
        attempts = []

        def compiled(variant):
            if variant == "loop":
                return compiled_loop(model, P, vocab)
            model.generation_config.cache_implementation = "static"
            if variant == "manual":
                model.forward = torch.compile(model.forward, mode="reduce-overhead",
                                              fullgraph=True)
            t = time.time()
            s = decode_scenario(model, 1, P["b1_tokens"], P["compiled_iters"],
                                P["compile_warmups"], P["b1_tokens"], vocab, pad_id)
            s["variant"] = variant
            s["variant_description"] = (
                "model.forward = torch.compile(model.forward, mode='reduce-overhead', "
                "fullgraph=True); generation_config.cache_implementation='static'"
                if variant == "manual" else
                "generation_config.cache_implementation='static'; generate() auto-compiles "
                "the forward with its default CompileConfig")
            s["warmup_and_timed_wall_s"] = time.time() - t
            s["attempts"] = attempts
            return s

        for variant in args.compile_variants.split(","):
            try:
                data["scenarios"]["batch1_decode_compiled"] = compiled(variant)
                s = data["scenarios"]["batch1_decode_compiled"]
                print(f"batch1_decode_compiled ({variant}): ttft {f4(s['ttft_ms_median'])} ms, "
                      f"{f4(s['decode_tok_s_median'])} tok/s", flush=True)
                break
            except Exception:
                e = err_text()
                attempts.append({"variant": variant, "error": e})
                data["errors"][f"batch1_decode_compiled_{variant}"] = e
                print(f"compiled ({variant}) failed:\n{e}", file=sys.stderr, flush=True)
                if "forward" in model.__dict__:
                    del model.forward  # back to the class's forward
                try:
                    torch._dynamo.reset()
                except Exception:
                    pass
                torch.cuda.empty_cache()
        else:
            data["scenarios"]["batch1_decode_compiled"] = {
                "error": attempts[-1]["error"][-500:] if attempts else "not run",
                "attempts": attempts}
        if "forward" in model.__dict__:
            del model.forward
        model.generation_config.cache_implementation = None
        write(out, data)

    del model
    torch.cuda.empty_cache()

    sc = data["scenarios"]

    def g(name, key):
        v = (sc.get(name) or {}).get(key)
        return f"{v:.4g}" if isinstance(v, (int, float)) else "n/a"

    print("\nsummary (transformers %s, torch %s, %s)" % (
        transformers.__version__, torch.__version__, data["gpu"]))
    cb = data.get("copy_bandwidth")
    print(f"  copy bandwidth           {'%.0f' % cb['gb_s'] if cb else 'n/a'} GB/s")
    print(f"  roofline (batch 1)       {data['roofline_tok_s'] or 0:.1f} tok/s")
    print(f"  batch-1 compiled         ttft {g('batch1_decode_compiled', 'ttft_ms_median')} ms,"
          f" {g('batch1_decode_compiled', 'decode_tok_s_median')} tok/s")
    print(f"  batch-1 eager            ttft {g('batch1_decode_eager', 'ttft_ms_median')} ms,"
          f" {g('batch1_decode_eager', 'decode_tok_s_median')} tok/s")
    print(f"  batch-64 eager           {g('batch64_decode_eager', 'decode_tok_s_median')} tok/s")
    print(f"  prefill 4096             {g('prefill_4096', 'best_ms')} ms, "
          f"{g('prefill_4096', 'tok_s')} tok/s, {g('prefill_4096', 'tflops')} TFLOP/s")
    print(f"  prefill 4096 last logits {g('prefill_4096_last_logits', 'best_ms')} ms, "
          f"{g('prefill_4096_last_logits', 'tok_s')} tok/s")
    write(out, data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
