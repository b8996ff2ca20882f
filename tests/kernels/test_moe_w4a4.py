"""W4A4 MoE quantization: the input (``moe_quant_input`` = ``quantize_act_nvfp4``) and the gate_up epilogue's fp32
tile quantizer (``act_quant.quantize_blocks_nvfp4``) are bit-exact with format.quantize_nvfp4; the fused gate_up
epilogue quantizes exactly the reference intermediate (interpreter, fp16).  The fp32 probe also runs on the GPU
(both e4m3 roundings)."""

import pytest
import torch
import triton
import triton.language as tl

from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
from vllm_nvfp4_sm120.format import GlobalScale, make_moe_bank, quantize_nvfp4, topk_route, unit_values
from vllm_nvfp4_sm120.format.e2m1 import E2M1_MAGNITUDES
from vllm_nvfp4_sm120.format.reference import gated_activation
from vllm_nvfp4_sm120.kernels.act_quant import quantize_blocks_nvfp4
from vllm_nvfp4_sm120.kernels.moe_align import moe_align
from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input, moe_w4a4_gate_up


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _assert_exact(codes, scales, ref):
    torch.testing.assert_close(codes.cpu(), ref.codes, rtol=0, atol=0)
    torch.testing.assert_close(scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8), rtol=0, atol=0)


@pytest.mark.parametrize("enc", [2688 / 3.0, 1.0, 2688 / 1e-3])
def test_input_quant_bit_exact(enc, gen):
    # Magnitudes over 15 decades (e4m3 subnormal scales, saturation at 448), zero, -0 and tiny blocks.
    x = torch.randn(37, 96, generator=gen) * torch.logspace(-12, 3, 96)
    x[3] = 0.0
    x[4, :16] = -0.0
    x[5, :16] = 1e-30
    x = x.half()
    codes, scales = moe_quant_input(x.to(_device()), torch.tensor([enc], device=_device()), **act_quant_config(37, 96))
    _assert_exact(codes, scales, quantize_nvfp4(x, GlobalScale.from_encode(enc)))


def test_input_quant_strided_and_empty(gen):
    x = torch.randn(5, 96, generator=gen).half()
    enc = torch.tensor([100.0], device=_device())
    codes, scales = moe_quant_input(x.to(_device())[:, :64], enc, **act_quant_config(5, 64))
    x = x[:, :64]
    _assert_exact(codes, scales, quantize_nvfp4(x, GlobalScale.from_encode(100.0)))
    c0, s0 = moe_quant_input(x[:0].to(_device()), enc, **act_quant_config(0, 64))
    assert c0.shape == (0, 32) and s0.shape == (0, 4)


# ---------------------------------------------------------------------------------------------------------------
# The fp32 tile quantizer as the gate_up epilogue calls it ([R, C] reshaped to 16-element blocks)


@triton.jit
def _tile_probe(x_ptr, enc_ptr, codes_ptr, sf_ptr, R: tl.constexpr, C: tl.constexpr, NATIVE_E4M3: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    x = tl.load(x_ptr + rows * C + tl.arange(0, C)[None, :])
    codes, sf = quantize_blocks_nvfp4(tl.reshape(x, (R, C // 16, 16)), tl.load(enc_ptr), NATIVE_E4M3)
    tl.store(codes_ptr + rows * (C // 2) + tl.arange(0, C // 2)[None, :], tl.reshape(codes, (R, C // 2)))
    tl.store(sf_ptr + rows * (C // 16) + tl.arange(0, C // 16)[None, :], sf)


def _fp32_probe_tile(gen) -> torch.Tensor:
    """fp32 values bf16/fp16 cannot hold: e2m1 midpoints and their fp32 neighbours at block scale 1 (enc = 1 and
    a block amax of 6), blocks over 60 decades (subnormal, saturated and zero scales), -0 and tiny blocks."""
    grid = torch.tensor(E2M1_MAGNITUDES)
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 9.0)),
                     grid[1:]])
    pts = torch.cat([pts, -pts])  # 56 values
    ties = torch.cat([torch.full((1,), 6.0), pts[:15], torch.full((1,), -6.0), pts[15:30],
                      torch.full((1,), 6.0), pts[30:45], torch.full((1,), 6.0), pts[45:], torch.zeros(4)])
    rand = torch.randn(7, 64, generator=gen) * torch.logspace(-30, 30, 7 * 4).repeat_interleave(16).view(7, 64)
    x = torch.cat([ties.view(1, 64), rand]).contiguous()
    x[5, :16] = -0.0
    x[6, 16:32] = 1e-30
    x[7, 32:48] = 0.0
    return x


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["exact", "native"])
@pytest.mark.parametrize("enc", [1.0, 2688 / 3.0])
def test_fp32_tile_quantizer_bit_exact(native, enc, gen):
    x = _fp32_probe_tile(gen)
    r, c = x.shape
    dev = _device()
    codes = torch.empty(r, c // 2, dtype=torch.uint8, device=dev)
    sf = torch.empty(r, c // 16, dtype=torch.uint8, device=dev)
    _tile_probe[(1,)](x.to(dev), torch.tensor([enc], device=dev), codes, sf, R=r, C=c, NATIVE_E4M3=native)
    _assert_exact(codes, sf, quantize_nvfp4(x, GlobalScale.from_encode(enc)))


# ---------------------------------------------------------------------------------------------------------------
# The fused gate_up epilogue (interpreter)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gate_up_epilogue_quantizes_reference_intermediate(activation, gen):
    e, h, i, t, k = 3, 128, 48, 10, 2
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    x = torch.randn(t, h, generator=gen).half()
    tw, ti = topk_route(torch.randn(t, e, generator=gen), k)
    a13, a2 = GlobalScale.of(x), GlobalScale.from_amax(6.0)
    align = moe_align(ti, e, 16)
    ac, asf = moe_quant_input(x, a13.enc.reshape(1), **act_quant_config(t, h))
    ic, isf = moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13.enc.reshape(1), a2.enc.reshape(1), align,
                               activation=activation, decode=True, block_n=32, block_k=64, group_m=8, num_warps=4,
                               num_stages=3)
    x_in = unit_values(ac, asf)
    for ex in range(e):
        r = (ti.reshape(-1) == ex).nonzero().flatten()
        hh = (x_in[r // k] @ unit_values(w13.codes[ex], w13.scales[ex]).t()) * (d13[ex] * a13.dec)
        q = quantize_nvfp4(gated_activation(hh, activation), a2)
        assert torch.equal(ic[r], q.codes) and torch.equal(isf[r], q.scales.view(torch.uint8))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="a13_enc: expected one fp32 encode scale"):
        moe_quant_input(torch.zeros(2, 32, dtype=torch.float16), torch.ones(2), **act_quant_config(2, 32))
    with pytest.raises(ValueError, match=r"x: K = 40 .* multiple of 16"):
        moe_quant_input(torch.zeros(2, 40, dtype=torch.float16), torch.ones(1), **act_quant_config(2, 40))
