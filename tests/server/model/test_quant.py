"""Weight-only int8 / int4 projections (server/model/quant.py) and GGUF Q4_0 / Q4_1 blocks taken
as int4 (server/model/gguf_blocks.py): the quantizers' definitions, the packed torch kernels
against F.linear on the dequantized weight, the GGUF blocks against gguf's own dequantizer and
transformers' conversion, and the flag's refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from toppings.server.config import EngineConfig, Quantization
from toppings.server.model.quant import (
    INT4_GROUP,
    QuantizationError,
    QuantizedLinear,
    concat,
    quantize,
    quantize_int4,
    quantize_int8,
)

# Per activation dtype: the kernels' product against F.linear on the dequantized weight (the
# same products, summed in another order; bfloat16 rounds the output once).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_int8_is_symmetric_per_output_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * torch.linspace(0.1, 3, 48)[:, None]
    w[5] = 0  # an all-zero row stays zero
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scales.shape == (48,)
    assert torch.equal(q.q.abs().amax(dim=1)[[0, 1, 47]], torch.tensor([127, 127, 127]))
    assert torch.equal(q.dequantize()[5], torch.zeros(64))
    err = (q.dequantize() - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-7).all()  # round to nearest
    assert torch.allclose(q.scales, w.abs().amax(dim=1) / 127) or q.scales[5] == 1


def test_int4_groups_of_32_min_max():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 96, generator=gen)
    w[3, :32] = 0.25  # a constant group is exact
    q = quantize_int4(w)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15
    assert q.scales.shape == q.zeros.shape == (32, 96 // INT4_GROUP)
    deq = q.dequantize()
    groups, deq_groups = w.view(32, 3, 32), deq.view(32, 3, 32)
    # each group's minimum and maximum are represented exactly (up to float rounding)
    assert torch.allclose(deq_groups.amin(-1), groups.amin(-1), atol=1e-6)
    assert torch.allclose(deq_groups.amax(-1), groups.amax(-1), atol=1e-6)
    assert ((deq - w).abs().view(32, 3, 32) <= q.scales[..., None] / 2 + 1e-6).all()
    assert torch.equal(deq[3, :32], torch.full((32,), 0.25))


@pytest.mark.parametrize("scheme", [Quantization.INT8, Quantization.INT4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 33])
@pytest.mark.parametrize("path", ["kernel", "dequantized", "chosen"])
def test_quantized_linear_equals_f_linear_on_the_dequantized_weight(scheme, dtype, rows, path):
    """Each path (torch's packed kernel, the dequantized product, and the one chosen for the
    rows: the native int8 GEMV where it runs) gives F.linear's product on the dequantized
    weight."""
    gen = torch.Generator().manual_seed(2)
    w, bias = torch.randn(80, 576, generator=gen), torch.randn(80, generator=gen)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    q = quantize(w, scheme)
    linear = QuantizedLinear(q, dtype, bias.to(dtype))
    if path != "chosen":
        linear.gemv_rows = 0
        linear.max_kernel_rows = rows if path == "kernel" else 0
    got = linear(x)
    want = F.linear(x.float(), q.dequantize(dtype), bias.to(dtype).float())
    assert got.dtype == dtype and got.shape == (rows, 80)
    assert torch.allclose(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    # and it is not the float weight's product
    assert not torch.allclose(want, F.linear(x.float(), w, bias), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("scheme", [Quantization.INT8, Quantization.INT4])
def test_concat_stacks_output_channels(scheme):
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, 64, generator=gen) for n in (64, 32, 32)]
    stacked = concat([quantize(p, scheme) for p in parts])
    assert torch.equal(
        stacked.dequantize(), torch.cat([quantize(p, scheme).dequantize() for p in parts])
    )


def test_int4_refuses_a_shape_in_one_line():
    with pytest.raises(QuantizationError, match=r"groups of 32; \[48, 40\] has 40"):
        quantize_int4(torch.randn(48, 40))


@pytest.mark.parametrize("scheme", [Quantization.INT8, Quantization.INT4])
def test_prefill_rows_dequantize_in_slices(scheme, monkeypatch):
    """Past kernel_max_rows the weight is dequantized DEQUANT_ROWS channels at a time (here 64,
    over 200 channels: 4 slices, the last one short); both paths give F.linear's product."""
    from toppings.server.model import quant

    monkeypatch.setattr(quant, "DEQUANT_ROWS", 64)
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(200, 96, generator=gen), torch.randn(9, 96, generator=gen)
    q = quantize(w, scheme)
    linear = QuantizedLinear(q, torch.float32)
    linear.gemv_rows = 0  # torch's paths only (tests/server/model/test_gemv_int8.py: the GEMV)
    assert linear.max_kernel_rows < 9
    want = F.linear(x, q.dequantize())
    assert torch.allclose(linear(x), want, rtol=1e-5, atol=1e-5)  # dequantized
    assert torch.allclose(linear(x[:1]), want[:1], rtol=1e-5, atol=1e-5)  # the kernel
    assert torch.equal(linear.dequantize_rows(128, 200), q.dequantize()[128:200])


def test_a_bfloat16_prefill_multiplies_by_the_weights_a_bfloat16_model_holds():
    """bfloat16 int8 rows past the kernel's multiply by q * scale rounded once to bfloat16 (the
    weights transformers holds when a bfloat16 model loads the dequantized checkpoint), through
    torch's bfloat16 GEMM."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 64, generator=gen), torch.randn(40, 64, generator=gen).bfloat16()
    q = quantize_int8(w)
    linear = QuantizedLinear(q, torch.bfloat16)
    assert linear.max_kernel_rows < 40
    held = q.dequantize(torch.bfloat16).bfloat16()
    assert torch.equal(linear.dequantize_rows(0, 96), held)
    assert torch.equal(linear(x), F.linear(x, held))


def test_quantization_is_cpu_only_and_refused_before_loading():
    with pytest.raises(ValueError, match="--quantization int8 runs on --device cpu only"):
        EngineConfig(device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4"):
        EngineConfig(quantization="int3")
    assert EngineConfig(quantization="int4").quantization_scheme is Quantization.INT4


def test_serve_refuses_quantization_on_cuda_in_one_line(tmp_path):
    from tests.server.api.test_cli_errors import assert_refused, run

    result = run("toppings-serve", "--model", str(tmp_path / "absent"), "--device", "cuda",
                 "--quantization", "int8", "--port", "0")  # fmt: skip
    assert_refused(result, "toppings-serve", "--quantization int8 runs on --device cpu only")


def _tiny_llama_gguf(tmp_path, monkeypatch, types):
    """A tiny llama-arch GGUF whose tensors named in `types` are stored in those GGML types,
    and the Hugging Face state it was written from."""
    pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.server.model.test_gguf_families import SHAPES, write_gguf

    monkeypatch.setenv("TOPPINGS_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    state = LlamaForCausalLM(LlamaConfig(**SHAPES)).float().state_dict()
    path = tmp_path / "tiny-q4.gguf"
    write_gguf(path, "llama", state, types)
    return path, state


def test_gguf_q4_blocks_load_as_int4_without_a_round_trip(tmp_path, monkeypatch):
    """Q4_0 and Q4_1 projections come as Int4Weight whose dequantization is gguf's own
    dequantization of the blocks, in Hugging Face row order (transformers' conversion of the
    same file: permuted q/k included); a Q8_0 projection comes as the converted float tensor."""
    from gguf import GGMLQuantizationType as G

    from toppings.server.model.loader import load_checkpoint
    from toppings.server.model.quant import Int4Weight
    from toppings.server.model.weights import SafetensorsWeights

    p = "model.layers.1."
    types = {
        p + "self_attn.q_proj.weight": G.Q4_0, p + "self_attn.k_proj.weight": G.Q4_1,
        p + "self_attn.v_proj.weight": G.Q4_0, p + "mlp.down_proj.weight": G.Q4_1,
        p + "mlp.up_proj.weight": G.Q8_0,
    }  # fmt: skip
    path, state = _tiny_llama_gguf(tmp_path, monkeypatch, types)
    checkpoint = load_checkpoint(str(path), quantization=Quantization.INT4)
    from toppings.server.model.loader import resolve_model_dir

    converted = SafetensorsWeights.from_dir(resolve_model_dir(str(path)))
    for name, qtype in types.items():
        got = checkpoint.weights[name]
        if qtype == G.Q8_0:
            assert isinstance(got, torch.Tensor) and torch.equal(got, converted[name])
            continue
        assert isinstance(got, Int4Weight), name
        want = converted[name]  # transformers: gguf.quants.dequantize, rows un-permuted
        assert not torch.allclose(want, state[name], atol=1e-3), "the blocks are lossy"
        assert torch.allclose(got.dequantize(), want, rtol=1e-6, atol=1e-7), name
    # with int8, or without quantization, every tensor is the converted float one
    plain = load_checkpoint(str(path), quantization=Quantization.INT8)
    assert all(isinstance(plain.weights[n], torch.Tensor) for n in types)


def test_gguf_q4_0_model_serves_transformers_tokens(tmp_path, monkeypatch):
    """Every projection Q4_0 (lm_head Q4_1): the engine with int4 gives the logprobs of
    transformers on the converted checkpoint (the blocks' exact values) with lm_head in int8."""
    from gguf import GGMLQuantizationType as G
    from safetensors.torch import load_file, save_file

    from tests.helpers import running_engine
    from tests.server.engine.test_logprobs_exactness import TOL
    from toppings.server.model.loader import resolve_model_dir
    from toppings.server.requests.request import GenerationRequest, SamplingParams

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.server.model.test_gguf_families import SHAPES

    names = [n for n in LlamaForCausalLM(LlamaConfig(**SHAPES)).state_dict()
             if n.split(".")[-2] in targets or n == "lm_head.weight"]  # fmt: skip
    types = {n: G.Q4_1 if n == "lm_head.weight" else G.Q4_0 for n in names}
    path, _ = _tiny_llama_gguf(tmp_path, monkeypatch, types)
    converted = resolve_model_dir(str(path))
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    for f in converted.iterdir():
        (ref_dir / f.name).write_bytes(f.read_bytes())
    (st,) = ref_dir.glob("*.safetensors")
    state = load_file(str(st))
    state["lm_head.weight"] = quantize_int8(state["lm_head.weight"]).dequantize()
    save_file(state, str(st), metadata={"format": "pt"})
    prompt = [5, 9, 30, 7, 101, 44, 3]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)  # fmt: skip
    with running_engine(path, quantization="int4", max_total_tokens=512) as engine:
        out = engine.submit(GenerationRequest(prompt, params)).result(timeout_s=120)
    ids = prompt + out.new_token_ids
    ref = _hf_logprobs(ref_dir, ids)  # [len, V]
    for j, token in enumerate(out.new_token_ids):
        row = ref[len(prompt) - 1 + j]
        assert token == int(row.argmax()), j
        assert abs(out.logprobs[j].logprob - float(row[token])) < TOL, j
    assert json.loads((converted / "config.json").read_text())["model_type"] == "llama"


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
