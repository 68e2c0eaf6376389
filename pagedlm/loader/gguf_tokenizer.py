"""The tokenizer of a GGUF file, rebuilt from metadata already parsed by ``GGUFCheckpoint``.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen2, ...) are
assembled directly with the ``tokenizers`` library, which is fast and lets us pick the
pre-tokenizer that matches ``tokenizer.ggml.pre`` (transformers' GGUF path has no entry for e.g.
SmolLM's split-every-digit rule). Other vocabulary kinds (sentencepiece "llama", "t5", ...) are
handed to transformers' GGUF tokenizer converter with the same parsed fields.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split regexes for byte-level BPE pre-tokenizers, keyed by the family they belong to.
# cl100k-style (Llama 3): case-insensitive contractions, letters with one leading non-letter,
# numbers in groups of up to three digits.
_CL100K_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: as above but every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (pre-tokenizer style, BPE ignore_merges)
_PRE_TOKENIZER_STYLES: dict[str, tuple[str, bool]] = {
    **dict.fromkeys(["default", "gpt2"], ("gpt2", False)),
    # StarCoder-lineage vocabularies isolate every digit, then apply the GPT-2 split.
    **dict.fromkeys(["smollm", "starcoder", "refact"], ("digits+gpt2", False)),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe"], ("cl100k", True)),
    **dict.fromkeys(["smaug-bpe", "dbrx", "falcon3"], ("cl100k", False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], ("qwen2", False)),
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used to spell byte-level vocabularies.

    Printable latin-1 bytes stand for themselves; the other 68 bytes (control chars, space, ...)
    are given the code points 256, 257, ... in byte order.
    """
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(style: str) -> pre_tokenizers.PreTokenizer:
    if style == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if style == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {"cl100k": _CL100K_SPLIT, "qwen2": _QWEN2_SPLIT}[style]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token_types(metadata: Mapping[str, Any], n: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    return [1] * n if types is None else [int(t) for t in types]


def _byte_level_backend(metadata: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types = _token_types(metadata, len(tokens))
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    style, ignore_merges = _PRE_TOKENIZER_STYLES.get(pre, ("gpt2", False))
    if pre not in _PRE_TOKENIZER_STYLES:
        logger.warning("Unknown GGUF pre-tokenizer %r; using the GPT-2 split", pre)

    alphabet = set(_byte_to_unicode().values())
    spell = _byte_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, ttype) in enumerate(zip(tokens, types)):
        # Added (control / user-defined) tokens are matched on raw text and keep their spelling;
        # ordinary tokens must be in the byte alphabet, re-spell any that a converter left raw.
        if ttype not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]

    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(style)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(token, special=ttype == _TOKEN_CONTROL, normalized=False)
        for token, ttype in zip(tokens, types)
        if ttype in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    if added:
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"GGUF vocabulary rebuilt with {backend.get_vocab_size(with_added_tokens=True)} entries, "
            f"expected {len(tokens)} (duplicate tokens?)"
        )
    return backend


def _transformers_backend(metadata: Mapping[str, Any]) -> Tokenizer:
    """Non byte-level vocabularies through transformers' GGUF converter."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    for name in ("tokens", "merges", "scores", "token_type"):
        if name in fields:
            fields[name] = list(fields[name])
    backend, _ = convert_gguf_tokenizer(str(metadata.get("general.architecture", "")), fields)
    return backend


# Gemma GGUF files carry no chat template (llama.cpp knows the format by name). This one writes
# Gemma's turn format: no system role (a system message opens the first user turn), the
# assistant is "model", content is a string or a list of {"type": "text", "text": ...} parts.
GEMMA_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{{ content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set system = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = text(messages[0]['content']) | trim -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ('user', 'assistant', 'model') -%}"
    "{{ raise_exception('Gemma chat roles are system (first message only), user and assistant') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{%- if loop.first and system -%}{{ system + '\\n\\n' }}{%- endif -%}"
    "{{ text(message['content']) | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _gemma_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges transformers' GGUF converter derives for Gemma (which lists none), in one
    pass: every split of every token into two vocabulary pieces, tokens in vocabulary order
    (Gemma's merge order; its scores do not follow it), longer left pieces first. Equal to
    ``generate_merges(vocab, {t: -i})`` without its sorts: 1.4 s instead of 2.1 s on Gemma 3's
    262k tokens, about a quarter of the tokenizer's build time."""
    merges: list[tuple[str, str]] = []
    append = merges.append
    for token in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                append((left, right))
    return merges


def _gemma_backend(metadata: Mapping[str, Any]) -> Tokenizer:
    """Gemma's sentencepiece BPE (byte fallback), as transformers' GGUF converter builds it."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import add_gguf_special_tokens
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    # Tokens made only of spaces are stored with real spaces; the tokenizer spells them "▁".
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in metadata["tokenizer.ggml.tokens"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = GemmaTokenizer(vocab=vocab, merges=_gemma_merges(vocab))
    fields = {"tokenizer_type": "llama", "tokens": tokens,
              "token_type": [int(t) for t in _token_types(metadata, len(tokens))]}
    return add_gguf_special_tokens(tokenizer, fields).backend_tokenizer


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """Build a fast tokenizer from parsed GGUF metadata (see ``GGUFCheckpoint.metadata``)."""
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError("This GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    architecture = str(metadata.get("general.architecture", ""))
    if kind == "gpt2":
        backend = _byte_level_backend(metadata)
    elif kind == "llama" and architecture in _GEMMA_ARCHITECTURES:
        backend = _gemma_backend(metadata)
    else:
        backend = _transformers_backend(metadata)

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

    # llama.cpp adds BOS for sentencepiece vocabularies unless the file says otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    kwargs: dict[str, Any] = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        # Decoding must give back exactly what was encoded; GGUF byte-level vocabularies never
        # want the legacy " ." -> "." clean-up.
        "clean_up_tokenization_spaces": False,
    }
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if context is not None:
        kwargs["model_max_length"] = int(context)
    template = metadata.get("tokenizer.chat_template")
    if template is None and architecture in _GEMMA_ARCHITECTURES:
        template = GEMMA_CHAT_TEMPLATE
    if template is not None:
        kwargs["chat_template"] = str(template)
    return _wrap_backend(backend, {k: v for k, v in kwargs.items() if v is not None})


def _wrap_backend(backend: Tokenizer, kwargs: dict[str, Any]) -> PreTrainedTokenizerFast:
    """``PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)`` without its deep copy.

    The deep copy round-trips the whole vocabulary through JSON (~0.5 s for 49k tokens). The
    backend is ours alone, so we hand it over the way transformers' own model tokenizers do:
    set ``_tokenizer`` before ``__init__`` runs. If a future transformers rejects that, fall back.
    """
    tok = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tok._tokenizer = backend
    try:
        tok.__init__(**kwargs)
    except (TypeError, ValueError, AttributeError):
        logger.debug("Pre-set backend rejected; building the tokenizer with a copy", exc_info=True)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if tok.backend_tokenizer is not backend:
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    return tok
