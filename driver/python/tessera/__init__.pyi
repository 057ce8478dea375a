# Type stubs of the `tessera` package (driver/python/tessera/__init__.py). The engine keywords
# after `seed` are the CLI's engine flags (tests/python/test_stubs.py checks that they match).
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

__version__: str

def init(
    address: Optional[str] = ...,
    cluster_token_file: Optional[str] = ...,
    *,
    ignore_reinit_error: bool = ...,
) -> Dict[str, Any]: ...
def is_initialized() -> bool: ...
def shutdown() -> None: ...
def nodes() -> List[Dict[str, Any]]: ...
def cluster_resources() -> Dict[str, float]: ...

class SamplingParams:
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: Optional[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: Optional[int]
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: List[int]
    stop: List[str]
    skip_special_tokens: bool
    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: Optional[int] = None,
        max_tokens: int = 16,
        ignore_eos: bool = False,
        stop_token_ids: List[int] = ...,
        stop: Union[str, List[str], None] = None,
        skip_special_tokens: bool = True,
    ) -> None: ...

@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = ...
    decoded_token: Optional[str] = ...

@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = ...
    stop_reason: Union[int, str, None] = ...
    def finished(self) -> bool: ...

@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float]
    last_token_time: float
    finished_time: Optional[float]
    time_in_queue: Optional[float] = ...

@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = ...
    num_cached_tokens: int = ...
    prompt_logprobs: None = ...

class Tokenizer:
    vocab_size: int
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    def __len__(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self,
        conversation: List[Dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> Union[str, List[int]]: ...

PromptType = Union[str, Dict[str, Any], List[int]]

class LLM:
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
        *,
        pipeline_layer_partition: Optional[Sequence[int]] = ...,
        enable_expert_parallel: bool = ...,
        device: str = ...,
        load_format: str = ...,
        max_num_seqs: int = ...,
        max_num_batched_tokens: int = ...,
        block_size: int = ...,
        num_gpu_blocks_override: int = ...,
        trust_remote_code: bool = ...,
        collectives: str = ...,
        disable_custom_all_reduce: bool = ...,
        enable_prefix_caching: bool = ...,
        async_scheduling: bool = ...,
        nccl_init_timeout: int = ...,
    ) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "LLM": ...
    def __exit__(self, *exc: Any) -> None: ...
    @property
    def model_info(self) -> Dict[str, Any]: ...
    def get_tokenizer(self) -> Tokenizer: ...
    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        *,
        prompt_token_ids: Optional[List[List[int]]] = None,
    ) -> List[RequestOutput]: ...
    def chat(
        self,
        messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> List[RequestOutput]: ...
    def stream(
        self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None
    ) -> Iterator[RequestOutput]: ...
