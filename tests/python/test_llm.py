"""tessera.LLM on the CPU backend: vLLM's generate / chat / tokenizer / streaming API over the
C++ driver, and the engine keywords (the CLI's flags)."""

import json

import pytest

import tessera
from tessera import LLM, SamplingParams, _tessera
from conftest import run_tessera

GREEDY = SamplingParams(temperature=0, max_tokens=6)


# ---- engine keywords: the CLI's flags under vLLM's names


def test_every_cli_engine_flag_is_a_keyword():
    keywords = {k for k, *_ in _tessera.engine_keywords()}
    expected = {"tensor_parallel_size", "pipeline_parallel_size", "pipeline_layer_partition",
                "dtype", "quantization", "device", "max_model_len", "gpu_memory_utilization",
                "max_num_seqs", "max_num_batched_tokens", "block_size", "enforce_eager",
                "kv_cache_dtype", "collectives", "disable_custom_all_reduce",
                "enable_prefix_caching", "async_scheduling", "nccl_init_timeout",
                "enable_expert_parallel"}
    assert expected <= keywords
    assert not {"model", "address", "cluster_token_file", "help"} & keywords
    doc = tessera.LLM.__doc__
    for k in keywords:
        assert k in doc, k


def test_keywords_reach_the_engine_spec(tiny_model):
    spec = _tessera.engine_args(tiny_model, dict(
        tensor_parallel_size=2, pipeline_parallel_size="auto", pipeline_layer_partition=[1, 1],
        dtype="half", quantization="fp8", device="cpu", max_model_len=256,
        gpu_memory_utilization=0.5, max_num_seqs=8, max_num_batched_tokens=128, block_size=32,
        num_gpu_blocks_override=64, enforce_eager=True, kv_cache_dtype="fp8", collectives="tcp",
        disable_custom_all_reduce=True, enable_prefix_caching=False, async_scheduling=True,
        nccl_init_timeout=30, enable_expert_parallel=True, load_format="dummy"))
    assert spec == dict(
        model=tiny_model, tensor_parallel_size="2", pipeline_parallel_size="auto",
        pipeline_layer_partition=[1, 1], enable_expert_parallel=True, load_format="dummy",
        dtype="half",
        quantization="fp8", device="cpu", max_model_len=256, gpu_memory_utilization=0.5,
        max_num_seqs=8, max_num_batched_tokens=128, block_size=32, num_gpu_blocks_override=64,
        enforce_eager=True,
        kv_cache_dtype="fp8_e4m3",
        collectives="tcp", disable_custom_all_reduce=True, enable_prefix_caching=False,
        async_scheduling=True, nccl_init_timeout=30)
    defaults = _tessera.engine_args(tiny_model, {})
    assert defaults["enable_prefix_caching"] is True
    assert defaults["gpu_memory_utilization"] == 0.9
    assert defaults["enable_expert_parallel"] is False
    assert defaults["load_format"] == "auto"
    assert _tessera.engine_args(tiny_model, dict(enforce_eager=None))["enforce_eager"] is False


@pytest.mark.parametrize("options,match", [
    (dict(tensor_parallel_size="two"), "tensor_parallel_size"),
    (dict(max_num_seqs="x"), "max_num_seqs"),
    (dict(quantization="int3"), "quantization"),
    (dict(gpu_memory_utilization=1.5), "gpu-memory-utilization"),
    (dict(block_size=0), "block"),
])
def test_bad_keyword_values_are_value_errors(tiny_model, options, match):
    with pytest.raises(ValueError, match=match):
        _tessera.engine_args(tiny_model, options)


def test_unknown_keyword_is_a_type_error(tiny_model):
    with pytest.raises(TypeError, match="swap_spaces"):
        LLM(tiny_model, swap_spaces=4)
    with pytest.raises(TypeError, match="dtype"):
        LLM(tiny_model, dtype=object())


def test_missing_model_is_named(tmp_path):
    with pytest.raises(RuntimeError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"), device="cpu")


# ---- generate


def test_prompt_forms_agree(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello, my name is")
    by_text = llm.generate("Hello, my name is", GREEDY, use_tqdm=False)[0]
    assert by_text.prompt == "Hello, my name is"
    assert by_text.prompt_token_ids == ids
    forms = [
        llm.generate(["Hello, my name is"], GREEDY)[0],
        llm.generate({"prompt": "Hello, my name is"}, GREEDY)[0],
        llm.generate({"prompt_token_ids": ids}, GREEDY)[0],
        llm.generate(ids, GREEDY)[0],
        llm.generate([ids], GREEDY)[0],
        llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0],
    ]
    for out in forms:
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == by_text.outputs[0].token_ids
        assert out.outputs[0].text == by_text.outputs[0].text
    assert forms[3].prompt is None
    with pytest.raises(TypeError, match="prompt 0"):
        llm.generate([3.5], GREEDY)


def test_results_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["a b c", "The capital of France is", "1 2 3 4"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (2, 5, 3)]
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5, 3]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert len({o.request_id for o in outs}) == 3
    with pytest.raises(ValueError, match="3 prompts"):
        llm.generate(prompts, params[:2])


def test_output_fields_and_metrics(llm):
    out = llm.generate("Hi there", SamplingParams(temperature=0, max_tokens=4))[0]
    c = out.outputs[0]
    assert c.index == 0 and c.finished()
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    assert c.logprobs is None and c.cumulative_logprob is None
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time == m.finished_time


def test_n_and_seeds(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5)
    out = llm.generate("Once upon a time", p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    again = llm.generate("Once upon a time", p)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    # Seeds are stepped per copy, as the server's n: copy 1 is seed 12 on its own.
    single = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=12,
                                                             max_tokens=5))[0]
    assert single.outputs[0].token_ids == out.outputs[1].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_llm_seed_makes_unseeded_requests_reproducible(tiny_model):
    p = SamplingParams(temperature=1.0, max_tokens=5)
    runs = []
    for _ in range(2):
        with LLM(tiny_model, device="cpu", max_model_len=256, seed=5) as m:
            runs.append([o.outputs[0].token_ids for o in m.generate(["x", "y"], p)])
    assert runs[0] == runs[1]


def test_logprobs(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        ranks = sorted(lp.rank for lp in entry.values() if lp.rank is not None)
        assert ranks == [1, 2, 3]
        # Greedy: the sampled token is the most likely one.
        assert entry[token].rank == 1
        assert entry[token].logprob <= 0
        assert isinstance(entry[token].decoded_token, str)
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_stop_reasons(llm):
    free = llm.generate("Count: 1 2 3", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    # A stop token id: the third token generated.
    by_id = llm.generate("Count: 1 2 3", SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[free.token_ids[2]]))[0].outputs[0]
    assert by_id.finish_reason == "stop"
    assert by_id.stop_reason == free.token_ids[2]
    assert by_id.token_ids == free.token_ids[:3]
    # A stop string: a piece of the text; the text ends before it.
    piece = free.text[len(free.text) // 2:][:3]
    by_text = llm.generate("Count: 1 2 3", SamplingParams(
        temperature=0, max_tokens=8, stop=[piece]))[0].outputs[0]
    assert by_text.finish_reason == "stop"
    assert by_text.stop_reason == piece
    assert free.text.startswith(by_text.text) and piece not in by_text.text
    assert free.finish_reason == "length" and free.stop_reason is None


def test_prompt_too_long_is_a_value_error(llm):
    with pytest.raises(ValueError, match="600 tokens, but max-model-len is 512"):
        llm.generate([[1] * 600], GREEDY)


def test_same_tokens_as_tessera_generate(llm, tiny_model):
    """The Python path and `tessera generate` give identical tokens for the same seeded
    requests."""
    prompts = ["The quick brown fox", "In 1492,"]
    cli = run_tessera("generate", "--model", tiny_model, "--device", "cpu", "--json",
                      "--max-model-len", "512", "--max-tokens", "12", "--temperature", "0.9",
                      "--top-p", "0.95", "--seed", "1234",
                      *[a for p in prompts for a in ("--prompt", p)])
    assert cli.returncode == 0, cli.stderr
    cli_tokens = [json.loads(line)["output_ids"] for line in cli.stdout.splitlines()]
    outs = llm.generate(prompts, SamplingParams(temperature=0.9, top_p=0.95, seed=1234,
                                                max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == cli_tokens


# ---- the tokenizer, chat


def test_tokenizer(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello world")
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert ids[len(ids) - len(plain):] == plain and len(plain) == 2
    assert tok.decode(ids) == "Hello world"
    assert tok.decode([tok.bos_token_id] + plain) == "Hello world"
    assert tok.decode([tok.bos_token_id] + plain, skip_special_tokens=False) == (
        "<|begin_of_text|>Hello world")
    assert len(tok) == tok.vocab_size == 128256
    assert tok.eos_token_id is not None


CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"}]


def test_chat_template_and_chat(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|>") and "What is 2 + 2?" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=True) == tok.encode(
        text, add_special_tokens=False)
    out = llm.chat(CONVERSATION, GREEDY)[0]
    assert out.prompt == text
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    two = llm.chat([CONVERSATION, CONVERSATION[1:]], GREEDY)
    assert len(two) == 2 and two[0].prompt == text


def test_tools_keep_the_callers_key_order(llm):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}}}]
    template = "{{ tools | tojson }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    text = llm.get_tokenizer().apply_chat_template(CONVERSATION[1:], tokenize=False, tools=tools,
                                                   chat_template=template)
    assert text == json.dumps(tools) + "|What is 2 + 2?"
    out = llm.chat(CONVERSATION[1:], GREEDY, chat_template=template, tools=tools)[0]
    assert out.prompt == text


def test_chat_template_errors(llm):
    with pytest.raises(ValueError, match="syntax"):
        llm.chat(CONVERSATION, GREEDY, chat_template="{% if %}")
    with pytest.raises(ValueError, match="no!"):
        llm.chat(CONVERSATION, GREEDY, chat_template="{{ raise_exception('no!') }}")
    with pytest.raises(TypeError, match="JSON"):
        llm.chat([{"role": "user", "content": object()}], GREEDY)


# ---- streaming


def test_stream_matches_generate(llm):
    p = SamplingParams(temperature=0, max_tokens=7)
    whole = llm.generate("Tell me", p)[0].outputs[0]
    seen = list(llm.stream("Tell me", p))
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and len(seen) >= 2
    assert seen[-1].outputs[0].token_ids == whole.token_ids
    assert seen[-1].outputs[0].text == whole.text
    assert seen[-1].outputs[0].finish_reason == "length"


def test_stream_left_early_aborts_and_frees_the_engine(llm):
    stream = llm.stream("Tell me", SamplingParams(temperature=0, max_tokens=50))
    first = next(stream)
    assert not first.finished
    with pytest.raises(RuntimeError, match="stream"):
        llm.generate("x", GREEDY)
    stream.close()  # leaving the loop: the request is aborted
    assert llm.generate("x", GREEDY)[0].finished
