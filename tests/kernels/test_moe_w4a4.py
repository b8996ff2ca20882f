"""The W4A4 MoE quantizer is bit-exact with format.quantize_nvfp4; the fused gate_up epilogue quantizes exactly
the reference intermediate (interpreter, fp16)."""

import pytest
import torch

from vllm_nvfp4_sm120.format import GlobalScale, make_moe_bank, quantize_nvfp4, topk_route, unit_values
from vllm_nvfp4_sm120.format.reference import gated_activation
from vllm_nvfp4_sm120.kernels.moe_align import moe_align
from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input, moe_w4a4_gate_up


@pytest.mark.parametrize("enc", [2688 / 3.0, 1.0, 2688 / 1e-3])
def test_input_quant_bit_exact(enc, gen):
    # Magnitudes over 15 decades (e4m3 subnormal scales, saturation at 448), zero, -0 and tiny blocks.
    x = torch.randn(37, 96, generator=gen) * torch.logspace(-12, 3, 96)
    x[3] = 0.0
    x[4, :16] = -0.0
    x[5, :16] = 1e-30
    x = x.half()
    codes, scales = moe_quant_input(x, torch.tensor([enc]))
    q = quantize_nvfp4(x, GlobalScale.from_encode(enc))
    assert torch.equal(codes, q.codes) and torch.equal(scales, q.scales.view(torch.uint8))


def test_input_quant_strided_and_empty(gen):
    x = torch.randn(5, 96, generator=gen).half()[:, :64]
    codes, scales = moe_quant_input(x, torch.tensor([100.0]))
    q = quantize_nvfp4(x, GlobalScale.from_encode(100.0))
    assert torch.equal(codes, q.codes) and torch.equal(scales, q.scales.view(torch.uint8))
    c0, s0 = moe_quant_input(x[:0], torch.tensor([100.0]))
    assert c0.shape == (0, 32) and s0.shape == (0, 4)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gate_up_epilogue_quantizes_reference_intermediate(activation, gen):
    e, h, i, t, k = 3, 128, 48, 10, 2
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    x = torch.randn(t, h, generator=gen).half()
    tw, ti = topk_route(torch.randn(t, e, generator=gen), k)
    a13, a2 = GlobalScale.of(x), GlobalScale.from_amax(6.0)
    align = moe_align(ti, e, 16)
    ac, asf = moe_quant_input(x, a13.enc.reshape(1))
    ic, isf = moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13.enc.reshape(1), a2.enc.reshape(1), align,
                               activation=activation, decode=True, block_n=32, block_k=64)
    x_in = unit_values(ac, asf)
    for ex in range(e):
        r = (ti.reshape(-1) == ex).nonzero().flatten()
        hh = (x_in[r // k] @ unit_values(w13.codes[ex], w13.scales[ex]).t()) * (d13[ex] * a13.dec)
        q = quantize_nvfp4(gated_activation(hh, activation), a2)
        assert torch.equal(ic[r], q.codes) and torch.equal(isf[r], q.scales.view(torch.uint8))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="a13_enc: expected one fp32 encode scale"):
        moe_quant_input(torch.zeros(2, 32, dtype=torch.float16), torch.ones(2))
    with pytest.raises(ValueError, match="H = 40 must be a multiple of 16"):
        moe_quant_input(torch.zeros(2, 40, dtype=torch.float16), torch.ones(1))
