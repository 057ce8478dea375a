#!/usr/bin/env python3
"""Writes the tokenizer goldens that tests/tokenizer compares Tessera's tokenizer with.

Usage: tokenizer_goldens.py TOKENIZERS_DIR OUT_DIR

TOKENIZERS_DIR holds {llama3,qwen3,llama2}/{tokenizer.json,tokenizer_config.json}
(scripts/fetch-test-assets puts them in tests/assets/tokenizers). For each tokenizer this writes
OUT_DIR/tokenizer_<name>.json with, for every text of CORPUS, the ids Hugging Face `tokenizers`
gives with add_special_tokens true and false and the decoded strings (skip_special_tokens true and
false); decodes of fixed and random id sequences (byte tokens cut mid-character included); and an
"added" section: the same tokenizer with extra added tokens (lstrip, rstrip, single_word,
normalized, special), their JSON entries and the encodes of ADDED_CORPUS with them. When
`transformers` loads the directory too, its ids are recorded where they differ (the
"transformers" section): Tessera's Tokenizer::load of the directory must give those (vLLM tokenizes
with transformers), its Tokenizer::from_json of tokenizer.json alone the `tokenizers` ones.

Needs python3 with `tokenizers` (and optionally `transformers`); no network. Run it on the GPU
machine (it has both installed) and copy the outputs into tests/assets/goldens/.
"""
import json
import os
import random
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
from tokenizers import AddedToken, Tokenizer  # noqa: E402

NAMES = ["llama3", "qwen3", "llama2"]

LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 3
    + "Tokenizers split text into pieces; byte-level BPE never fails, while SentencePiece "
    "falls back to bytes for rare characters such as \U0001F9EC or \u9f98. "
    + "東京は日本の首都です。人工知能の研究が進んでいます。" * 2
    + "\n\n```python\nfor i in range(10):\n\tprint(i ** 2)  # squares\n```\n"
    + "Numbers: 3.14159265358979, 2718281828, 1,000,000 and -42.\n"
)

CORPUS = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "Hello",
    "Hello world",
    " Hello world",
    "Hello world!  ",
    "The quick brown fox jumps over the lazy dog.",
    "I'LL go, don't you? We're here; he'S done, they'VE left, I'd say I'm fine.",
    "DON'T SHOUT. Don't whisper.",
    "我爱自然语言处理。今天天气很好！",
    "日本語のテキストを正しく分割できますか？カタカナとひらがな。",
    "안녕하세요 세계",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "สวัสดีครับ",
    "def f(x):\n\treturn x  # comment\n\n\n    if x:\n        pass\n",
    "int main() {\n    printf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    '{"key": [1, 2, 3], "url": "https://example.com/a?b=c&d=e"}',
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🧑🏿‍🚀",
    "a     b      c",
    "     leading spaces",
    "trailing spaces     ",
    "\n\n\nthree newlines\n\n",
    " \n \n  \n",
    "line one\r\nline two\r\n",
    "1234567890 12345678901234567890 3.14159 1,000,000 007",
    "<|begin_of_text|>Hello<|end_of_text|>",
    "<s>[INST] hi [/INST]</s>",
    "Hello <s> world </s> <unk>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\n\n</think>\n\nAnswer",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
    "Cafe\u0301 re\u0301sume\u0301 na\u0308ive \u1100\u1161\u11a8 "
    "Tie\u0302\u0301ng Vie\u0323\u0302t",
    "Café résumé naïve 각 Tiếng Việt",
    "Ångström ﬁ ① Ⅻ ｶ ＡＢＣ",
    "nbsp\u00a0here ideographic\u3000space zero\u200bwidth",
    "control \x00 \x07 bell and \ufffd replacement",
    "mixed中文and English混合text123数字",
    "   \t  \n\t\tindent",
    "$100 + €200 = ¥300 ~ £!?",
    "a" * 50,
    "\U0001F600" * 5,
    "a\u0085b\u2028c\u180ed\u2029e\u000bf\u000cg \u205fh",
    "ǅemo ǈ ſ'S I'M ｉ'ｓ K'LL",
    "x\u200dy\u200cz 🏳️‍🌈",
    LONG_TEXT,
]

ADDED_TOKENS = [
    # (content, single_word, lstrip, rstrip, normalized, special)
    ("<tool>", False, True, True, False, False),
    ("[WORD]", True, False, False, False, False),
    ("hello world", False, False, False, True, False),
    ("café", False, False, False, True, False),
    ("<|mine|>", False, False, False, False, True),
    ("<|mine|>x", False, False, False, False, True),
    ("<end>", False, True, False, False, True),
    ("ZZ", True, True, True, False, False),
]

ADDED_CORPUS = [
    "Use <tool> now",
    "Use   <tool>   now",
    "<tool><tool>x",
    "a [WORD] b",
    "a[WORD] b",
    "[WORD]",
    "x[WORD]y [WORD].",
    "say hello world!",
    "hello worlds hello world",
    "Hello World",
    "<|mine|>x and <|mine|>y <|mine|>",
    "une cafe\u0301 et un café",
    "text   <end>  after<end>",
    "ZZ top ZZtop  ZZ  ZZ",
    "Hello <s> world </s> <|im_start|><|begin_of_text|>",
]


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
              "use_regex": False}
SPM_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def split_on_space(behavior, invert=False):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": behavior, "invert": invert},
        BYTE_LEVEL]}


# Variants of the real tokenizers, for components and options the three files do not use:
# (base, variant name, sections of tokenizer.json replaced). The tests patch the same sections.
VARIANTS = [
    # Official Llama 3 files add <|begin_of_text|> with a TemplateProcessing after ByteLevel.
    ("llama3", "template_bos", {"post_processor": {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
                                                  "tokens": ["<|begin_of_text|>"]}}}]}}),
    # Mistral v0.3 style: no normalizer, Metaspace(prepend_scheme first, no split).
    ("llama2", "metaspace_first", {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first", "split": False},
        "decoder": SPM_DECODER}),
    ("llama2", "metaspace_always_split", {
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "always", "split": True},
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                    "split": True}}),
    ("llama2", "replace_regex", {"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"Regex": " {2,}|\t"}, "content": "\u2581"}]}}),
    # GPT-2 style: ByteLevel splits with its own regex and adds a prefix space.
    ("qwen3", "gpt2_byte_level", {
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                          "use_regex": True}}),
    ("qwen3", "split_removed", {"pre_tokenizer": split_on_space("Removed")}),
    ("qwen3", "split_merged_with_previous",
     {"pre_tokenizer": split_on_space("MergedWithPrevious")}),
    ("qwen3", "split_merged_with_next", {"pre_tokenizer": split_on_space("MergedWithNext")}),
    ("qwen3", "split_contiguous", {"pre_tokenizer": split_on_space("Contiguous")}),
    ("qwen3", "split_inverted", {"pre_tokenizer": split_on_space("Isolated", invert=True)}),
]

VARIANT_CORPUS = [t for t in CORPUS if t is not LONG_TEXT] + [
    "<s>Hello", "Hello <s>world", " <s> x", "a  b   c\t\td",
]


def variant_sections(tok_path, name):
    out = []
    for base, variant, patch in VARIANTS:
        if base != name:
            continue
        spec = json.load(open(tok_path, encoding="utf-8"))
        spec.update(patch)
        try:
            tok = Tokenizer.from_str(json.dumps(spec))
            out.append({"name": variant, "patch": patch,
                        "cases": encode_cases(tok, VARIANT_CORPUS)})
        except Exception:
            out.append({"name": variant, "patch": patch,
                        "error": traceback.format_exc(limit=3)})
    return out


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_token_ids(tok):
    """Id of each byte's token: <0xAB> for SentencePiece, the byte-level char otherwise."""
    b2u = bytes_to_unicode()
    ids = {}
    for b in range(256):
        i = tok.token_to_id("<0x%02X>" % b)
        if i is None:
            i = tok.token_to_id(b2u[b])
        if i is not None:
            ids[b] = i
    return ids


def encode_cases(tok, texts):
    cases = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True).ids
        ids_no = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "text": text,
            "ids": ids,
            "ids_no_special": ids_no,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    return cases


def decode_cases(tok):
    n = tok.get_vocab_size(with_added_tokens=True)
    byte_ids = byte_token_ids(tok)
    seqs = []
    for text in ["中", "😀", "é", "👍🏽"]:
        data = text.encode("utf-8")
        if all(b in byte_ids for b in data):
            full = [byte_ids[b] for b in data]
            for cut in range(1, len(full) + 1):
                seqs.append(full[:cut])
            seqs.append(full[1:])  # starts with a continuation byte
    if 0xFF in byte_ids and ord("A") in byte_ids:
        seqs.append([byte_ids[0xFF], byte_ids[ord("A")]])  # never valid UTF-8
    rng = random.Random(20240601)
    for _ in range(30):
        seqs.append([rng.randrange(n) for _ in range(rng.randint(1, 16))])
    # Runs of byte tokens (valid UTF-8 or not) among ordinary tokens.
    byte_list = sorted(byte_ids.values())
    for _ in range(20):
        seq = [rng.choice(byte_list) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.5:
            seq.insert(rng.randrange(len(seq) + 1), rng.randrange(n))
        seqs.append(seq)
    out = []
    for ids in seqs:
        out.append({
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    return out


def added_section(path):
    tok = Tokenizer.from_file(path)
    normal = [AddedToken(c, single_word=s, lstrip=l, rstrip=r, normalized=nm, special=False)
              for (c, s, l, r, nm, sp) in ADDED_TOKENS if not sp]
    special = [AddedToken(c, single_word=s, lstrip=l, rstrip=r, normalized=nm, special=True)
               for (c, s, l, r, nm, sp) in ADDED_TOKENS if sp]
    tok.add_tokens(normal)
    tok.add_special_tokens(special)
    added = json.loads(tok.to_str())["added_tokens"]
    return {
        "added_tokens": added,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "cases": encode_cases(tok, ADDED_CORPUS),
    }


def transformers_section(directory, texts):
    try:
        import transformers
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(directory)
        cases = []
        for text in texts:
            cases.append({
                "ids": tok(text, add_special_tokens=True)["input_ids"],
                "ids_no_special": tok(text, add_special_tokens=False)["input_ids"],
            })
        return {"version": transformers.__version__, "class": type(tok).__name__,
                "len": len(tok), "cases": cases}
    except Exception:  # informational only: never fail the goldens over it
        return {"error": traceback.format_exc(limit=3)}


def encode_time_ms(tok):
    """Median time of one encode of about 10 kB (for comparison with Tessera's)."""
    import time
    text = ""
    while len(text.encode("utf-8")) < 10000:
        text += LONG_TEXT
    times = []
    for _ in range(7):
        start = time.perf_counter()
        tok.encode(text, add_special_tokens=True)
        times.append((time.perf_counter() - start) * 1000)
    return round(sorted(times)[3], 3)


def dump(path, obj):
    """JSON with one case per line: small diffs when goldens change."""
    lines = ["{"]
    keys = list(obj.keys())
    for k_index, key in enumerate(keys):
        value = obj[key]
        comma = "," if k_index + 1 < len(keys) else ""
        if isinstance(value, list):
            lines.append(" %s: [" % json.dumps(key))
            for i, item in enumerate(value):
                tail = "," if i + 1 < len(value) else ""
                lines.append("  " + json.dumps(item, ensure_ascii=False) + tail)
            lines.append(" ]" + comma)
        elif isinstance(value, dict):
            lines.append(" %s: {" % json.dumps(key))
            sub = list(value.keys())
            for i, sk in enumerate(sub):
                tail = "," if i + 1 < len(sub) else ""
                lines.append("  %s: %s%s" % (json.dumps(sk),
                                             json.dumps(value[sk], ensure_ascii=False), tail))
            lines.append(" }" + comma)
        else:
            lines.append(" %s: %s%s" % (json.dumps(key), json.dumps(value, ensure_ascii=False),
                                        comma))
    lines.append("}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    json.load(open(path, encoding="utf-8"))  # round-trips


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for name in NAMES:
        directory = os.path.join(src, name)
        path = os.path.join(directory, "tokenizer.json")
        tok = Tokenizer.from_file(path)
        cases = encode_cases(tok, CORPUS)
        golden = {
            "name": name,
            "tokenizers_version": tokenizers.__version__,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "encode_10kb_ms": encode_time_ms(tok),
            "cases": cases,
            "decode_cases": decode_cases(tok),
            "added": added_section(path),
            "variants": variant_sections(path, name),
        }
        hf = transformers_section(directory, CORPUS)
        if "cases" in hf:
            mismatches = [i for i, (a, b) in enumerate(zip(cases, hf["cases"]))
                          if a["ids"] != b["ids"] or a["ids_no_special"] != b["ids_no_special"]]
            hf["mismatches"] = mismatches
            hf["cases"] = [dict(hf["cases"][i], index=i) for i in mismatches]
        golden["transformers"] = hf
        dump(os.path.join(out, "tokenizer_%s.json" % name), golden)
        print("%s: %d cases, %d decode cases, variants %s, transformers: %s" % (
            name, len(cases), len(golden["decode_cases"]),
            [(v["name"], len(v.get("cases", [])), v.get("error", "")[-200:])
             for v in golden["variants"]],
            hf.get("mismatches", hf.get("error", "")[-300:])))


if __name__ == "__main__":
    main()
