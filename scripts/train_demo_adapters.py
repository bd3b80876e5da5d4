"""Train the three demo LoRA adapters on SmolLM2-135M-Instruct, on the CPU, with PEFT.

- `caps` answers in CAPITAL LETTERS, `french` answers in French, `terse` in one short sentence.
- Data: 56 templated question/answer pairs (scripts.demo_data; `caps` upper-cases the base
  model's own greedy answers, generated here first), rendered with the model's chat template
  exactly as the server renders `/v1/chat/completions`; the loss covers the answer and its
  end-of-turn token only.
- LoRA r=8, alpha=16 on q, k, v, o; AdamW with a one-cycle schedule; float32. An adapter whose
  directory already holds `adapter_model.safetensors` is skipped.

    python -m scripts.train_demo_adapters [--out ~/.cache/toppings/demo-adapters] [--epochs 8]
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from toppings.scripts.demo_data import NAMES, STYLES, caps, examples

log = logging.getLogger("train_demo_adapters")

DEFAULT_OUT = Path("~/.cache/toppings/demo-adapters").expanduser()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ESTIMATE_MIN = 5  # minutes per adapter on a 2-core CPU, said before training starts


def is_trained(path: Path) -> bool:
    return (path / "adapter_config.json").is_file() and (
        path / "adapter_model.safetensors"
    ).is_file()


def encode(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one chat turn; labels are -100 on the prompt."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer + tokenizer.eos_token, add_special_tokens=False)
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def base_answers(model, tokenizer, questions: list[str], max_new_tokens: int = 64) -> list[str]:
    """The base model's greedy answers, in batches of 8 left-padded prompts."""
    tokenizer.padding_side = "left"
    answers = []
    for start in range(0, len(questions), 8):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            for q in questions[start : start + 8]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[:, batch["input_ids"].shape[1] :]  # [B, new tokens]
        answers.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return answers


def batches(encoded: list[tuple[list[int], list[int]]], size: int, pad_id: int, rng: random.Random):
    """Shuffled right-padded batches: (input_ids [B, S], labels [B, S], attention_mask [B, S])."""
    order = list(range(len(encoded)))
    rng.shuffle(order)
    for start in range(0, len(order), size):
        group = [encoded[i] for i in order[start : start + size]]
        width = max(len(ids) for ids, _ in group)
        ids = torch.full((len(group), width), pad_id)
        labels = torch.full((len(group), width), -100)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, (x, y) in enumerate(group):
            ids[row, : len(x)] = torch.tensor(x)
            labels[row, : len(y)] = torch.tensor(y)
            mask[row, : len(x)] = 1
        yield ids, labels, mask


def train_one(model_dir: Path, style: str, out: Path, epochs: int, lr: float, seed: int) -> float:
    """Train and save one adapter; returns the mean loss of the last epoch."""
    from peft import LoraConfig, get_peft_model  # only training needs it (the [test] extra)

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = examples()
    if style == "caps":
        answers = [caps(a) for a in base_answers(base, tokenizer, [e.question for e in data])]
    else:
        answers = [STYLES[style](e) for e in data]
    encoded = [encode(tokenizer, e.question, a) for e, a in zip(data, answers)]
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    steps_per_epoch = -(-len(encoded) // 8)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.1
    )
    model.train()
    last = float("nan")
    bar = tqdm(total=epochs * steps_per_epoch, desc=f"training {style}", unit="step")
    for epoch in range(epochs):
        losses = []
        for ids, labels, mask in batches(encoded, 8, tokenizer.pad_token_id or 0, rng):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            bar.set_postfix(epoch=f"{epoch + 1}/{epochs}", loss=f"{losses[-1]:.3f}")
            bar.update()
        last = sum(losses) / len(losses)
        log.info("%s: epoch %d/%d, loss %.3f", style, epoch + 1, epochs, last)
    bar.close()
    model.save_pretrained(out)
    return last


def train_demo_adapters(
    out_root: Path = DEFAULT_OUT, epochs: int = 8, lr: float = 2e-3, seed: int = 0
) -> dict[str, Path]:
    """Train whichever of caps, french, terse are missing under `out_root`; returns their paths."""
    from toppings.server.model.loader import resolve_model_dir

    model_dir = resolve_model_dir("smollm2")
    paths = {style: out_root / style for style in NAMES}
    missing = [s for s, p in paths.items() if not is_trained(p)]
    if missing:
        log.info(
            "training %s on the CPU: about %d minutes",
            ", ".join(missing),
            ESTIMATE_MIN * len(missing),
        )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for i, style in enumerate(missing):
        started = time.perf_counter()
        loss = train_one(model_dir, style, paths[style], epochs, lr, seed + i)
        log.info(
            "%s: saved to %s (loss %.3f, %.0f s)",
            style,
            paths[style],
            loss,
            time.perf_counter() - started,
        )
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="one folder per adapter in here")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for style, path in train_demo_adapters(args.out, args.epochs, args.lr, args.seed).items():
        print(f"{style}={path}")


if __name__ == "__main__":
    main()
