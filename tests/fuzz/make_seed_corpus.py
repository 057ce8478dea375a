#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<name>/seed_*).

The seeds are derived from the repository's own test material: the chat template goldens
(tests/assets/goldens/chat_*.json), the published configs the checkpoint tests use, and the real
tokenizers of tests/assets/tokenizers (scripts/fetch-test-assets), cut down to a few KB each
(the byte alphabet and the first merges whose tokens are kept). Inputs that once crashed a
fuzzer are committed beside them as crash_* files and are never rewritten here.

    tests/fuzz/make_seed_corpus.py   # from the repository root; rewrites every seed_* file
"""
import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
GOLDENS = ROOT / "tests" / "assets" / "goldens"
TOKENIZERS = ROOT / "tests" / "assets" / "tokenizers"


def dump(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def write_seeds(name, seeds):
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("seed_*"):
        old.unlink()
    for i, data in enumerate(seeds):
        if isinstance(data, str):
            data = data.encode("utf-8")
        (folder / f"seed_{i:02d}").write_bytes(data)
    print(f"{name}: {len(seeds)} seeds, {sum(len(s) for s in seeds)} bytes")


# ---- safetensors: whole files ------------------------------------------------------------------

def safetensors_file(tensors, metadata=None, pad=True, data=None):
    """tensors: [(name, dtype, shape)], laid out contiguously in order."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2}
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = sizes.get(dtype, 4)
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = dump(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    body = data if data is not None else bytes(i % 251 for i in range(offset))
    return struct.pack("<Q", len(text)) + text + body


def safetensors_seeds():
    seeds = [
        safetensors_file([("model.embed_tokens.weight", "BF16", [8, 4]),
                          ("model.norm.weight", "F32", [4]),
                          ("lm_head.weight", "F16", [8, 4])], metadata={"format": "pt"}),
        safetensors_file([("scalar", "F32", []), ("empty", "F16", [0, 3]),
                          ("model.layers.0.self_attn.q_proj.weight", "BF16", [2, 2, 2])]),
        safetensors_file([("a", "F32", [3])], pad=False),
        safetensors_file([("a", "F32", [2])], data=b""),  # truncated data
        safetensors_file([("a", "I64", [2])]),  # unsupported dtype
        safetensors_file([], metadata={"format": "pt", "total": "0"}),
    ]
    overlap = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    text = dump(overlap).encode()
    seeds.append(struct.pack("<Q", len(text)) + text + bytes(12))
    seeds.append(struct.pack("<Q", 1 << 40) + b"{}")  # header length past the end
    return seeds


# ---- config.json (+ NUL + generation_config.json) -----------------------------------------------

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256}
LLAMA2 = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32000}
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000}
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936}
TINY = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": True, "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "dtype": "float32"}


def model_config_seeds():
    generation = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                  "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
                  "max_new_tokens": 512}
    return [
        dump(LLAMA31) + "\0" + dump(generation),
        dump(LLAMA2),
        dump(MISTRAL) + "\0" + dump({"eos_token_id": 2, "pad_token_id": None}),
        dump(QWEN25),
        dump(QWEN3) + "\0" + dump({"eos_token_id": [151645, 151643], "temperature": 0.7}),
        dump(TINY),
        dump({**QWEN3, "architectures": ["QWenLMHeadModel"], "auto_map": {"AutoConfig": "x"}}),
        dump({**LLAMA2, "quantization_config": {"quant_method": "awq"}}),
        dump({**MISTRAL, "num_key_value_heads": 5}),
    ]


# ---- tokenizer.json + NUL + tokenizer_config.json + NUL + text ----------------------------------

TEXTS = [
    "Hello world! The capital of France is Paris.",
    " leading spaces,\ttabs\nand\r\nnewlines   ",
    "héllo wörld ñ 中文 日本語 😀 e\u0301",
    "<|im_start|>user\nHi<|im_end|><s></s> [INST] x [/INST]",
    "1234567 3.14 don't I'M we'll",
]


def trimmed_bpe(name, keep_merges, keep_added=6):
    """The real tokenizer `name` cut down: its components as they are, a vocab of the tokens
    the first merges need (plus the single characters they are built from), ids renumbered."""
    spec = json.loads((TOKENIZERS / name / "tokenizer.json").read_text())
    model = spec["model"]
    vocab = model["vocab"]
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    kept_tokens = []
    seen = set()

    def keep(token):
        if token in vocab and token not in seen:
            seen.add(token)
            kept_tokens.append(token)

    if model.get("byte_fallback"):
        for token in vocab:
            if token.startswith("<0x") or token in ("<unk>", "<s>", "</s>"):
                keep(token)
        for token in vocab:
            if len(token) == 1 and (token == "\u2581" or " " < token < "\x7f"):
                keep(token)  # the characters the first merges are built from
    else:
        for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])[:256]:
            keep(token)  # the byte-level alphabet comes first
    kept_merges = []
    for a, b in merges:
        if len(kept_merges) == keep_merges:
            break
        if a in seen and b in seen and a + b in vocab:
            keep(a + b)
            kept_merges.append([a, b] if isinstance(model["merges"][0], list) else f"{a} {b}")
    new_ids = {token: i for i, token in enumerate(kept_tokens)}
    model["vocab"] = new_ids
    model["merges"] = kept_merges
    added = spec["added_tokens"][:keep_added]
    next_id = len(new_ids)
    for token in added:
        if token["content"] in new_ids:
            token["id"] = new_ids[token["content"]]
        else:
            token["id"] = next_id
            next_id += 1
    spec["added_tokens"] = added
    post = spec.get("post_processor") or {}
    for special in (post.get("special_tokens") or {}).values():
        special["ids"] = [new_ids.get(t, 0) for t in special["tokens"]]
    config = json.loads((TOKENIZERS / name / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config.pop("chat_template", None)
    return spec, config


def tiny_sentencepiece():
    """A hand-made SentencePiece-style tokenizer: Metaspace, byte fallback, added tokens with
    lstrip / rstrip / single_word, TemplateProcessing with a pair template."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(0x20, 0x80):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "h", "i", "▁h", "▁hi", "ab", "abc", "▁a"]:
        vocab[piece] = len(vocab)
    spec = {
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<unk>", "special": True},
            {"id": 1, "content": "<s>", "special": True},
            {"id": 2, "content": "</s>", "special": True},
            {"id": len(vocab), "content": "[W]", "single_word": True, "lstrip": True,
             "rstrip": True, "normalized": False, "special": False},
            {"id": len(vocab) + 1, "content": "hi!", "normalized": True, "special": False},
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Replace", "pattern": {"String": "\t"}, "content": " "}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                          "split": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 1}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": [["▁", "h"], ["▁h", "i"], ["a", "b"], ["ab", "c"], ["▁", "a"]]},
    }
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True,
              "model_max_length": 1e30, "chat_template": [{"name": "default", "template": "x"}]}
    return spec, config


def tokenizer_seeds():
    seeds = []
    specs = [trimmed_bpe("llama3", 60), trimmed_bpe("qwen3", 60),
             trimmed_bpe("llama2", 60, keep_added=3), tiny_sentencepiece()]
    for i, (spec, config) in enumerate(specs):
        text = TEXTS[i] + TEXTS[(i + 2) % len(TEXTS)]
        seeds.append(dump(spec) + "\0" + dump(config) + "\0" + text)
    seeds.append(dump(specs[3][0]) + "\0\0" + TEXTS[4])
    return seeds


# ---- chat templates: source + NUL + messages + NUL + extra context ------------------------------

def chat_template_seeds():
    seeds = []
    for case in json.loads((GOLDENS / "chat_features.json").read_text())["cases"]:
        seeds.append(case["template"] + "\0" + dump(case["messages"]) + "\0" +
                     dump(case.get("extra") or {}))
    for name in ("llama3", "qwen3"):
        source = json.loads((TOKENIZERS / name / "tokenizer_config.json").read_text())
        golden = json.loads((GOLDENS / f"chat_{name}.json").read_text())
        for case in golden["cases"][:1]:
            seeds.append(source["chat_template"] + "\0" + dump(case["messages"]) + "\0" +
                         dump(case.get("extra") or {}))
    llama2 = json.loads((GOLDENS / "chat_llama2.json").read_text())
    for case in llama2["cases"][:1]:
        seeds.append(llama2["chat_template"] + "\0" + dump(case["messages"]))
    return seeds


if __name__ == "__main__":
    write_seeds("safetensors", safetensors_seeds())
    write_seeds("model_config", model_config_seeds())
    write_seeds("tokenizer", tokenizer_seeds())
    write_seeds("chat_template", chat_template_seeds())
