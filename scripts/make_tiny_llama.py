"""Make a tiny random Llama checkpoint with an offline tokenizer, for tests and CPU experiments.

The directory looks like any Hugging Face Llama checkpoint: config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json (with a ChatML chat template).

    python -m toppings.scripts.make_tiny_llama OUT [--layers 2] [--hidden 64] [--vocab 256] \
        [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

UNK, BOS, EOS, PAD, IM_START = "<unk>", "<s>", "<|im_end|>", "<pad>", "<|im_start|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IM_START)
# Printable ASCII minus vertical tab and form feed; any other character encodes as <unk>.
ALPHABET = tuple(c for c in string.printable if c not in "\x0b\x0c")
# Multi-character tokens, so that token count != character count and a token may span a
# word boundary (what streaming detokenization must handle).
COMMON_PIECES = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le "
    "ve co me de hi ri ro ic ne ea ra ce ll lo the ing and ion ent"
).split() + [" the", " and", ", ", ". ", "\n\n", "  ", "    "]
FREQUENT = "etaoinshrdlucmfwypvbgk"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _pieces():
    """Merge candidates in priority order; enough to fill a 256-token vocabulary."""
    yield from COMMON_PIECES
    yield from (" " + c for c in string.ascii_lowercase + string.ascii_uppercase)
    yield from (c + " " for c in string.ascii_lowercase)
    yield from (a + b for a in FREQUENT for b in FREQUENT)


def make_tokenizer(max_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """A char-level BPE tokenizer, merges up to `max_size` tokens (fewer if it runs dry)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    if len(vocab) > max_size:
        raise ValueError(f"vocab_size must be at least {len(vocab)} for the tiny tokenizer")
    merges = []
    for piece in _pieces():
        if len(vocab) == max_size:
            break
        if piece in vocab:
            continue
        # Longest known prefix whose remainder is known too: BPE needs both halves as tokens.
        split = next(
            k for k in range(len(piece) - 1, 0, -1) if piece[:k] in vocab and piece[k:] in vocab
        )
        merges.append((piece[:split], piece[split:]))
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True))
    backend.decoder = decoders.Fuse()  # tokens are raw text: decoding is concatenation
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    seed: int = 0,
) -> Path:
    """Save a random float32 LlamaForCausalLM and its tokenizer to `out_dir`; returns the path.

    Weights are drawn from N(0, 0.2) so that logits have a few units of spread (greedy decoding
    is not stuck on one token) while staying finite. The tokenizer fills the model's vocab
    (up to a few hundred tokens; a larger vocab leaves ids the tokenizer decodes as "").
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size, max_position_embeddings)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log.info(
        "tiny llama (%d layers, H %d, vocab %d) saved to %s",
        num_layers,
        hidden_size,
        vocab_size,
        out,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_llama(
        args.out,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=args.tie_embeddings,
        seed=args.seed,
    )
    print(out)


if __name__ == "__main__":
    main()
