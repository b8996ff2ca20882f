"""Our format layer against vLLM 0.33.0's own NVFP4 emulation utilities (CPU).

Bit for bit where the math is the same (quantize, dequantize, swizzle); the linear within bf16 rounding, since
vLLM's emulation rounds the dequantized operands to the activation dtype before its matmul and we do not.
Note vLLM's conventions: ``ref_nvfp4_quant`` takes the *encode* global, ``dequantize_to_dtype`` the *decode* one.
"""

import pytest
import torch

# The GPU machine used for kernel proofs has no vLLM (the submodule, not a bare `vllm`, so that no namespace
# package of that name can pass for it); CI installs it and tests/test_readme.py checks that it imports.
pytest.importorskip("vllm.model_executor", reason="vLLM is not installed (the cross-checks need vLLM 0.33.0)")

from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (  # noqa: E402
    dequantize_nvfp4_moe_weights,
    dequantize_to_dtype,
    ref_nvfp4_quant,
    ref_nvfp4_quant_dequant,
    run_nvfp4_emulations,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale  # noqa: E402

from vllm_nvfp4_sm120.format import (  # noqa: E402
    GlobalScale,
    NvFp4,
    decode_e2m1,
    dequantize_nvfp4,
    linear_w4a4_ref,
    moe_ref,
    quantize_nvfp4,
    swizzle_128x4,
    topk_route,
    unpack_e2m1,
)

SHAPES = [(1, 16), (5, 64), (33, 160), (128, 512)]


def _values(q):
    return decode_e2m1(unpack_e2m1(q.codes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k", SHAPES)
@pytest.mark.parametrize("calib", [1.0, 0.3])  # 0.3: global too small, scales saturate
def test_quantize_bit_exact(m, k, dtype, calib, gen):
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0, :16] = 0  # a zero block
    gs = GlobalScale.from_amax(x.float().abs().max() * calib)
    q = quantize_nvfp4(x, gs)
    ref_vals, ref_scales = ref_nvfp4_quant(x, gs.enc, 16)
    torch.testing.assert_close(_values(q), ref_vals, rtol=0, atol=0)
    torch.testing.assert_close(q.scales.to(torch.float32), ref_scales, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k", SHAPES)
def test_dequantize_bit_exact(m, k, dtype, gen):
    x = torch.randn(m, k, generator=gen)
    gs = GlobalScale.from_decode(x.abs().max() / 2688)  # a ModelOpt weight_scale_2
    q = quantize_nvfp4(x, gs)
    ours = dequantize_nvfp4(*q, gs, dtype)
    torch.testing.assert_close(ours, dequantize_to_dtype(q.codes, q.scales, gs.dec, dtype, swizzle=False), rtol=0, atol=0)
    if (k // 16) % 4 == 0:
        # vLLM's convert_swizzled_to_linear crops the padded scale columns to K *elements* instead of K/16
        # scales, so its swizzled path is only right when K/16 needs no padding.
        theirs_sw = dequantize_to_dtype(q.codes, swizzle_128x4(q.scales), gs.dec, dtype, swizzle=True)
        torch.testing.assert_close(ours, theirs_sw, rtol=0, atol=0)


def test_quant_dequant_matches_vllm(gen):
    x = torch.randn(17, 128, generator=gen, dtype=torch.bfloat16)
    gs = GlobalScale.of(x)
    ours = dequantize_nvfp4(*quantize_nvfp4(x, gs), gs, torch.float32)
    theirs = ref_nvfp4_quant_dequant(x, gs.enc, 16).to(torch.float32)
    # vLLM divides by the encode scale and rounds to bf16; we multiply by the decode scale in fp32.
    torch.testing.assert_close(ours.to(torch.bfloat16).float(), theirs, rtol=2**-7, atol=0)


@pytest.mark.parametrize("shape", [(1, 1), (130, 6), (3, 257, 13)])
def test_swizzle_matches_vllm(shape, gen, monkeypatch):
    # swizzle_blockscale ends with .cuda(); on a CPU-only machine keep the tensor where it is.
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    s = torch.rand(shape, generator=gen).mul(448).to(torch.float8_e4m3fn)
    theirs = swizzle_blockscale(s)
    ours = swizzle_128x4(s)
    assert torch.equal(ours.view(torch.uint8).reshape(-1), theirs.view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("t, n, k", [(1, 32, 64), (9, 48, 128), (64, 256, 512)])
def test_w4a4_linear_matches_vllm_emulation(t, n, k, gen):
    x = torch.randn(t, k, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    w_gs, in_gs = GlobalScale.of(w), GlobalScale.of(x)
    wq = quantize_nvfp4(w, w_gs)
    ours = linear_w4a4_ref(x, wq.codes, wq.scales, w_gs, in_gs)
    theirs = run_nvfp4_emulations(x, in_gs.enc, wq.codes, wq.scales, w_gs.dec, swizzle=False)
    assert theirs.dtype == ours.dtype == torch.bfloat16
    # Both quantize x identically; the difference is vLLM's bf16 rounding of each dequantized operand
    # (relative 2^-9 each) and its bf16 matmul, accumulated over K.
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2 * ours.float().abs().max().item())


def test_moe_ref_matches_vllm_dequant_loop(gen):
    """MoE reference vs a per-token loop over vLLM-dequantized expert weights (compressed-tensors encode globals)."""
    e, h, i, t, top_k = 4, 64, 32, 6, 2
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.1
    w2 = torch.randn(e, h, i, generator=gen) * 0.1
    g13 = [GlobalScale.of(w13[j]) for j in range(e)]
    g2 = [GlobalScale.of(w2[j]) for j in range(e)]
    q13 = [quantize_nvfp4(w13[j], g13[j]) for j in range(e)]
    q2 = [quantize_nvfp4(w2[j], g2[j]) for j in range(e)]
    w13_q = NvFp4(torch.stack([q.codes for q in q13]), torch.stack([q.scales for q in q13]))
    w2_q = NvFp4(torch.stack([q.codes for q in q2]), torch.stack([q.scales for q in q2]))
    enc13 = torch.stack([g.enc for g in g13])
    enc2 = torch.stack([g.enc for g in g2])
    w13_dq, w2_dq = dequantize_nvfp4_moe_weights(
        w13_q.codes, w13_q.scales, enc13[:, None].repeat(1, 2), w2_q.codes, w2_q.scales, enc2, torch.float32
    )
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(t, e, generator=gen), top_k)
    ours = moe_ref(x, w13_q, 1.0 / enc13, w2_q, 1.0 / enc2, weights, ids)
    expected = torch.zeros(t, h)
    for tok in range(t):
        for slot in range(top_k):
            ex = int(ids[tok, slot])
            gate, up = (x[tok].float() @ w13_dq[ex].t()).chunk(2)
            inter = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
            expected[tok] += weights[tok, slot] * (inter @ w2_dq[ex].t())
    torch.testing.assert_close(ours.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
