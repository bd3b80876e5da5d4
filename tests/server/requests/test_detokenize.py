"""TextStream (server/requests/detokenize.py): streamed text equals the tokenizer's decode of the
whole output, and each token decodes a bounded window whatever the output's length, both through
the Rust tokenizer's stream (a fast tokenizer) and through windows of the tokenizer's decode (any
other, here a wrapper that counts the windows)."""

from __future__ import annotations

import functools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from toppings.server.requests.detokenize import (
    RustChunks,
    TextStream,
    WindowChunks,
    text_chunks,
    window_decoder,
)

WORDS = ("hello", "world", "foo", "bar", "baz", "é")


class CountingTokenizer:
    """A tokenizer that records the length of every window it decodes."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral style: SentencePiece's Metaspace, whose decode drops the leading space
    of the first token it decodes (so a lone token decodes differently than in context)."""
    vocab = {"<unk>": 0, "</s>": 1}
    for word in WORDS:
        vocab["\u2581" + word] = len(vocab)
        vocab[word] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE over single bytes: 'é' takes two tokens, the first of which
    decodes alone to U+FFFD."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"</s>": 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}}
    tk = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")


def stream(tok, ids, stop=()) -> tuple[str, TextStream]:
    s = TextStream(tok, stop)
    out = []
    for token in ids:
        out.append(s.push(token))
        if s.stopped:
            break
    return "".join(out) + s.finish(), s


@pytest.mark.parametrize("make", [metaspace_tokenizer, byte_level_tokenizer])
def test_streamed_text_is_the_whole_decode_in_a_bounded_window(make):
    tok = make()
    text = " ".join(WORDS[i % len(WORDS)] for i in range(400))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = ids[:40] + [tok.eos_token_id] + ids[40:]  # a skipped special token on the way
    counting = CountingTokenizer(tok)
    got, _ = stream(counting, ids)
    assert got == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 400 and max(counting.lengths) <= 4  # not the whole output every token


@pytest.mark.parametrize("make", [metaspace_tokenizer, byte_level_tokenizer])
def test_stop_strings_cut_at_the_earliest_and_across_tokens(make):
    tok = make()
    ids = tok("hello world foo bar baz hello world", add_special_tokens=False)["input_ids"]
    got, s = stream(tok, ids, stop=("baz", "o b"))
    assert s.stopped and got == "hello world fo"
    got, s = stream(tok, ids, stop=("nowhere",))
    assert not s.stopped and got == tok.decode(ids)


def test_skipped_tokens_after_a_split_character_keep_the_window_bounded():
    tok = byte_level_tokenizer()
    first, second = tok("é", add_special_tokens=False)["input_ids"]  # U+FFFD alone, then é
    ids = [*tok("hi ", add_special_tokens=False)["input_ids"], first]
    ids += [tok.eos_token_id] * 200 + [second]  # skipped special tokens inside the character
    counting = CountingTokenizer(tok)
    got, _ = stream(counting, ids)
    assert got == tok.decode(ids, skip_special_tokens=True) == "hi é"
    assert max(counting.lengths) <= 4


def test_bytes_that_never_form_a_character_are_released():
    tok = byte_level_tokenizer()
    (lone,) = tok("é", add_special_tokens=False)["input_ids"][1:]  # a continuation byte
    ids = [*tok("ok", add_special_tokens=False)["input_ids"], *[lone] * 100]
    counting = CountingTokenizer(tok)
    s = TextStream(counting)
    streamed = "".join(s.push(token) for token in ids)
    assert streamed.startswith("ok\ufffd") and len(streamed) >= 90  # out before the request ends
    assert streamed + s.finish() == tok.decode(ids)
    assert max(counting.lengths) <= 16  # the context (at most 8 tokens) and 8 held


@pytest.mark.parametrize("make", [metaspace_tokenizer, byte_level_tokenizer])
@pytest.mark.parametrize("clean_up", [False, True])
def test_the_window_decoder_decodes_as_the_tokenizer(make, clean_up):
    """The fast path (the Rust tokenizer's own decode) gives transformers' decode wherever it is
    taken, and a tokenizer whose decode cleans up spaces afterwards (a WordLevel model: not
    skipped as BPE's is) keeps its own decode."""
    tok = make()
    tok.clean_up_tokenization_spaces = clean_up
    ids = tok("hello , world é foo 's bar", add_special_tokens=False)["input_ids"]
    ids = ids[:3] + [tok.eos_token_id] + ids[3:]
    decode = window_decoder(tok)
    for start in range(len(ids)):
        for end in range(start + 1, min(start + 5, len(ids)) + 1):
            assert decode(ids[start:end]) == tok.decode(ids[start:end], skip_special_tokens=True)
    takes_backend = isinstance(decode, functools.partial) and decode.func == tok._tokenizer.decode
    assert takes_backend == (not clean_up or make is byte_level_tokenizer)


def test_a_tokenizer_with_its_own_decode_is_called():
    counting = CountingTokenizer(byte_level_tokenizer())
    assert window_decoder(counting)([5, 6]) == counting.tok.decode([5, 6])
    assert counting.lengths == [2]


@pytest.mark.parametrize("path", ["rust", "windows"])
def test_characters_of_three_and_four_bytes_over_single_byte_tokens(path):
    """A CJK character takes three byte tokens and an emoji four: the middle ones leave the
    window's text ending in the same U+FFFD, and must be kept (they were dropped once)."""
    tok = byte_level_tokenizer()
    rng = random.Random(0)
    pieces = ["a", " b", "é", "你", "好", "🎉", "𝄞", " ", "ok"]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if rng.random() < 0.5:  # a skipped special token somewhere, maybe inside a character
            ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)
        got, _ = stream(tok if path == "rust" else CountingTokenizer(tok), ids)
        assert got == tok.decode(ids, skip_special_tokens=True) == text


def test_the_rust_stream_bounds_what_it_holds():
    """Through the Rust stream too, bytes that never form a character come out before the
    request ends, and skipped tokens inside a character neither break nor grow it."""
    tok = byte_level_tokenizer()
    (lone,) = tok("é", add_special_tokens=False)["input_ids"][1:]  # a continuation byte
    ids = [*tok("ok", add_special_tokens=False)["input_ids"], *[lone] * 100]
    s = TextStream(tok)
    streamed = "".join(s.push(token) for token in ids)
    assert streamed.startswith("ok\ufffd") and len(streamed) >= 90
    assert len(s._chunks._context) <= 8  # the window restarts bounded, release after release
    assert streamed + s.finish() == tok.decode(ids)
    first, *rest = tok("🎉", add_special_tokens=False)["input_ids"]
    ids = [first, *[tok.eos_token_id] * 50, *rest]
    got, _ = stream(tok, ids)
    assert got == "🎉"


def test_the_rust_stream_is_taken_where_decode_only_wraps_it():
    tok = byte_level_tokenizer()
    assert isinstance(text_chunks(tok), RustChunks)
    assert isinstance(text_chunks(CountingTokenizer(tok)), WindowChunks)
