"""huge_pages.place: a copy equal to the tensor, packed into chunks the kernel may back with
2 MiB pages (advised MADV_HUGEPAGE, where Linux has it); small tensors, and everything while
`disabled`, stay where they are; a model whose GEMV weights are placed computes the same logits
as one whose are not."""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import pytest
import torch

from tests.helpers import running_engine
from tests.server.model.tiny_families import make_tiny_family
from toppings.server.model import huge_pages
from toppings.server.model.linear import Linear
from toppings.server.requests.request import GenerationRequest, SamplingParams

PRECISIONS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")]
needs_advice = pytest.mark.skipif(
    getattr(mmap, "MADV_HUGEPAGE", None) is None, reason="no MADV_HUGEPAGE here"
)


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@needs_advice
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_place_copies_into_one_chunk(dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-100, 100, (600, 512), generator=gen).to(dtype) for _ in range(3)]
    placed = [huge_pages.place(t) for t in tensors]
    for t, p in zip(tensors, placed):
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert torch.equal(p, t)
        assert p.data_ptr() != t.data_ptr() and p.data_ptr() % huge_pages.ALIGN == 0
    # one after another in the same chunk
    ends = [p.data_ptr() + p.numel() * p.element_size() for p in placed]
    assert all(0 <= placed[i + 1].data_ptr() - ends[i] < huge_pages.ALIGN for i in range(2))
    tensors[0].fill_(0)  # a copy: later writes to the original do not reach it
    assert not torch.equal(placed[0], tensors[0])


@needs_advice
def test_placed_memory_is_advised_for_huge_pages():
    """The kernel's own view of the mapping: eligible for transparent huge pages (with THP
    `never` nothing is eligible: skipped)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this host")
    placed = huge_pages.place(torch.ones(1 << 20))
    fields = _mapping_of(placed.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible")
    assert fields["THPeligible"] == "1"


def test_small_and_disabled_stay_where_they_are():
    small = torch.ones(huge_pages.MIN_BYTES // 4 - 1)
    assert huge_pages.place(small) is small
    big = torch.ones(huge_pages.MIN_BYTES)
    with huge_pages.disabled():
        assert huge_pages.place(big) is big
    assert (huge_pages.place(big) is big) == (getattr(mmap, "MADV_HUGEPAGE", None) is None)


@needs_advice
def test_linear_reads_its_placed_copy():
    weight = torch.randn(512, 256)
    linear = Linear(weight, pack=False, plain_gemv=True)
    if linear.gemv_weight is None:
        pytest.skip("no native float32 GEMV here")
    assert linear.gemv_weight.data_ptr() != weight.data_ptr()
    with huge_pages.disabled():
        unplaced = Linear(weight, pack=False, plain_gemv=True)
    assert unplaced.gemv_weight.data_ptr() == weight.data_ptr()
    x = torch.randn(2, 256)
    assert torch.equal(linear(x), unplaced(x))


@needs_advice
@pytest.mark.parametrize(("dtype", "quantization"), PRECISIONS)
def test_engine_answers_equal_placed_or_not(tmp_path, monkeypatch, dtype, quantization):
    """Every GEMV weight placed (MIN_BYTES 0) against none: the same tokens and logprobs, bit
    for bit, prompt and decode."""
    model_dir = make_tiny_family(tmp_path / "llama3", "llama3")
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)  # fmt: skip
    answers = []
    for placing in (True, False):
        with contextlib.ExitStack() as stack:
            if not placing:
                stack.enter_context(huge_pages.disabled())
            engine = stack.enter_context(
                running_engine(model_dir, dtype=dtype, quantization=quantization)
            )
            out = engine.submit(GenerationRequest([5, 17, 3, 99, 42, 7], params))
            answers.append(out.result(timeout_s=120))
    placed, plain = answers
    assert placed.new_token_ids == plain.new_token_ids
    assert placed.logprobs == plain.logprobs and placed.prompt_logprobs == plain.prompt_logprobs
