"""Tokenizer loading: HF model directories and GGUF files (``gguf_tokenizer`` rebuilds a GGUF
file's tokenizer from its metadata)."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedlm.loader.gguf_loader import GGUFCheckpoint

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
            return ckpt.tokenizer()
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
