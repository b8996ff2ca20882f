"""Vendor sm_120 W4A4/W4A16 routes: load-time preparation and argument checks on the CPU, real execution against
the torch references on sm_120 only (``-m sm120``).  Which GPU and shape a route accepts:
tests/dispatch/test_vendor.py."""

import importlib.util

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import vendor
from vllm_nvfp4_sm120.dispatch.hw import capability_of
from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
from vllm_nvfp4_sm120.format import (
    linear_w4a4_ref,
    linear_w4a16_ref,
    make_linear,
    swizzle_128x4,
    swizzled_shape,
    unpack_e2m1,
)
from vllm_nvfp4_sm120.kernels import fp4_routes as R

# The H200 image has no FlashInfer: tests of its probes run where it is installed (the dev machine, sm_120 boxes).
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")


def _weight(n, k, gen):
    p = make_linear(n, k, gen=gen)
    return p.codes, p.scales, p


# ---------------------------------------------------------------------------------------------------------------
# Load-time preparation


@pytest.mark.parametrize("n,k", [(64, 128), (40, 48), (8, 16), (130, 80)])
def test_prepare_b12x_weight(n, k, gen):
    codes, scales, _ = _weight(n, k, gen)
    w, sf = R.prepare_b12x_weight(codes, scales)
    np_, kp = -(-n // 32) * 32, -(-k // 32) * 32
    assert w.shape == (np_, kp // 2) and w.dtype == torch.uint8 and w.is_contiguous()
    if (np_, kp) == (n, k):
        assert w is codes  # aligned: the checkpoint tensor itself, no copy
    torch.testing.assert_close(w[:n, : k // 2], codes, rtol=0, atol=0)
    assert not w[n:].any() and not w[:, k // 2:].any()
    # The swizzled scales cover the padded N and K (mm_fp4 sizes them from the padded weight) with zeros.
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == swizzled_shape(np_, kp // 16) == swizzled_shape(n, k // 16)
    torch.testing.assert_close(sf.view(torch.uint8), swizzle_128x4(scales).view(torch.uint8), rtol=0, atol=0)


def test_prepare_b12x_padding_decodes_to_zero(gen):
    codes, scales, _ = _weight(40, 48, gen)
    w, _ = R.prepare_b12x_weight(codes, scales)
    assert not unpack_e2m1(w)[40:].any() and not unpack_e2m1(w)[:, 48:].any()


def test_prepare_cublas_weight(gen):
    codes, scales, _ = _weight(48, 64, gen)
    w, sf = R.prepare_cublas_weight(codes, scales.view(torch.uint8))
    assert w is codes
    torch.testing.assert_close(sf.view(torch.uint8), swizzle_128x4(scales).view(torch.uint8), rtol=0, atol=0)


@needs_flashinfer
@pytest.mark.parametrize("backend", R.W4A16_BACKENDS)
def test_prepare_w4a16_passes_swizzled_scales(backend, gen, monkeypatch):
    import flashinfer

    seen = {}

    def fake_prepare(b, b_descale, alpha, *, backend):
        seen.update(b=b, sf=b_descale, alpha=alpha, backend=backend)
        return b, b_descale, alpha

    monkeypatch.setattr(flashinfer, "prepare_bf16_fp4_weights", fake_prepare)
    codes, scales, p = _weight(64, 128, gen)
    R.prepare_flashinfer_w4a16(codes, scales, p.weight_gs.dec.reshape(1), backend=backend)
    assert seen["backend"] == backend and seen["b"].data_ptr() == codes.data_ptr()
    torch.testing.assert_close(seen["sf"].view(torch.uint8), swizzle_128x4(scales).view(torch.uint8), rtol=0, atol=0)
    assert seen["alpha"].shape == (1,) and seen["alpha"].dtype == torch.float32


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda c, s: R.prepare_b12x_weight(c.to(torch.int8), s), TypeError, r"w_codes: expected dtype uint8"),
        (lambda c, s: R.prepare_b12x_weight(c, s[:, :-1]), ValueError, r"w_scales: expected shape \[64, 8\]"),
        (lambda c, s: R.prepare_b12x_weight(c, s.float()), TypeError, r"w_scales: expected dtype"),
        (lambda c, s: R.prepare_cublas_weight(c[:, :-4], s), ValueError, r"w_codes: K = 120 .* multiple of 16"),
        (lambda c, s: R.prepare_flashinfer_w4a16(c, s, torch.ones(2)), ValueError, r"weight_dec: one decode global"),
        (lambda c, s: R.prepare_flashinfer_w4a16(c, s, torch.ones(1), backend="x"), ValueError, r"backend: expected"),
    ],
)
def test_prepare_bad_input(call, error, match, gen):
    codes, scales, _ = _weight(64, 128, gen)
    with pytest.raises(error, match=match):
        call(codes, scales)


# ---------------------------------------------------------------------------------------------------------------
# Run-time argument checks (the requirement the dispatch asks before each run: tests/dispatch/test_vendor.py)


def _w4a4_args(t, n, k, gen, device="cpu"):
    codes, scales, p = _weight(n, k, gen)
    x = (torch.randn(t, k, generator=gen) * 2).to(torch.bfloat16)
    alpha = (p.input_gs.dec * p.weight_gs.dec).reshape(1).to(torch.float32)
    return x.to(device), p, codes.to(device), scales.to(device), p.input_gs.enc.reshape(1).to(device), alpha.to(device)


def test_scaled_mm_argument_checks(gen):
    x, p, codes, scales, enc, alpha = _w4a4_args(4, 32, 64, gen)
    a = torch.zeros(4, 32, dtype=torch.uint8)
    sa = torch.zeros(swizzled_shape(4, 4), dtype=torch.float8_e4m3fn)
    w, sw = R.prepare_cublas_weight(codes, scales)
    with pytest.raises(ValueError, match=r"a_scales_swizzled \(128x4-swizzled e4m3 scales\): expected shape \[128,"):
        R.scaled_mm_nvfp4(a, sa[:4], w, sw, alpha, torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_codes: expected shape \[32, 32\]"):
        R.scaled_mm_nvfp4(a, sa, w[:, :16], sw, alpha, torch.bfloat16)
    with pytest.raises(ValueError, match=r"alpha: expected one fp32 value"):
        R.scaled_mm_nvfp4(a, sa, w, sw, alpha.expand(2), torch.bfloat16)
    with pytest.raises(TypeError, match=r"out_dtype"):
        R.scaled_mm_nvfp4(a, sa, w, sw, alpha, torch.float32)
    with pytest.raises(ValueError, match=r"bias: expected shape \[32\]"):
        R.scaled_mm_nvfp4(a, sa, w, sw, alpha, torch.bfloat16, torch.zeros(31, dtype=torch.bfloat16))
    assert R.scaled_mm_nvfp4(a[:0], sa[:0], w, sw, alpha, torch.bfloat16).shape == (0, 32)  # T = 0: no GPU needed


def test_b12x_argument_checks(gen):
    x, p, codes, scales, enc, alpha = _w4a4_args(3, 40, 48, gen)
    w, sw = R.prepare_b12x_weight(codes, scales)
    tile = act_quant_config(3, 48, swizzled=True)
    with pytest.raises(ValueError, match=r"w_codes: expected the prepare_b12x_weight layout \[64, 32\]"):
        R.b12x_linear(x, codes, sw, enc, alpha, 40, quant_tile=tile)
    with pytest.raises(TypeError, match=r"x: expected dtype"):
        R.b12x_linear(x.float(), w, sw, enc, alpha, 40, quant_tile=tile)
    with pytest.raises(ValueError, match=r"quantizer"):
        R.b12x_linear(x, w, sw, enc, alpha, 40, quantizer="trtllm", quant_tile=tile)
    assert R.b12x_linear(x[:0], w, sw, enc, alpha, 40, quant_tile=tile).shape == (0, 40)


@pytest.mark.parametrize("t", [0, 3])
def test_flashinfer_w4a16_linear_calls_mm_bf16_fp4(t, gen, monkeypatch):
    """What our wrapper hands FlashInfer (faked; mm_bf16_fp4 runs on sm_100/sm_12x only): the prepared tuple, a
    contiguous copy of a row-strided x, the backend and x's dtype; the bias goes onto FlashInfer's output."""
    import types

    calls = []

    def mm_bf16_fp4(a, b, b_descale, alpha, *, backend, out_dtype):
        calls.append(dict(a=a, b=b, sf=b_descale, alpha=alpha, backend=backend, out_dtype=out_dtype))
        return torch.ones(a.shape[0], 24, dtype=out_dtype)

    monkeypatch.setattr(R, "flashinfer", lambda: types.SimpleNamespace(mm_bf16_fp4=mm_bf16_fp4))
    monkeypatch.setattr(R, "require_cuda", lambda route, t: None)
    wide = torch.randn(t, 96, generator=gen).to(torch.bfloat16)
    x = wide[:, :64]  # row stride 96
    prepared = (torch.zeros(4, 48, dtype=torch.int32), torch.zeros(4, 24, dtype=torch.uint8), torch.ones(1))
    bias = torch.arange(24).to(torch.bfloat16)
    out = R.flashinfer_w4a16_linear(x, prepared, 24, backend="cudnn", bias=bias)
    assert out.shape == (t, 24) and out.dtype == torch.bfloat16
    if t == 0:
        assert not calls  # nothing to launch
        return
    [call] = calls
    assert call["a"].is_contiguous() and torch.equal(call["a"], x)
    assert call["b"] is prepared[0] and call["sf"] is prepared[1] and call["alpha"] is prepared[2]
    assert call["backend"] == "cudnn" and call["out_dtype"] == torch.bfloat16
    torch.testing.assert_close(out, (1 + bias).expand(t, 24), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# sm_120: real execution against the references

SM120_SHAPES = [(1, 5120, 8192), (16, 10240, 5120), (17, 8192, 28672), (256, 5120, 25600), (2048, 10240, 5120),
                (3, 40, 48)]


def _close(out, ref):
    # Same products, fp32 accumulation in another order and a bf16 output: a few bf16 ulps.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.sm120
@pytest.mark.parametrize("fused_alpha", [True, False])
@pytest.mark.parametrize("t,n,k", [s for s in SM120_SHAPES if s[1] % 16 == 0 and s[2] % 32 == 0])
def test_cublas_sm120(t, n, k, fused_alpha):
    gen = torch.Generator().manual_seed(t + n + k)
    x, p, codes, scales, enc, alpha = _w4a4_args(t, n, k, gen, "cuda")
    w, sw = R.prepare_cublas_weight(codes, scales)
    out = R.cublas_linear(x, enc, w, sw, alpha, fused_alpha=fused_alpha, quant_tile=act_quant_config(t, k, True))
    _close(out, linear_w4a4_ref(x.cpu(), p.codes, p.scales, p.weight_gs, p.input_gs).cuda())


@pytest.mark.sm120
@pytest.mark.parametrize("quantizer", ["ours", "flashinfer"])
@pytest.mark.parametrize("t,n,k", SM120_SHAPES)
def test_b12x_sm120(t, n, k, quantizer):
    if reason := vendor.b12x_refusal(capability_of(torch.device("cuda")), n, k):
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(t + n + k)
    x, p, codes, scales, enc, alpha = _w4a4_args(t, n, k, gen, "cuda")
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    w, sw = R.prepare_b12x_weight(codes, scales)
    out = R.b12x_linear(x, w, sw, enc, alpha, n, bias=bias, quantizer=quantizer,
                        quant_tile=act_quant_config(t, k, True))
    _close(out, linear_w4a4_ref(x.cpu(), p.codes, p.scales, p.weight_gs, p.input_gs, bias=bias.cpu()).cuda())


@pytest.mark.sm120
@pytest.mark.parametrize("backend", R.W4A16_BACKENDS)
@pytest.mark.parametrize("t,n,k", [(1, 5120, 8192), (16, 10240, 5120), (256, 8192, 28672)])
def test_flashinfer_w4a16_sm120(t, n, k, backend):
    reason = vendor.flashinfer_w4a16_refusal(capability_of(torch.device("cuda")), n, k, backend=backend)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(t + n + k)
    x, p, codes, scales, _, _ = _w4a4_args(t, n, k, gen, "cuda")
    prepared = R.prepare_flashinfer_w4a16(codes, scales, p.weight_gs.dec.reshape(1).cuda(), backend=backend)
    out = R.flashinfer_w4a16_linear(x, prepared, n, backend=backend)
    _close(out, linear_w4a16_ref(x.cpu(), p.codes, p.scales, p.weight_gs.dec).cuda())
