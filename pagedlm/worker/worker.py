"""One worker: a device, a model (or, with tensor parallelism, its shard), its KV cache and a
model runner. Everything that touches weights or the cache lives here, so that an executor
can run one in the engine's process or one per rank elsewhere.

    Worker(args, source)          device, dtype, model built and weights loaded,
                                  linear weights put in their CPU format
    .worker_spec()              what one KV block costs, the window, the layer geometry
    .determine_num_blocks(...)    how many blocks fit (CUDA: profiled; CPU: the budget)
    .initialize_cache(...)        allocate the cache, then the C++ decoder / CUDA graphs
    .execute_model(sched)         one step: SchedulerOutput -> ModelRunnerOutput
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedlm.attention.backends import get_attention_backend, resolve_backend_name
from pagedlm.config import EngineArgs, GiB
from pagedlm.core.sched_output import NewRequestData, SchedulerOutput
from pagedlm.csrc import prepare_cpu_kernels
from pagedlm.layers.parallel_state import all_gather_last_dim
from pagedlm.layers.weight_format import apply_weight_format
from pagedlm.loader.model_loader import ModelSource, build_model
from pagedlm.lora.adapter import LoRAAdapter
from pagedlm.models.llama_cpu_decode import MAX_STEP_TOKENS
from pagedlm.sampling_params import SamplingParams
from pagedlm.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_cuda
from pagedlm.worker.lora_model import LoRAModel
from pagedlm.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * GiB
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tokens of the prompt that calibrates a float8 KV cache's scales.
FP8_CALIBRATION_TOKENS = 256
_KV_TORCH_DTYPES = {**_TORCH_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _TORCH_DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if config_dtype in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16


def model_max_len(hf_config) -> int:
    return getattr(hf_config, "max_position_embeddings", None) or 2048


@dataclass(frozen=True)
class WorkerSpec:
    """What the engine needs to know of a worker: the cache it will allocate (for the
    block pool and scheduler) and, for the log and the API, where and how it computes."""

    block_size: int
    block_bytes: int  # one block of every layer, K and V (this rank's heads)
    sliding_window: int | None  # the window every layer shares, or None
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    attention_backend: str


def _uniform_sliding_window(attn_layers) -> int | None:
    """The window shared by every attention layer, or None (full attention anywhere, or
    windows that differ: the cache then keeps every block and layers only mask)."""
    windows = {a.sliding_window for a in attn_layers}
    return windows.pop() if len(windows) == 1 else None


class Worker:
    """`rank` of `args.tensor_parallel_size` ranks; the tensor-parallel group (layers/
    parallel_state.py) and torch.distributed are set up by the executor before."""

    def __init__(self, args: EngineArgs, source: ModelSource, rank: int = 0,
                 device_index: int | None = None) -> None:
        self.args = args
        self.rank = rank
        self.world_size = args.tensor_parallel_size
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and self.world_size > 1:
            # One GPU per rank: the rank's own on one machine, the one Ray gave it on many.
            self.device = torch.device("cuda", rank if device_index is None else device_index)
        if self.device.type == "cpu":
            prepare_cpu_kernels()  # all at once, announced, before the engine is ready
        self.dtype = resolve_dtype(args.dtype, source.hf_config, self.device)
        # The KV cache may be stored narrower than the model computes (llama.cpp's default
        # is a float16 cache): half the memory and half the bytes each decode reads.
        self.kv_cache_dtype = (self.dtype if args.kv_cache_dtype == "auto"
                               else _KV_TORCH_DTYPES[args.kv_cache_dtype])
        if args.weight_dtype != "auto" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"weight_dtype={args.weight_dtype!r} is for float32 models on CPU; "
                             "on GPUs set dtype='float16' instead")
        self.attention_backend = resolve_backend_name(args.attention_backend, self.device.type)
        backend = get_attention_backend(self.attention_backend)
        self.supports_cuda_graphs = getattr(backend, "supports_cuda_graphs", False)
        # The model sees the context it will serve (Phi-3's longrope picks its factors by it).
        max_len = args.max_model_len or model_max_len(source.hf_config)
        self.model = build_model(source, backend, max_len, self.dtype, self.device,
                                 args.load_format, args.seed)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            for line in apply_weight_format(self.model, args.weight_dtype):
                logger.info(line)
        # The cache geometry comes from the model's own attention layers: config names for
        # KV heads differ between architectures (Falcon's multi_query, GPT-2's n_head, ...).
        attn_layers = self.model.attention_layers()
        self.num_layers = len(attn_layers)
        self.num_kv_heads = attn_layers[0].num_kv_heads
        self.head_dim = attn_layers[0].head_dim
        assert all((a.num_kv_heads, a.head_dim) == (self.num_kv_heads, self.head_dim)
                   for a in attn_layers)
        # Likewise the window: with one window W on every layer, blocks W tokens behind a
        # request are freed as it advances (Mistral; Gemma's local/global mix only masks).
        self.sliding_window = _uniform_sliding_window(attn_layers)
        self.model_runner = ModelRunner(self.model, self.device, args.block_size,
                                        source.hf_config.vocab_size, is_driver=rank == 0)
        if args.enable_lora:  # before the KV cache is sized: the slots take memory too
            self.model_runner.lora = LoRAModel(self.model, args.max_loras, args.max_lora_rank,
                                               self.dtype, self.device)
            logger.info("LoRA: %d slots of rank %d on %d layers, %.1f MiB", args.max_loras,
                        args.max_lora_rank, len(self.model_runner.lora.layers),
                        self.model_runner.lora.num_bytes / 2**20)
        self.cuda_graphs = False

    def worker_spec(self) -> WorkerSpec:
        return WorkerSpec(
            block_size=self.args.block_size,
            block_bytes=bytes_per_block(self.num_layers, self.args.block_size, self.num_kv_heads,
                                        self.head_dim, self.kv_cache_dtype),
            sliding_window=self.sliding_window,
            device=self.device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            attention_backend=self.attention_backend,
        )

    def determine_num_blocks(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """KV blocks this worker can hold: on CUDA what is left of gpu_memory_utilization
        of its GPU after weights and a profiled forward pass at the largest step; otherwise
        its share of the kv_cache_memory budget (CPU default 2 GiB), which counts the whole
        cache: N ranks each hold 1/N of it (their heads' part of every block)."""
        block_bytes = self.worker_spec().block_bytes
        if self.device.type == "cuda" and self.args.kv_cache_memory is None:
            return self._profile_cuda_blocks(block_bytes, max_num_batched_tokens, max_model_len)
        budget = self.args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        return budget // self.world_size // block_bytes

    def _profile_cuda_blocks(self, block_bytes: int, max_batched: int, max_model_len: int) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_profile_step(max_batched, max_model_len)
        torch.cuda.synchronize(self.device)
        # The peak counts the weights too: they stay, next to the cache (subtracting them
        # from it once let the cache take the weights' room: out of memory on an H200).
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return num_blocks_for_cuda(peak, block_bytes, self.args.gpu_memory_utilization,
                                   self.device)

    def run_profile_step(self, max_batched: int, max_model_len: int) -> None:
        """One forward pass at the largest step the engine schedules: max_batched tokens
        in prompts of at most max_model_len tokens, on a cache just big enough, which is
        dropped again (what it leaves allocated is the activations' peak)."""
        per_req = min(max_batched, max_model_len)
        num_reqs = -(-max_batched // per_req)
        self._run_prompts([[0] * per_req] * num_reqs)

    def _run_prompts(self, prompts: list[list[int]]) -> None:
        """Prefill `prompts` in one step on a cache of their own, then forget them."""
        block_size = self.args.block_size
        blocks_per_req = -(-max(len(p) for p in prompts) // block_size)
        caches = allocate_kv_cache(self.num_layers, len(prompts) * blocks_per_req, block_size,
                                   self.num_kv_heads, self.head_dim, self.kv_cache_dtype,
                                   self.device)
        runner = self.model_runner
        runner.bind_kv_cache(caches)
        sched = SchedulerOutput()
        for i, prompt in enumerate(prompts):
            req_id = f"profile-{i}"
            sched.new_reqs.append(NewRequestData(
                req_id, list(prompt), [], SamplingParams(max_tokens=1), 0, (),
                list(range(i * blocks_per_req, (i + 1) * blocks_per_req)), 0))
            sched.num_scheduled_tokens[req_id] = len(prompt)
        sched.total_num_scheduled_tokens = sum(len(p) for p in prompts)
        runner.execute_model(sched)
        for req_id in list(sched.num_scheduled_tokens):
            runner.input_batch.remove(req_id)
        del caches, sched
        runner.kv_caches = []

    def calibrate_fp8_scales(self, max_model_len: int) -> list[tuple[float, float]]:
        """A float8 cache's per-layer K and V scales, from the largest |K| and |V| of one
        prefill of a fixed pseudo-random prompt (the same on every run and rank). Returns
        each layer's (k_scale, v_scale)."""
        layers = self.model.attention_layers()
        for layer in layers:
            layer.kv_amax = [0.0, 0.0]
        vocab = int(self.model_runner.vocab_size)
        n = min(FP8_CALIBRATION_TOKENS, max_model_len)
        ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        self._run_prompts([ids])
        # Every rank takes the largest |K| and |V| of all heads, so N ranks quantise
        # exactly as one process does.
        amax = torch.tensor([a for layer in layers for a in layer.kv_amax],
                            dtype=torch.float32, device=self.device)  # [num_layers * 2]
        if self.world_size > 1:
            amax = all_gather_last_dim(amax).view(self.world_size, -1).amax(0)
        for layer, pair in zip(layers, amax.view(-1, 2).tolist()):
            layer.kv_amax = pair
            layer.calibrate_fp8_scales()
        return [(layer.k_scale, layer.v_scale) for layer in layers]

    def initialize_cache(self, num_blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        runner = self.model_runner
        if self.kv_cache_dtype.itemsize == 1:  # float8: scales first (graphs capture them)
            scales = self.calibrate_fp8_scales(max_model_len)
            logger.info("%s KV cache: K scales %.3g..%.3g, V scales %.3g..%.3g", self.kv_cache_dtype,
                        min(k for k, _ in scales), max(k for k, _ in scales),
                        min(v for _, v in scales), max(v for _, v in scales))
        runner.bind_kv_cache(allocate_kv_cache(
            self.num_layers, num_blocks, self.args.block_size, self.num_kv_heads, self.head_dim,
            self.kv_cache_dtype, self.device))
        # Decode steps and short mixed ones on CPU run every decoder layer in one C++ call
        # where the model qualifies (models/llama_cpu_decode.py): the CPU's counterpart of
        # CUDA graphs, and like them turned off by enforce_eager.
        if self.device.type == "cpu" and not self.args.enforce_eager:
            logger.info("C++ decoder for steps of up to %d tokens: %s", MAX_STEP_TOKENS,
                        runner.enable_cpu_decoder())
        # Decode steps replay CUDA graphs unless told not to, or the backend plans from
        # per-step host values a graph would freeze (the torch backend's length buckets).
        self.cuda_graphs = (self.device.type == "cuda" and not self.args.enforce_eager
                            and self.supports_cuda_graphs)
        if self.cuda_graphs:
            runner.enable_decode_graphs(max_num_seqs, max_model_len, capture=True)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def check_lora(self, adapter: LoRAAdapter) -> str | None:
        """What makes `adapter` unusable on this rank's model (None: nothing); no slot
        changes."""
        if self.model_runner.lora is None:
            return "LoRA is not enabled (enable_lora=True, --enable-lora)"
        try:
            self.model_runner.lora.plan(adapter)
        except ValueError as e:
            return str(e)
        return None

    def fast_paths(self) -> dict[str, bool]:
        """Which fast paths this rank's decode steps take (after initialize_cache)."""
        return {"cpu_decoder": self.model_runner.cpu_decoder is not None,
                "cuda_graphs": self.cuda_graphs}
