"""Engine configuration: frozen, validated dataclasses. No torch here.

Names follow vLLM's engine arguments where vLLM has one, so that a benchmark or a user
can switch engines without relearning the knobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

GiB = 1 << 30

DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
# The KV cache may also be stored in float8 with a per-tensor scale per layer and K/V
# (layers/attention.py); "fp8" is e4m3 (more precision), e5m2 has more range.
KV_CACHE_DTYPES = (*DTYPES, "fp8_e4m3", "fp8_e5m2")
KV_DTYPE_ALIASES = {**DTYPE_ALIASES, "fp8": "fp8_e4m3"}
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_DTYPES = ("auto", "float16", "q8")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def _check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user can set when creating an engine (`LLM(**kwargs)`, CLI flags)."""

    model: str | None = None  # HF directory, .gguf file, HF repo id; None = the embedded default
    revision: str | None = None  # of an HF repo id: a branch, tag or commit (default: main)
    tokenizer: str | None = None  # overrides the model's tokenizer (directory or .gguf)
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto = dtype; or float32 / float16 / bfloat16 / fp8 (e4m3) / fp8_e5m2
    # float16: linear weights stored in float16, multiplied in float32 (CPU: fbgemm);
    # q8 (CPU): integer matmuls, GGUF Q4_1/Q8_0 weights as stored (others rounded to Q8_0),
    # activations rounded to int8 per 32 values, as llama.cpp computes
    weight_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # Prompt tokens a step may compute while requests decode (None: CPU 64, GPU 2048; the
    # offline LLM class asks for no bound), so that no decode waits behind a whole prompt
    max_prefill_tokens_with_decodes: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; CPU default 2 GiB
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs (GPU), no C++ decoder (CPU)
    attention_backend: str = "auto"  # auto: C++ kernels on CPU if they build, else torch
    num_threads: int | None = None  # CPU intra-op threads; None = torch's default
    record_kv_usage: bool = False  # per-step allocated slots vs tokens held
    # Ranks the model is split over (its heads, MLP and vocabulary), one worker process
    # each; 1 = everything in the engine's process.
    tensor_parallel_size: int = 1
    # uni: the engine's own process (1 rank only); mp: worker processes on this machine;
    # ray: actors on the nodes of a Ray cluster; None: uni for 1 rank, else mp (as vLLM)
    distributed_executor_backend: str | None = None
    # Speculative decoding: a SpeculativeConfig, its dict or its JSON text (vLLM's keys),
    # e.g. {"method": "ngram", "num_speculative_tokens": 4}; None = off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # LoRA adapters (PEFT format) chosen per request: up to max_loras resident at once
    # (in the workers' slots, mixed in one batch), each of rank up to max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        object.__setattr__(self, "dtype", dtype)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        kv_dtype = KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", kv_dtype)
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {(*KV_CACHE_DTYPES, 'fp8')}, got "
                             f"{self.kv_cache_dtype!r}")
        weight_dtype = DTYPE_ALIASES.get(self.weight_dtype, self.weight_dtype)
        object.__setattr__(self, "weight_dtype", weight_dtype)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check_positive("block_size", self.block_size)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_model_len", self.max_model_len, allow_none=True)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _check_positive("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes,
                        allow_none=True)
        _check_positive("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _check_positive("num_threads", self.num_threads, allow_none=True)
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK}, got "
                             f"{self.max_lora_rank}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError("distributed_executor_backend='uni' runs the model in the engine's "
                             "own process: it takes tensor_parallel_size 1, got "
                             f"{self.tensor_parallel_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ValueError("tokenizer and skip_tokenizer_init=True cannot be used together")
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_LORA_RANK = 512


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode.py). Keys as vLLM names them.

    ngram (prompt lookup): the last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) are looked up earlier in the sequence; the tokens that followed
    them there are the proposal. draft_model: a smaller model with the same vocabulary
    (`model`: its directory or .gguf file) proposes greedily, with a paged KV cache of its
    own. Every proposal of a step is verified in one forward pass of the model; outputs
    are exactly those of decoding without speculation.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's checkpoint
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No proposals in a step with more decoding sequences than this: a large batch is
    # compute bound and verifying drafts costs more than it saves (None: CPU 4, GPU 32).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model (the draft's checkpoint) is required "
                             "with method 'draft_model' and only with it")
        _check_positive("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("speculative_config.prompt_lookup_min", self.prompt_lookup_min)
        _check_positive("speculative_config.prompt_lookup_max", self.prompt_lookup_max)
        _check_positive("speculative_config.disable_by_batch_size", self.disable_by_batch_size,
                        allow_none=True)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"is larger than prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Prompt tokens a step may compute while requests are decoding (None: no bound
    # beyond max_num_batched_tokens).
    max_prefill_tokens_with_decodes: int | None = None

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_model_len", self.max_model_len)
        _check_positive("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes,
                        allow_none=True)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )
