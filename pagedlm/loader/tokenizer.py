"""Tokenizer loading: HF model directories and GGUF files (``gguf_tokenizer`` rebuilds a GGUF
file's tokenizer from its metadata).

Its own module, apart from the weights' loaders: the tokenizer stack (tokenizers and
transformers' tokenization classes) takes about a second to import, which processes that
only build a model (tensor-parallel ranks, the engine core with --skip-tokenizer-init)
never pay.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedlm.loader.gguf_loader import GGUFCheckpoint
from pagedlm.loader.gguf_tokenizer import tokenizer_from_gguf_metadata
from pagedlm.loader.model_loader import ModelSource

# Each checkpoint's tokenizer, built once (rebuilding one from metadata takes a moment).
_GGUF_TOKENIZERS: weakref.WeakKeyDictionary[GGUFCheckpoint, PreTrainedTokenizerFast] = \
    weakref.WeakKeyDictionary()


def gguf_tokenizer(ckpt: GGUFCheckpoint) -> PreTrainedTokenizerFast:
    """The tokenizer described by a GGUF file's metadata (built once per checkpoint)."""
    tok = _GGUF_TOKENIZERS.get(ckpt)
    if tok is None:
        tok = _GGUF_TOKENIZERS[ckpt] = tokenizer_from_gguf_metadata(ckpt.metadata)
    return tok


def load_tokenizer_for(source: ModelSource, tokenizer: str | None) -> PreTrainedTokenizerFast:
    """The tokenizer of a resolved model: `tokenizer` if given, else the GGUF file's own,
    else the model directory's."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if source.gguf is not None:
        return gguf_tokenizer(source.gguf)
    return load_tokenizer(source.path)

# Any of these in a directory means AutoTokenizer has something to build from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "tekken.json",
)


def load_tokenizer(path_or_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Load the tokenizer of a local HF model directory or of a ``.gguf`` file.

    A directory is read with ``AutoTokenizer`` (never with remote code). A directory holding no
    tokenizer files but exactly one ``.gguf`` file uses that file's embedded tokenizer.
    """
    path = Path(path_or_dir)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass the model directory instead")
        with GGUFCheckpoint(path) as ckpt:
            return gguf_tokenizer(ckpt)
    if not path.is_dir():
        raise FileNotFoundError(f"Tokenizer path {path} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_tokenizer(ggufs[0])
        raise FileNotFoundError(
            f"No tokenizer files in {path}: expected one of {', '.join(TOKENIZER_FILES)}"
            + (f" (or a single .gguf file; found {len(ggufs)})" if ggufs else "")
            + "; pass --tokenizer DIR (tokenizer=...) or --skip-tokenizer-init"
        )
    tok = AutoTokenizer.from_pretrained(os.fspath(path), trust_remote_code=False)
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise TypeError(
            f"{path} produced a slow tokenizer ({type(tok).__name__}); a fast one is required"
        )
    return tok
