"""Pick an attention backend by name.

Every backend implements `AttentionBackend` (`attention/base.py`, where the call and the
scores it computes are described); `reference` is the slow oracle the others are tested
against.
"""

from collections.abc import Callable

from pagedlm.attention.base import AttentionBackend
from pagedlm.attention.cpu_paged import CpuPagedAttention, cpu_kernels_available
from pagedlm.attention.reference import ReferenceAttention
from pagedlm.attention.torch_paged import TorchPagedAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedAttention,
    "reference": ReferenceAttention,
    # Imports without a C++ compiler: the kernels build on first use, and the constructor
    # raises ImportError where they cannot.
    "cpu": CpuPagedAttention,
}


def _load_triton() -> type[AttentionBackend]:
    # Imported here, not at the top: triton is an optional package, and every other backend
    # must load without it.
    from pagedlm.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention


# Imported on first use, so that installs without their optional package still work.
_LAZY_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {"triton": _load_triton}


def resolve_backend_name(name: str, device_type: str) -> str:
    """ "auto": the C++ kernels on CPU when they build (else "torch"); "torch" on GPUs."""
    if name != "auto":
        return name
    if device_type == "cpu":
        return "cpu" if cpu_kernels_available() else "torch"
    return "torch"


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """Return a new instance of the backend called `name` ("torch", "reference", "triton",
    "cpu")."""
    if name in _LAZY_BACKENDS:
        try:
            cls = _LAZY_BACKENDS[name]()
        except ImportError as e:
            raise ImportError(f"attention backend {name!r} needs a missing package: {e}") from e
        return cls()
    try:
        cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of "
            f"{sorted([*_BACKENDS, *_LAZY_BACKENDS])}"
        ) from None
    return cls()
