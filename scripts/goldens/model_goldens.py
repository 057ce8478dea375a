#!/usr/bin/env python3
"""Reference logits and greedy continuations from Hugging Face transformers for the tiny
seeded checkpoints `tessera make-model` writes (run on the GPU machine, which has torch and
transformers; the CPU suffices for tiny models and keeps the math in plain fp32).

    model_goldens.py TESSERA_BIN TOKENIZERS_DIR OUT_DIR [ARCH ...]

With ARCH names (e.g. gemma2 gemma3 phi3) only those goldens are made.

For each architecture it makes the model with the given seed, loads it in float32 (the bf16
weights upcast exactly), and records for several prompts: the prompt ids, the logits at every
prompt position for a fixed set of vocabulary ids (plus each position's argmax and max), and
32 greedy tokens (argmax of a full forward at each step, EOS not special). The C++ parity test
regenerates the same checkpoint from the same seed and compares.
"""
import json
import os
import subprocess
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ARCHS = {  # arch -> tokenizer folder
    "llama": "llama3",
    "mistral": "llama2",
    "qwen2": "qwen3",
    "qwen3": "qwen3",
    "mixtral": "llama2",
    "qwen2_moe": "qwen3",
    "qwen3_moe": "qwen3",
    "gemma2": "llama2",
    "gemma3": "llama2",
    "phi3": "llama2",
    "mistral_window": "llama2",
}
# Variants: the tiny checkpoint of another architecture with config.json patched.
# mistral_window: Mistral with a sliding window of 8 tokens (the tiny preset has none), shorter
# than the prompts, so prefill, decode and the greedy continuation all cross the window edge.
VARIANTS = {"mistral_window": ("mistral", {"sliding_window": 8})}
# Loaded with eager attention: transformers honours sliding windows and attention soft-capping
# there exactly (sdpa / flash may drop the soft-cap).
EAGER = {"gemma2", "gemma3", "phi3", "mistral_window"}
# The transformers class each architecture must load as (a golden of the wrong class is useless).
CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
           "mistral_window": "MistralForCausalLM"}
SEED = 1234
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "你好，世界！ Tessera runs LLMs on many GPUs. 🚀",
]
# For the sliding-window architectures: a prompt several times longer than the tiny presets'
# windows (8 tokens Gemma, 16 Phi-3), so prefill itself crosses the window edge.
LONG_PROMPT = ("Once upon a time, in a village at the edge of a great forest, there lived an old "
               "clockmaker who repaired every clock in the valley, and each evening he wound the "
               "tower clock by hand while the children counted the steps of the spiral stair.")
NEW_TOKENS = 32
PROBE_IDS = 48  # vocabulary ids sampled per model for the logits comparison


def main():
    tessera, tokenizers_dir, out_dir = sys.argv[1:4]
    only = sys.argv[4:]
    unknown = [a for a in only if a not in ARCHS]
    if unknown:
        sys.exit(f"unknown arch(s) {unknown}; known: {list(ARCHS)}")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    for arch, tok in ARCHS.items():
        if only and arch not in only:
            continue
        model_dir = f"/tmp/goldens-{arch}"
        subprocess.run(["rm", "-rf", model_dir], check=True)
        make_arch, patch = VARIANTS.get(arch, (arch, {}))
        subprocess.run([tessera, "make-model", "--arch", make_arch, "--preset", "tiny",
                        "--tokenizer", os.path.join(tokenizers_dir, tok), "--seed", str(SEED),
                        "--dtype", "bf16", "--out", model_dir], check=True)
        if patch:
            config_path = os.path.join(model_dir, "config.json")
            with open(config_path) as f:
                config = json.load(f)
            config.update(patch)
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        kwargs = {"attn_implementation": "eager"} if arch in EAGER else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
        model.eval()
        if arch in CLASSES and type(model).__name__ != CLASSES[arch]:
            sys.exit(f"{arch}: transformers loaded {type(model).__name__}, not {CLASSES[arch]}")
        for key, value in patch.items():
            if getattr(model.config, key) != value:
                sys.exit(f"{arch}: transformers read {key}={getattr(model.config, key)}, "
                         f"not {value}")
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(SEED)
        probe = sorted(set(torch.randint(0, vocab, (PROBE_IDS,), generator=gen).tolist()))
        cases = []
        prompts = PROMPTS + ([LONG_PROMPT] if arch in EAGER else [])
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]  # [len, vocab] fp32
                seq = list(ids)
                greedy = []
                margins = []
                for _ in range(NEW_TOKENS):
                    last = model(torch.tensor([seq])).logits[0, -1]
                    top2 = torch.topk(last, 2)
                    nxt = int(top2.indices[0])
                    margins.append(float(top2.values[0] - top2.values[1]))
                    greedy.append(nxt)
                    seq.append(nxt)
            cases.append({
                "prompt": prompt,
                "ids": ids,
                "probe_logits": logits[:, probe].tolist(),
                "argmax": logits.argmax(-1).tolist(),
                "max": logits.max(-1).values.tolist(),
                "greedy": greedy,
                "greedy_top2_margin": margins,
            })
        golden = {
            "arch": arch,
            "tokenizer": tok,
            "seed": SEED,
            "preset": "tiny",
            "make_arch": make_arch,
            "config_patch": patch,
            "dtype": "bf16 weights, float32 math",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "probe_ids": probe,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "hf_config": json.loads(model.config.to_json_string()),
            "cases": cases,
        }
        with open(os.path.join(out_dir, f"model_{arch}.json"), "w") as f:
            json.dump(golden, f)
        print(arch, "ok:", [c["greedy"][:8] for c in cases])


if __name__ == "__main__":
    main()
