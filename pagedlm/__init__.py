"""pagedlm: a high-throughput LLM inference engine built on PagedAttention."""

from pagedlm.entrypoints.llm import LLM
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedlm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
