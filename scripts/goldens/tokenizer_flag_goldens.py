#!/usr/bin/env python3
"""Writes the goldens of what transformers' AutoTokenizer does with tokenizer_config.json's flags.

Usage: tokenizer_flag_goldens.py TOKENIZERS_DIR OUT_FILE

vLLM tokenizes prompts with transformers' AutoTokenizer, not with the raw tokenizer.json, and the
two differ where tokenizer_config.json says `legacy`, `add_prefix_space`, `add_bos_token`,
`add_eos_token` or names a tokenizer class that rebuilds the pipeline (transformers 5's
LlamaTokenizer replaces the normalizer, pre-tokenizer and decoder). For each tokenizer of
TOKENIZERS_DIR ({llama3,qwen3,llama2}) and each patch of PATCHES (keys set, or removed when None),
this copies the directory with the patched tokenizer_config.json, loads it with AutoTokenizer and
records the class, the ids of every text of CORPUS with add_special_tokens true and false, and the
decodes of those ids. tests/tokenizer/tokenizer_flags_test.cpp loads the same patched directories
with Tessera and must agree.

Needs python3 with transformers; no network. Run it on the GPU machine and copy OUT_FILE into
tests/assets/goldens/tokenizer_flags.json.
"""
import json
import os
import shutil
import sys
import tempfile
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NAMES = ["llama3", "qwen3", "llama2"]

CORPUS = [
    "",
    "a",
    "Hello",
    " Hello world",
    "  two leading spaces",
    "\nnewline first",
    "Hello <s> world </s> <unk>",
    "<s>[INST] hi [/INST]</s>",
    "<|begin_of_text|>Hello<|end_of_text|> there",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog.",
    "我爱自然语言处理。 Emoji: 😀",
    "trailing   ",
]

# Keys of tokenizer_config.json to set (a value) or remove (None), one patch per entry.
PATCHES = [
    {},
    {"legacy": True},
    {"legacy": False},
    {"legacy": None},
    {"add_prefix_space": True},
    {"add_prefix_space": False},
    {"legacy": False, "add_prefix_space": False},
    {"legacy": True, "add_prefix_space": False},
    {"add_bos_token": True},
    {"add_bos_token": False},
    {"add_eos_token": True},
    {"add_bos_token": False, "add_eos_token": True},
    {"add_bos_token": True, "add_eos_token": True},
    {"add_bos_token": None, "add_eos_token": None},
    {"tokenizer_class": "PreTrainedTokenizerFast"},
    {"tokenizer_class": "LlamaTokenizerFast", "legacy": False},
]

# transformers 5's LlamaTokenizer puts a Metaspace pipeline over any vocabulary, byte-level ones
# too (which breaks them); Tessera applies it only to SentencePiece-style (byte-fallback) BPE, so
# that class is asked for only there.
SENTENCEPIECE_ONLY = {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}



def patched_dir(src, patch, tmp):
    dst = os.path.join(tmp, "tok")
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "tokenizer_config.json")
    config = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
    for key, value in patch.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)
    return dst


def record(directory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(directory)
    cases = []
    for text in CORPUS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        cases.append({
            "text": text,
            "ids": ids,
            "ids_no_special": tok(text, add_special_tokens=False)["input_ids"],
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    return {"class": type(tok).__name__, "cases": cases}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    import transformers
    src, out = sys.argv[1], sys.argv[2]
    golden = {"transformers_version": transformers.__version__, "tokenizers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            entries = []
            for patch in PATCHES:
                if patch == SENTENCEPIECE_ONLY and name != "llama2":
                    continue
                entry = {"patch": patch}
                try:
                    entry.update(record(patched_dir(os.path.join(src, name), patch, tmp)))
                except Exception:
                    entry["error"] = traceback.format_exc(limit=3)
                entries.append(entry)
                print("%s %s: %s" % (name, json.dumps(patch),
                                     entry.get("class", entry.get("error", "")[-200:])))
            golden["tokenizers"][name] = entries
    with open(out, "w", encoding="utf-8") as f:
        f.write("{\n \"transformers_version\": %s,\n \"tokenizers\": {\n"
                % json.dumps(golden["transformers_version"]))
        names = list(golden["tokenizers"])
        for n_index, name in enumerate(names):
            f.write("  %s: [\n" % json.dumps(name))
            entries = golden["tokenizers"][name]
            for i, entry in enumerate(entries):
                tail = "," if i + 1 < len(entries) else ""
                f.write("   " + json.dumps(entry, ensure_ascii=False) + tail + "\n")
            f.write("  ]" + ("," if n_index + 1 < len(names) else "") + "\n")
        f.write(" }\n}\n")
    json.load(open(out, encoding="utf-8"))  # round-trips


if __name__ == "__main__":
    main()
