#!/usr/bin/env python3
"""Reference logits for the quantized checkpoints `tessera make-model --quantization` writes,
from Hugging Face transformers running the dequantized weights (run on the GPU machine, which
has torch and transformers; the CPU suffices for tiny models and keeps the math in fp32).

    quant_goldens.py TESSERA_BIN TOKENIZERS_DIR OUT_DIR

The formats are read here by a second, independent implementation written from the exporters'
definitions (AutoAWQ's WQLinear_GEMM packing and its reverse nibble order, GPTQ's qweight packed
along the inputs with qzeros stored as zero - 1 and g_idx, FP8 E4M3 weights times their
scales), so the C++ reader and this one must agree for the goldens to match. Where the
exporters' own loaders are installed (autoawq, gptqmodel, compressed-tensors), transformers
also loads the checkpoint natively and the two are compared.

For each format it makes a tiny Llama (seed 4321), dequantizes every linear layer to fp32,
loads the plain model into LlamaForCausalLM in fp32 and records, for two prompts: the ids,
probe logits at every position, each position's argmax and 16 greedy tokens:
OUT_DIR/quant_<format>.json (tests/model/quantized_test.cpp compares the CPU backend with it).
FP8 runs weight-only (W8A16): transformers does not round activations to FP8.
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

SEED = 4321
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]
NEW_TOKENS = 16
PROBE_IDS = 48
FORMATS = {  # name -> make-model flags
    "awq": ["--quantization", "awq", "--group-size", "32"],
    "gptq_desc_act_asym": ["--quantization", "gptq", "--group-size", "32", "--desc-act",
                           "--asym"],
    "gptq_8bit": ["--quantization", "gptq", "--bits", "8", "--group-size", "64"],
    "fp8_channel": ["--quantization", "fp8", "--weight-scale", "channel", "--activations",
                    "none"],
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds output 8c + AWQ_ORDER[i]


def unpack(packed, bits, dim):
    """int32 tensor -> its 32/bits fields along `dim`, low bits first."""
    per = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    fields = (p.unsqueeze(-1) >> shifts) & mask  # [..., per]
    if dim == 1:  # along the columns: [r, c, per] -> [r, c * per]
        return fields.reshape(p.shape[0], p.shape[1] * per)
    # along the rows: [r, c, per] -> [r * per, c]
    return fields.permute(0, 2, 1).reshape(p.shape[0] * per, p.shape[1])


def dequant_awq(t, prefix, group):
    q = unpack(t[prefix + "qweight"], 4, 1)  # [in, out] in AWQ's order
    z = unpack(t[prefix + "qzeros"], 4, 1)
    # nibble i of column c is output 8c + AWQ_ORDER[i]: put each where it belongs
    inv = [AWQ_ORDER.index(k) for k in range(8)]
    idx = torch.tensor([8 * (j // 8) + inv[j % 8] for j in range(q.shape[1])])
    q, z = q[:, idx], z[:, idx]
    s = t[prefix + "scales"].float()
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * s[g]).t().contiguous()  # [out, in]


def dequant_gptq(t, prefix, bits, zero_offset):
    q = unpack(t[prefix + "qweight"], bits, 0)  # [in, out]
    z = unpack(t[prefix + "qzeros"], bits, 1) + (1 if zero_offset else 0)  # [groups, out]
    s = t[prefix + "scales"].float()
    g = t[prefix + "g_idx"].long()
    return ((q - z[g]).float() * s[g]).t().contiguous()


def dequant_fp8(t, prefix):
    w = t[prefix + "weight"].float()
    s = t[prefix + "weight_scale"].float()
    s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1)
    return w * s


def plain_state(model_dir, qc):
    tensors = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, f)))
    state = {}
    method = qc["quant_method"]
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if ".layers." in k and
                      ("_proj." in k)})
    for m in modules:
        p = m + "."
        if p + "qweight" in tensors and method == "awq":
            state[p + "weight"] = dequant_awq(tensors, p, qc["group_size"])
        elif p + "qweight" in tensors:
            state[p + "weight"] = dequant_gptq(tensors, p, qc["bits"],
                                               qc.get("checkpoint_format", "gptq") == "gptq")
        elif p + "weight_scale" in tensors:
            state[p + "weight"] = dequant_fp8(tensors, p)
    for k, v in tensors.items():
        part = k.rsplit(".", 1)[1]
        if part in ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale"):
            continue
        if k in state:
            continue
        if v.dtype == torch.float8_e4m3fn:
            continue
        state[k] = v.float()
    return state


def main():
    tessera, tokenizers_dir, out_dir = sys.argv[1:4]
    os.makedirs(out_dir, exist_ok=True)
    for name, flags in FORMATS.items():
        model_dir = f"/tmp/quant-goldens-{name}"
        subprocess.run(["rm", "-rf", model_dir], check=True)
        subprocess.run([tessera, "make-model", "--arch", "llama", "--preset", "tiny",
                        "--intermediate-size", "192", "--num-layers", "3", "--tokenizer",
                        os.path.join(tokenizers_dir, "llama3"), "--seed", str(SEED),
                        "--dtype", "bf16", "--out", model_dir] + flags, check=True)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        qc = cfg.pop("quantization_config")
        config = LlamaConfig(**cfg)
        model = LlamaForCausalLM(config).float().eval()
        missing, unexpected = model.load_state_dict(plain_state(model_dir, qc), strict=False)
        missing = [k for k in missing if "rotary" not in k]
        assert not missing and not unexpected, (missing, unexpected)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        gen = torch.Generator().manual_seed(SEED)
        probe = sorted(set(torch.randint(0, config.vocab_size, (PROBE_IDS,),
                                         generator=gen).tolist()))
        cases = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
                seq = list(ids)
                for _ in range(NEW_TOKENS):
                    nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                    seq.append(nxt)
            cases.append({
                "prompt": prompt,
                "ids": ids,
                "probe_logits": [[float(logits[p, i]) for i in probe] for p in range(len(ids))],
                "argmax": [int(logits[p].argmax()) for p in range(len(ids))],
                "greedy": seq[len(ids):],
            })
        native = "not installed"
        try:  # the exporters' own loaders, where present
            from transformers import AutoModelForCausalLM
            nat = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16)
            with torch.no_grad():
                ids = tokenizer(PROMPTS[0], add_special_tokens=True)["input_ids"]
                ref = nat(torch.tensor([ids]).to(nat.device)).logits[0].float().cpu()
                mine = model(torch.tensor([ids])).logits[0]
                native = float((ref - mine).abs().max())
        except Exception as e:  # noqa: BLE001 - any missing package or kernel is reported
            native = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
        out = {"format": name, "flags": flags, "seed": SEED, "tokenizer": "llama3",
               "probe_ids": probe, "cases": cases,
               "transformers_native_max_abs_diff": native}
        with open(os.path.join(out_dir, f"quant_{name}.json"), "w") as f:
            json.dump(out, f)
        print(f"{name}: {len(cases)} cases, native loader: {native}")


if __name__ == "__main__":
    main()
