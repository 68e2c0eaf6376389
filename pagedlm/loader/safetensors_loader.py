"""Streaming weights out of HF ``*.safetensors`` checkpoints.

Only safetensors are read. Pickle checkpoints (``*.bin``, ``*.pt``, ...) can run arbitrary code
when loaded, so a directory holding nothing else is refused with instructions to convert it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def list_safetensors_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint files to read, in order.

    With ``model.safetensors.index.json`` present, exactly the shards it names (other
    ``*.safetensors`` in the directory, e.g. a ``consolidated.safetensors`` duplicate, are
    ignored); otherwise every ``*.safetensors`` file, sorted by name. A path to a single
    ``.safetensors`` file is accepted as well.
    """
    path = Path(model_dir)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"Model directory {path} does not exist")

    index = path / SAFETENSORS_INDEX
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files

    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{path} only has pickle checkpoints ({', '.join(pickles[:4])}). Pickle checkpoints are "
            "refused for safety: loading one can execute arbitrary code. Convert it once, in an "
            "environment you trust, with e.g. `AutoModelForCausalLM.from_pretrained(src)"
            ".save_pretrained(dst)` (transformers writes safetensors), then load `dst`."
        )
    raise FileNotFoundError(f"No *.safetensors files in {path}")


def count_safetensors(model_dir: str | os.PathLike[str]) -> int:
    """How many tensors the checkpoint holds (read from the files' headers only)."""
    total = 0
    for file in list_safetensors_files(model_dir):
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def iterate_safetensors(
    model_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one at a time.

    Each tensor is read (memory-mapped) only when its turn comes, and floating-point tensors are
    converted to `dtype` right then, so peak extra memory is about one tensor. Integer tensors
    (e.g. quantisation metadata) keep their dtype.
    """
    for file in list_safetensors_files(model_dir):
        with safe_open(os.fspath(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
