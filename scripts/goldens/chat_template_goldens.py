#!/usr/bin/env python3
"""Writes the chat-template goldens that tests/chat compares tessera_chat with.

    chat_template_goldens.py TOKENIZERS_DIR OUT_DIR

TOKENIZERS_DIR holds llama3/, qwen3/ and llama2/ (tokenizer.json + tokenizer_config.json, from
scripts/fetch-test-assets). For each, the cases below are rendered by Hugging Face
transformers, `AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False,
add_generation_prompt=..., **extra)`, and written to OUT_DIR/chat_<name>.json with the text or
the error message. chat_features.json holds small templates that exercise the Jinja features
one by one, rendered the same way (through the llama3 tokenizer, chat_template=...).

Llama 2's tokenizer_config.json (from the npm package) has no chat_template, so the template of
meta-llama/Llama-2-7b-chat-hf is given inline and written into chat_llama2.json.

No network is needed. If transformers is missing or cannot load a folder, the script renders
with jinja2 set up exactly as transformers sets it up, and says so in the file's "renderer".
Run it where transformers is installed (e.g. the GPU machine: python3
scripts/goldens/chat_template_goldens.py tests/assets/tokenizers $OUT), then copy the files to
tests/assets/goldens/.
"""

import json
import os
import sys
import traceback

# The chat_template of meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def U(c):
    return {"role": "user", "content": c}


def A(c, **kw):
    return dict({"role": "assistant", "content": c}, **kw)


def S(c):
    return {"role": "system", "content": c}


TRICKY = ("héllo wörld — 你好 😀\n\"double\" 'single' \\backslash {{ braces }} {% tag %} {# c #}"
          "\ttab\n")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (°C — ü)",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"},
                           "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TOOL_CALL_TURNS = [
    U("What's the weather in Paris?"),
    A("", tool_calls=[{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]),
    {"role": "tool", "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"},
    {"role": "tool", "content": "second result"},
    A("It is 21.5 °C and clear."),
    U("Thanks!"),
]

COMMON = [
    ("single_user", [U("Hello!")], False, {}),
    ("single_user_gen", [U("Hello!")], True, {}),
    ("system_user_gen", [S("You are a helpful assistant."), U("Who are you?")], True, {}),
    ("system_user", [S("You are a helpful assistant."), U("Who are you?")], False, {}),
    ("multi_turn_gen", [S("Be brief."), U("Hi"), A("Hello! How can I help?"), U("Tell me a joke.")],
     True, {}),
    ("multi_turn_closed", [U("2+2?"), A("4"), U("3+3?"), A("6")], False, {}),
    ("tricky_content", [S("  sys with spaces  "), U(TRICKY), A("  padded answer \n\n"), U("ok")],
     True, {}),
]

CASES = {
    "llama3": COMMON + [
        ("whitespace_only_content", [U(" \n\t ")], True, {}),
        ("unicode_whitespace_trimmed", [U("\u3000 hi \u00a0\n")], True, {}),
        ("content_parts_list", [U([{"type": "text", "text": "hi"}])], True, {}),
        ("assistant_first", [A("I start."), U("ok")], True, {}),
    ],
    "qwen3": COMMON + [
        ("no_thinking_gen", [U("Hello!")], True, {"enable_thinking": False}),
        ("thinking_true_gen", [U("Hello!")], True, {"enable_thinking": True}),
        ("no_thinking_multi", [S("sys"), U("a"), A("b"), U("c")], True, {"enable_thinking": False}),
        ("think_in_last_assistant",
         [U("What is 2+2?"), A("<think>\nSimple arithmetic.\n</think>\n\nIt is 4.")], False, {}),
        ("think_in_earlier_assistant",
         [U("q1"), A("<think>r1</think>a1"), U("q2"), A("<think>\nr2\n</think>\n\na2")], False,
         {}),
        ("think_history_then_gen",
         [U("q1"), A("<think>\nr1\n</think>\n\na1"), U("q2")], True, {"enable_thinking": False}),
        ("reasoning_content_field", [U("q"), A("answer", reasoning_content="because")], False, {}),
        ("tools", [S("You can call tools."), U("Weather in Paris?")], True,
         {"tools": [WEATHER_TOOL]}),
        ("tool_calls_and_responses", TOOL_CALL_TURNS, True, {}),
        ("tool_call_string_arguments",
         [U("q"), A("calling", tool_calls=[
             {"function": {"name": "f", "arguments": "{\"x\": 1}"}},
             {"name": "g", "arguments": {"y": [1, 2.5, None, True]}}])],
         False, {}),
        ("system_after_first", [S("s1"), U("u"), S("s2"), U("u2")], True, {}),
        ("multi_step_tool_response",
         [U("q"), A("<think>r</think>call"), U("<tool_response>x</tool_response>"),
          A("<think>\nr2\n</think>\n\nfinal")], False, {}),
        ("content_parts_list", [U([{"type": "text", "text": "hi"}])], True, {}),
    ],
    "llama2": COMMON + [
        ("non_alternating_roles", [U("one"), U("two")], True, {}),
        ("assistant_first", [A("I start."), U("ok")], False, {}),
        ("system_then_assistant", [S("sys"), A("hi")], False, {}),
    ],
}

# Small templates, one Jinja feature each; rendered with messages FEATURE_MESSAGES.
FEATURE_MESSAGES = [S(" Be nice. "), U("Hi there"), A("Hello!"), U("héllo {{x}}")]
FEATURES = [
    "{{ tools is none }}|{{ documents is none }}|{{ tools is defined }}|{{ bos_token }}|"
    "{{ eos_token }}",
    "{% for m in messages %}{{ loop.index0 }}/{{ loop.index }}/{{ loop.length }}/{{ loop.first }}/"
    "{{ loop.last }}/{{ loop.revindex }}:{{ m.role }};{% endfor %}",
    "  {% if true %}\n  x\n  {% endif %}\n  {# c #}\ny\n{{ 1 }}\n{% raw %}{{ a }}{% endraw %}\n",
    "a  {%- if true -%}  b  {%- endif -%}  c|a\n  {%+ if true +%}\nb{% endif %}|"
    "a {# x #}\nb\n  {#- y -#}  c",
    "{%- for m in messages %}\n  {{- m.role }}: {{ m.content | trim }}\n{% endfor %}\n"
    "{%- if add_generation_prompt %}\nassistant:\n{%- endif %}",
    "{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% set ns.last = m.role %}{% endfor %}{{ ns.n }} {{ ns.last }} {{ ns }}",
    "{% for i in [1,2,3] %}{% if loop.first %}{% set y = 5 %}{% endif %}[{{ y }}]{% endfor %}"
    "[{{ y }}]",
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}:{{ m.content }} "
    "{% else %}none{% endfor %}",
    "{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}"
    "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{{ messages[::-1] | map(attribute='role') | join(',') }}|{{ messages[1:] | length }}|"
    "{{ 'abc'[::-1] }}|{{ 'héllo'[1:3] }}|{{ messages[-1].content[:4] }}",
    "{{ 'x' ~ 1 ~ none ~ true }}|{{ 'a' + 'b' }}|{{ [1] + [2] }}|{{ 7 // 2 }} {{ -7 // 2 }} "
    "{{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 10 / 4 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 3 * 'ab' }}",
    "{{ undefined_var }}|{{ undefined_var is defined }}|{{ undefined_var | length }}|"
    "{{ undefined_var ~ 'x' }}|{% for x in undefined_var %}never{% endfor %}|"
    "{{ not undefined_var }}",
    "{{ messages[0].missing is defined }}|{{ messages[0]['missing'] is none }}|"
    "{{ messages[9] is defined }}",
    "{{ {'b': 1, 'a': [1, 2.5, none, true, 'é\"\\n']} | tojson }}|"
    "{{ {'a': {'b': []}} | tojson(indent=2) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|"
    "{{ 'é' | tojson(ensure_ascii=true) }}|{{ messages[1] | tojson }}",
    "{{ '  x  ' | trim }}|{{ 'Ab' | upper }}{{ 'Ab' | lower }}|{{ 5 | string | length }}|"
    "{{ none | default('d') }}{{ undefined_var | default('d') }}{{ '' | default('d', true) }}|"
    "{{ [3, 1, 2] | first }}{{ [3, 1, 2] | last }}{{ [3, 1, 2] | sort | join('-') }}|"
    "{{ 'a b a' | replace('a', 'x') }}|{{ ['a', 'b'] | join(', ') }}|"
    "{{ [1, 2, 2] | unique | list }}",
    "{{ ' a b '.strip() }}|{{ 'xxaxx'.lstrip('x') }}|{{ 'xxaxx'.rstrip('x') }}|"
    "{{ 'a,b,,c'.split(',') }}|"
    "{{ ' a  b '.split() }}|{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|"
    "{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}|{{ 'a-b-c'.rsplit('-', 1) }}|{{ 'hello world'.title() }}",
    "{{ 'a' in 'cab' }}{{ 'z' not in 'cab' }}{{ 2 in [1, 2] }}{{ 'role' in messages[0] }}|"
    "{{ 1 < 2 < 3 }}{{ 1 == 1.0 }}{{ 'a' != 'b' }}|{{ true and 'x' }}|{{ false or '' }}|"
    "{{ 0 or none }}",
    "{{ 5 is number }}{{ 5 is integer }}{{ 1.5 is float }}{{ 'a' is string }}{{ {} is mapping }}"
    "{{ [] is sequence }}{{ [] is iterable }}{{ 3 is odd }}{{ 4 is even }}{{ 6 is divisibleby 3 }}"
    "{{ none is none }}{{ false is false }}{{ true is true }}{{ 1 is sameas 1 }}",
    "{% macro turn(role, text='(empty)') %}<{{ role }}>{{ text }}</{{ role }}>{% endmacro %}"
    "{% for m in messages %}{{ turn(m.role, m.content) }}{% endfor %}{{ turn('x') }}",
    "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n }}*{{ fact(n - 1) }}{% endif %}"
    "{% endmacro %}{{ fact(5) }}",
    "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]{% set a, b = 1, 2 %}{{ a }}{{ b }}"
    "{% with w = 3 %}{{ w }}{% endwith %}{{ w }}",
    "{{ {'a': [1, 'b', none, true], 'c': 1.0} }}|{{ ('x', 1) }}|{{ [\"it's\", 'say \"hi\"'] }}|"
    "{{ {'k': 'v'}.items() | list }}|{{ {'k': 'v'}.get('z', 'dflt') }}",
    "{% for k, v in {'one': 1, 'two': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
    "{{ dict(a=1) }}{{ range(3) | list }}{{ range(5, 0, -2) | list }}",
    "{{ 'yes' if messages | length > 2 else 'no' }}|{{ 'x' if false }}|"
    "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('/') }}",
    "{{ raise_exception('Custom failure: ' ~ messages | length) }}",
    "{{ messages[0].content + 1 }}",
    "{{ undefined_var.attr }}",
    "{% if %}",
    "{{ messages | no_such_filter }}",
    "{% for m in messages %}{% endif %}",
    "{{ 'unterminated }}",
    "{{ strftime_now('%%') }}|{{ '3' | int + 1 }}{{ 2.7 | int }}{{ '1.5' | float }}{{ 3 | float }}",
    "{% for m in messages %}{{ loop.cycle('a', 'b') }}"
    "{{ loop.previtem.role if loop.previtem is defined }};{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
    "{% endgeneration %}{% endif %}{% endfor %}",
]


CONTEXT_PROBE = (
    "bos_token={{ bos_token is defined }}/{{ bos_token is none }} "
    "eos_token={{ eos_token is defined }} pad_token={{ pad_token is defined }} "
    "unk_token={{ unk_token is defined }} "
    "additional_special_tokens={{ additional_special_tokens is defined }} "
    "tools={{ tools is defined }}/{{ tools is none }} documents={{ documents is defined }}")


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class Jinja2Renderer:
    """jinja2 configured as transformers' _compile_jinja_template configures it."""

    def __init__(self, config):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from datetime import datetime

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        class Generation(jinja2.ext.Extension):  # transformers' AssistantTracker, not tracking
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body
                                              ).set_lineno(lineno)

            def _render(self, caller):
                return caller()

        self.env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
        self.env.filters["tojson"] = tojson
        self.env.globals["raise_exception"] = raise_exception
        self.env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
        # transformers passes the special tokens that are set (not None).
        self.tokens = {k: token_text(config[k]) for k in SPECIAL_TOKENS
                       if token_text(config.get(k)) is not None}
        self.bos, self.eos = self.tokens.get("bos_token"), self.tokens.get("eos_token")
        self.description = f"jinja2 {jinja2.__version__} (transformers' environment, replicated)"

    def render(self, template, messages, add_generation_prompt, extra):
        extra = dict(extra)
        tools = extra.pop("tools", None)
        return self.env.from_string(template).render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **self.tokens, **extra)


class TransformersRenderer:
    def __init__(self, folder):
        import transformers
        self.tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.bos, self.eos = self.tok.bos_token, self.tok.eos_token
        self.description = (f"transformers {transformers.__version__} "
                            f"{type(self.tok).__name__}.apply_chat_template")

    def render(self, template, messages, add_generation_prompt, extra):
        kwargs = dict(extra)
        if template is not None:
            kwargs["chat_template"] = template
        out = self.tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        if not isinstance(out, str):
            raise RuntimeError(f"apply_chat_template returned {type(out).__name__}, not str")
        return out


SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token"]


def token_text(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def make_renderer(folder):
    try:
        return TransformersRenderer(folder)
    except Exception as e:  # noqa: BLE001 - any failure: fall back and say why
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        r = Jinja2Renderer(config)
        r.description += f"; AutoTokenizer failed: {type(e).__name__}: {e}"[:300]
        print(f"warning: {folder}: {r.description}", file=sys.stderr)
        return r


def render_case(renderer, template, messages, agp, extra):
    case = {"messages": messages, "add_generation_prompt": agp, "extra": extra}
    try:
        case["rendered"] = renderer.render(template, messages, agp, extra)
    except Exception as e:  # noqa: BLE001 - the error text is the golden
        case["error"] = str(e)
        case["error_type"] = type(e).__name__
    return case


def write(out_dir, name, data):
    path = os.path.join(out_dir, f"chat_{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(data['cases'])} cases")


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    tokenizers, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name, cases in CASES.items():
        folder = os.path.join(tokenizers, name)
        renderer = make_renderer(folder)
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            has_template = "chat_template" in json.load(f)
        inline = None if has_template else LLAMA2_CHAT_TEMPLATE
        if inline is None and isinstance(renderer, Jinja2Renderer):
            with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
                inline_for_fallback = json.load(f)["chat_template"]
        else:
            inline_for_fallback = inline
        data = {
            "name": name,
            "generator": "scripts/goldens/chat_template_goldens.py",
            "renderer": renderer.description,
            "tokenizer_dir": f"tests/assets/tokenizers/{name}",
            "bos_token": renderer.bos,
            "eos_token": renderer.eos,
            "chat_template_source": "tokenizer_config.json" if inline is None else
            "inline: tokenizer_config.json has none; meta-llama/Llama-2-7b-chat-hf's template",
        }
        if inline is not None:
            data["chat_template"] = inline
        # Which variables transformers gives every template (special tokens, tools, ...).
        data["context_probe"] = dict({"template": CONTEXT_PROBE},
                                     **render_case(renderer, CONTEXT_PROBE, [U("x")], False, {}))
        data["cases"] = []
        for case_name, messages, agp, extra in cases:
            case = render_case(renderer, inline_for_fallback, messages, agp, extra)
            data["cases"].append(dict({"name": case_name}, **case))
        write(out_dir, name, data)
        if name == "llama3":
            features = dict(data, name="features", chat_template_source="per case")
            features.pop("chat_template", None)
            features["cases"] = []
            for i, template in enumerate(FEATURES):
                case = render_case(renderer, template, FEATURE_MESSAGES, i % 2 == 0, {})
                features["cases"].append(dict({"name": f"feature_{i:02d}", "template": template},
                                              **case))
            write(out_dir, "features", features)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
