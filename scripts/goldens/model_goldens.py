#!/usr/bin/env python3
"""Reference logits and greedy continuations from Hugging Face transformers for the tiny
seeded checkpoints `tessera make-model` writes (run on the GPU machine, which has torch and
transformers; the CPU suffices for tiny models and keeps the math in plain fp32).

    model_goldens.py TESSERA_BIN TOKENIZERS_DIR OUT_DIR [ARCH ...]

With ARCH names (e.g. mixtral qwen2_moe qwen3_moe) only those goldens are made.

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
}
SEED = 1234
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "你好，世界！ Tessera runs LLMs on many GPUs. 🚀",
]
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
        subprocess.run([tessera, "make-model", "--arch", arch, "--preset", "tiny", "--tokenizer",
                        os.path.join(tokenizers_dir, tok), "--seed", str(SEED), "--dtype", "bf16",
                        "--out", model_dir], check=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(SEED)
        probe = sorted(set(torch.randint(0, vocab, (PROBE_IDS,), generator=gen).tolist()))
        cases = []
        for prompt in PROMPTS:
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
            "dtype": "bf16 weights, float32 math",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "probe_ids": probe,
            "cases": cases,
        }
        with open(os.path.join(out_dir, f"model_{arch}.json"), "w") as f:
            json.dump(golden, f)
        print(arch, "ok:", [c["greedy"][:8] for c in cases])


if __name__ == "__main__":
    main()
