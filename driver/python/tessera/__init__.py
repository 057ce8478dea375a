"""Tessera: distributed LLM inference from Python, with vLLM's offline API.

    import tessera
    from tessera import LLM, SamplingParams

    tessera.init()                      # or tessera.init(address="10.0.0.1:6380")
    llm = LLM("/models/Llama-3.1-8B-Instruct", tensor_parallel_size=2)
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8)):
        print(out.outputs[0].text)

Every call goes through Tessera's C++ driver (the same engine, planner and actors as the
`tessera` command line); this package only shapes its results as vLLM's classes.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _tessera

__version__: str = _tessera.__version__

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
    "Tokenizer",
    "init",
    "shutdown",
    "is_initialized",
    "nodes",
    "cluster_resources",
]


def _binary() -> str:
    """The `tessera` executable local nodes and `python3 -m tessera` run: $TESSERA_BINARY, else
    the one the module was built beside, else (an installed package, whose build tree is gone)
    the `tessera` on PATH."""
    explicit = os.environ.get("TESSERA_BINARY")
    if explicit:
        return explicit
    if os.access(_tessera.default_binary, os.X_OK):
        return _tessera.default_binary
    return shutil.which("tessera") or _tessera.default_binary


# ---- the cluster (Ray's init / nodes / cluster_resources / shutdown)


class _Cluster:
    def __init__(self, address: str, token: str, node: Optional[Any]):
        self.address = address
        self.token = token
        self.node = node  # a local node this process started, or None (joined a cluster)


_cluster: Optional[_Cluster] = None
_open_llms: "weakref.WeakSet[LLM]" = weakref.WeakSet()


def init(
    address: Optional[str] = None,
    cluster_token_file: Optional[str] = None,
    *,
    ignore_reinit_error: bool = False,
) -> Dict[str, Any]:
    """Connects this process to a Tessera cluster, as ray.init() does.

    address: a head's HOST:PORT (`tessera start --head` prints it). None: $TESSERA_ADDRESS when
    set, else a local node is started for this process (it stops with tessera.shutdown() or
    at exit). cluster_token_file: the cluster token when joining (default:
    $TESSERA_CLUSTER_TOKEN, else the token of the head started on this machine).

    LLM objects made after init() place their actors on this cluster; without init() each
    LLM starts a local node of its own.
    """
    global _cluster
    if _cluster is not None:
        if ignore_reinit_error:
            return _cluster_info()
        raise RuntimeError(
            "tessera.init() was already called; call tessera.shutdown() first "
            "(or pass ignore_reinit_error=True)"
        )
    if address is None:
        address = os.environ.get("TESSERA_ADDRESS") or None
    if address is None or address == "local":
        node = _tessera._Node(_binary())
        _cluster = _Cluster(node.address, node.token, node)
    else:
        token = _tessera.resolve_token(cluster_token_file or "")
        _tessera.cluster_status(address, token)  # the head answers and accepts the token
        _cluster = _Cluster(address, token, None)
    return _cluster_info()


def _cluster_info() -> Dict[str, Any]:
    assert _cluster is not None
    return {"address": _cluster.address, "local_node": _cluster.node is not None}


def is_initialized() -> bool:
    """Whether tessera.init() connected this process (ray.is_initialized())."""
    return _cluster is not None


def shutdown() -> None:
    """Closes every open LLM (their actors stop) and the local node init() started."""
    global _cluster
    for llm in list(_open_llms):
        llm.close()
    if _cluster is not None and _cluster.node is not None:
        _cluster.node.stop()
    _cluster = None


atexit.register(shutdown)


def _status() -> Dict[str, Any]:
    if _cluster is None:
        raise RuntimeError("not connected to a cluster: call tessera.init() first")
    return json.loads(_tessera.cluster_status(_cluster.address, _cluster.token))


def nodes() -> List[Dict[str, Any]]:
    """The cluster's nodes as ray.nodes() lists them (NodeID, Alive, NodeManagerAddress,
    NodeManagerHostname, Resources), plus Tessera's GPUs and actors and whether the node is
    Draining (`tessera drain`: no new actors go there)."""
    out = []
    for n in _status()["nodes"]:
        host = n["address"].rsplit(":", 1)[0]
        out.append(
            {
                "NodeID": n["node_id"],
                "Alive": n["alive"],
                "NodeManagerAddress": host,
                "NodeManagerHostname": n["name"],
                "NodeName": n["name"],
                "IsHead": n["is_head"],
                "Address": n["address"],
                "Resources": _resources(n) if n["alive"] else {},
                "GPUs": n["gpus"],
                "Actors": n["actors"],
                "DeathReason": n["death_reason"],
                "Draining": bool(n.get("draining", False)),
            }
        )
    return out


def _resources(n: Dict[str, Any]) -> Dict[str, float]:
    r = {
        "CPU": float(n["cpus"]),
        "memory": float(n["memory_total"]),
        "node:" + n["address"].rsplit(":", 1)[0]: 1.0,
    }
    if n["gpus"]:
        r["GPU"] = float(len(n["gpus"]))
    return r


def cluster_resources() -> Dict[str, float]:
    """The live nodes' resources summed, as ray.cluster_resources() gives them."""
    total: Dict[str, float] = {}
    for n in nodes():
        for k, v in n["Resources"].items():
            total[k] = total.get(k, 0.0) + v
    return total


# ---- vLLM's classes


class SamplingParams(_tessera._SamplingParams):
    """vLLM's SamplingParams: how each request samples and when it stops.

    n (1): completions per prompt (seeds stepped per copy when seed is set); temperature (1.0;
    0 = greedy); top_p (1.0 = off); top_k (-1 = off); min_p (0 = off); seed (None: random, or
    the LLM's seed); repetition_penalty (1.0 = off); presence_penalty and frequency_penalty
    (0, in [-2, 2]); logprobs (None, or how many top alternatives, up to 20); max_tokens (16);
    ignore_eos (False); stop_token_ids ([]); stop (None, a string or a list of strings: the
    text ends before them); skip_special_tokens (True).

    Keyword arguments only; every value is checked once, in C++, and a bad one raises
    ValueError naming the field.
    """

    def __repr__(self) -> str:
        fields = (
            "n temperature top_p top_k min_p seed repetition_penalty presence_penalty "
            "frequency_penalty logprobs max_tokens ignore_eos stop_token_ids stop "
            "skip_special_tokens"
        ).split()
        return "SamplingParams(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in fields) + ")"


@dataclass
class Logprob:
    """One token's log probability (vLLM's Logprob): rank 1 is the most likely."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None  # "stop" | "length" | None while running
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times in seconds since the epoch (time.time())."""

    arrival_time: float
    first_token_time: Optional[float]
    last_token_time: float
    finished_time: Optional[float]
    time_in_queue: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    prompt_logprobs: None = None


class Tokenizer:
    """The model's tokenizer and chat template (Tessera's C++ ones, as the server uses them)."""

    def __init__(self, engine: Any, info: Dict[str, Any]):
        self._engine = engine
        self.vocab_size: int = info["tokenizer_vocab_size"]
        self.bos_token_id: Optional[int] = info["bos_token_id"]
        eos = info["eos_token_ids"]
        self.eos_token_id: Optional[int] = eos[0] if eos else None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self._engine.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._engine.decode(list(token_ids), skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: List[Dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> Union[str, List[int]]:
        """As transformers' apply_chat_template: the prompt text, or its ids (tokenize=True,
        the default, encoded without adding special tokens: the template writes them)."""
        text = _render(self._engine, conversation, add_generation_prompt, tools, chat_template,
                       kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _render(engine, conversation, add_generation_prompt, tools, chat_template, variables):
    extra = dict(variables or {})
    if tools is not None:
        extra["tools"] = tools
    try:
        messages = json.dumps(conversation, ensure_ascii=False)
        extra_json = json.dumps(extra, ensure_ascii=False)
    except TypeError as e:
        raise TypeError(f"messages and tools must be JSON values: {e}") from None
    return engine.render_chat(messages, add_generation_prompt, extra_json, chat_template or "")


PromptType = Union[str, Dict[str, Any], List[int]]


class LLM:
    """vLLM's LLM: a model placed on the cluster's GPUs (or CPUs), generating offline.

    LLM(model, tensor_parallel_size=1, pipeline_parallel_size=None, dtype="auto",
        quantization=None, max_model_len=None, gpu_memory_utilization=0.9,
        kv_cache_dtype="auto", enforce_eager=False, seed=0, **engine_options)

    model: a Hugging Face model directory. seed: requests whose SamplingParams have no seed get
    one derived from it and their order (None: random). Every other keyword is a flag of
    `tessera generate` / `tessera serve` under its vLLM name (--max-num-seqs: max_num_seqs);
    the list is below. A bad value raises ValueError naming the keyword; an unknown keyword
    TypeError. The LLM holds its actors until close() (or `with LLM(...) as llm:`, or
    tessera.shutdown(), or exit).
    """

    def __init__(
        self,
        model: str,
        tensor_parallel_size: Union[int, str] = 1,
        pipeline_parallel_size: Union[int, str, None] = None,
        dtype: str = "auto",
        quantization: Optional[str] = None,
        max_model_len: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        seed: Optional[int] = 0,
        **engine_options: Any,
    ):
        if not isinstance(model, str):
            raise TypeError(f"model: expected a model directory (str), got {type(model).__name__}")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        options = dict(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=enforce_eager,
        )
        options.update(engine_options)
        address, token = ("", "") if _cluster is None else (_cluster.address, _cluster.token)
        self._engine = _tessera._Engine(model, options, address, token, _binary())
        self._info: Dict[str, Any] = self._engine.info()
        self._seed = seed
        self._requests = 0
        self._tokenizer = Tokenizer(self._engine, self._info)
        _open_llms.add(self)

    # ---- life

    def close(self) -> None:
        """Stops this LLM's actors (and the local node it started). Idempotent."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
            _open_llms.discard(self)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the module may be gone already
            pass

    # ---- what it runs

    @property
    def model_info(self) -> Dict[str, Any]:
        """The model as its actors loaded it: architecture, dtype, backend, max_model_len, the
        plan (tensor x pipeline parallel sizes and placement) and the load time."""
        return dict(self._info)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer: encode / decode / apply_chat_template, as the engine uses it."""
        return self._tokenizer

    # ---- generation

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        *,
        prompt_token_ids: Optional[List[List[int]]] = None,
    ) -> List[RequestOutput]:
        """One RequestOutput per prompt, in order.

        prompts: a string, a list of strings, {"prompt": str} or {"prompt_token_ids": [...]}
        dicts (vLLM's TextPrompt / TokensPrompt), a list of token ids, or a list of those.
        sampling_params: one for all, or one per prompt (default: SamplingParams()).
        Ctrl-C aborts the running requests and raises KeyboardInterrupt.
        """
        items = _prompts(self._engine, prompts, prompt_token_ids)
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> List[RequestOutput]:
        """Generates replies to conversations ({"role", "content"} dicts, or a list of such
        lists), each rendered by the model's chat template (or chat_template: a file or the
        template) with tools and chat_template_kwargs as its variables, as the server does."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        items = []
        for conv in conversations:
            text = _render(self._engine, conv, add_generation_prompt, tools, chat_template,
                           chat_template_kwargs)
            items.append((text, self._engine.encode(text, False)))
        return self._run(items, sampling_params, use_tqdm)

    def stream(
        self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None
    ) -> Iterator[RequestOutput]:
        """Generates one prompt, yielding a RequestOutput (cumulative text and tokens) each time
        new tokens come; the last has finished=True. Leaving the loop early aborts the request.
        No other call may use this LLM until the stream ends."""
        (text, ids), = _prompts(self._engine, prompt, None)
        params = self._seeded([sampling_params or SamplingParams()])[0]
        stream = self._engine.stream(ids, params)
        request_id = str(self._next_id())
        text_so_far, tokens, logprobs = "", [], []
        try:
            while True:
                o = stream.next()
                if o is None:
                    return
                text_so_far += o["delta"]
                tokens.extend(o["new_token_ids"])
                logprobs.extend(o["new_logprobs"])
                c = CompletionOutput(0, text_so_far, list(tokens), None, None)
                if params.logprobs is not None:
                    c.logprobs, c.cumulative_logprob = _logprobs(self._engine, logprobs)
                if o["finished"]:
                    c.finish_reason = o["finish_reason"]
                    c.stop_reason = o["stop_reason"]
                # A new object each time, as vLLM's streams give (cumulative outputs).
                yield RequestOutput(request_id, text, ids, [c], o["finished"],
                                    num_cached_tokens=o["num_cached_tokens"])
                if o["finished"]:
                    return
        finally:
            stream.close()

    # ---- internals

    def _next_id(self) -> int:
        self._requests += 1
        return self._requests - 1

    def _seeded(self, params: List[SamplingParams]) -> List[SamplingParams]:
        """Requests without a seed get one from the LLM's seed and their order (vLLM's seed)."""
        if self._seed is None:
            return params
        out = []
        for p in params:
            if p.seed is None:
                seed = (self._seed * 0x9E3779B97F4A7C15 + self._requests + len(out)) % (1 << 63)
                p = _with(p, seed=seed)
            out.append(p)
        return out

    def _run(self, items, sampling_params, use_tqdm) -> List[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, _tessera._SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(
                    f"sampling_params: {len(params)} given for {len(items)} prompts "
                    "(give one, or one per prompt)"
                )
        params = self._seeded(params)
        total = sum(p.n for p in params)
        bar = _Progress(total) if use_tqdm and total > 0 else None
        try:
            flat = self._engine.generate([ids for _, ids in items], params,
                                         bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        outputs, at = [], 0
        for (text, _), p in zip(items, params):
            results = flat[at:at + p.n]
            at += p.n
            outputs.append(self._request_output(text, results, p))
        return outputs

    def _request_output(self, text, results, params) -> RequestOutput:
        completions = []
        for i, r in enumerate(results):
            logprobs, cumulative = (None, None)
            if params.logprobs is not None:
                logprobs, cumulative = _logprobs(self._engine, r["logprobs"])
            completions.append(
                CompletionOutput(i, r["text"], r["token_ids"], cumulative, logprobs,
                                 r["finish_reason"] or None, r["stop_reason"])
            )
        first = results[0]
        last = max(r["finished_time"] for r in results)
        metrics = RequestMetrics(
            arrival_time=first["arrival_time"],
            first_token_time=min((r["first_token_time"] for r in results
                                  if r["first_token_time"] is not None), default=None),
            last_token_time=last,
            finished_time=last,
        )
        return RequestOutput(str(self._next_id()), text, first["prompt_token_ids"], completions,
                             True, metrics, first["num_cached_tokens"])


def _with(p: SamplingParams, **changes: Any) -> SamplingParams:
    fields = dict(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        seed=p.seed, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        logprobs=p.logprobs, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids, stop=p.stop,
        skip_special_tokens=p.skip_special_tokens,
    )
    fields.update(changes)
    return SamplingParams(**fields)


def _logprobs(engine, entries):
    """vLLM's shape: per token, {token_id: Logprob} of the top alternatives and the sampled
    token, and the sum of the sampled tokens' logprobs."""
    out, total = [], 0.0
    for token, logprob, top in entries:
        d = {}
        for rank, (t, lp) in enumerate(top, start=1):
            d[t] = Logprob(lp, rank, engine.decode([t], False))
        if token not in d:
            d[token] = Logprob(logprob, None, engine.decode([token], False))
        out.append(d)
        total += logprob
    return out, total


def _prompts(engine, prompts, prompt_token_ids):
    """[(prompt text or None, token ids)] from generate()'s prompt forms."""
    if prompts is None:
        if prompt_token_ids is None:
            raise TypeError("generate() needs prompts (or prompt_token_ids)")
        return [(None, list(ids)) for ids in prompt_token_ids]
    if prompt_token_ids is not None:
        raise TypeError("give prompts or prompt_token_ids, not both")
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    items = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            items.append((p, engine.encode(p, True)))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            items.append((p.get("prompt"), list(p["prompt_token_ids"])))
        elif isinstance(p, dict) and "prompt" in p:
            items.append((p["prompt"], engine.encode(p["prompt"], True)))
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            items.append((None, list(p)))
        else:
            raise TypeError(
                f"prompt {i}: expected a string, a list of token ids, or a dict with 'prompt' "
                f"or 'prompt_token_ids', got {type(p).__name__}"
            )
    return items


class _Progress:
    """tqdm when it is installed; else one line on stderr, redrawn on a terminal."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm  # type: ignore

            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        except ImportError:
            self.bar = None
            self.tty = sys.stderr.isatty()

    def update(self, _index: int) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.tty:
            sys.stderr.write(f"\rProcessed prompts: {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")
        else:
            sys.stderr.write(f"Processed prompts: {self.done}/{self.total}\n")


def _engine_keyword_doc() -> str:
    lines = ["", "Engine keywords (the CLI's flags):"]
    for keyword, flag, help_text, is_flag in _tessera.engine_keywords():
        kind = " (bool)" if is_flag else ""
        lines.append(f"    {keyword}{kind}: {help_text}  [{flag}]")
    return "\n".join(lines)


LLM.__doc__ = (LLM.__doc__ or "") + _engine_keyword_doc()
