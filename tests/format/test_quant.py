import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_nvfp4_sm120.format import (
    E2M1_VALUES,
    NVFP4_AMAX_DIVISOR,
    GlobalScale,
    decode_e2m1,
    dequantize_nvfp4,
    quantize_nvfp4,
    swizzle_128x4,
    unpack_e2m1,
)

GRID = torch.tensor(sorted(set(E2M1_VALUES)))


def test_conventions_name_the_direction():
    amax = torch.tensor(5.0)
    modelopt = GlobalScale.from_decode(amax / NVFP4_AMAX_DIVISOR)  # weight_scale_2 / input_scale
    ct = GlobalScale.from_encode(NVFP4_AMAX_DIVISOR / amax)  # weight_global_scale / input_global_scale
    torch.testing.assert_close(modelopt.dec, ct.dec)
    torch.testing.assert_close(modelopt.enc, ct.enc)
    assert float(ct.enc) > 1.0 > float(ct.dec)
    assert GlobalScale.from_amax(amax).enc.item() == ct.enc.item()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_global_scale_rejects_nonpositive(bad):
    with pytest.raises(ValueError, match="global"):
        GlobalScale.from_decode(bad)


def test_global_scale_rejects_vectors():
    with pytest.raises(ValueError, match="one global scale per tensor"):
        GlobalScale.from_encode(torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (3, 5, 64)])
def test_shapes_dtypes(dtype, shape, gen):
    x = torch.randn(shape, generator=gen).to(dtype)
    q = quantize_nvfp4(x, GlobalScale.of(x))
    assert q.codes.shape == (*shape[:-1], shape[-1] // 2) and q.codes.dtype == torch.uint8
    assert q.scales.shape == (*shape[:-1], shape[-1] // 16) and q.scales.dtype == torch.float8_e4m3fn


def test_largest_block_scale_hits_448(gen):
    x = torch.randn(8, 64, generator=gen)
    q = quantize_nvfp4(x, GlobalScale.of(x))
    assert q.scales.to(torch.float32).max().item() == 448.0
    assert decode_e2m1(unpack_e2m1(q.codes)).abs().max().item() == 6.0


def test_zero_blocks_stay_zero():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-3, 3, 16)
    gs = GlobalScale.of(x)
    q = quantize_nvfp4(x, gs)
    assert q.scales[0].to(torch.float32).tolist() == [0.0, 0.0] and q.scales[1, 0].item() == 0.0
    dq = dequantize_nvfp4(*q, gs)
    assert torch.all(dq[0] == 0) and torch.all(dq[1, :16] == 0)
    assert torch.isfinite(dq).all()


def test_all_zero_tensor():
    x = torch.zeros(3, 16)
    gs = GlobalScale.of(x)
    assert torch.equal(dequantize_nvfp4(*quantize_nvfp4(x, gs), gs), x)


def test_saturation_when_global_too_small():
    # A global calibrated for amax 1 applied to amax 100: block scales saturate at 448, codes at +-6.
    x = torch.full((1, 16), 100.0)
    x[0, 1] = -100.0
    gs = GlobalScale.from_amax(1.0)
    q = quantize_nvfp4(x, gs)
    assert q.scales.to(torch.float32).max().item() == 448.0
    dq = dequantize_nvfp4(*q, gs)
    torch.testing.assert_close(dq[0, :2], torch.tensor([1.0, -1.0]), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rejects_nonfinite(bad):
    x = torch.ones(2, 16)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=r"x: contains NaN or inf \(first at index \[1, 3\]\)"):
        quantize_nvfp4(x, GlobalScale.from_amax(1.0))


def test_rejects_bad_k():
    with pytest.raises(ValueError, match="x: last dimension must be a multiple of 16"):
        quantize_nvfp4(torch.ones(2, 24), GlobalScale.from_amax(1.0))


def test_dequant_swizzled_equals_linear(gen):
    x = torch.randn(130, 96, generator=gen)
    gs = GlobalScale.of(x)
    q = quantize_nvfp4(x, gs)
    torch.testing.assert_close(
        dequantize_nvfp4(q.codes, swizzle_128x4(q.scales), gs, swizzled=True), dequantize_nvfp4(*q, gs), rtol=0, atol=0
    )


def test_dequant_bad_scale_shape():
    with pytest.raises(ValueError, match=r"scales: expected shape \[4, 2\], got \[4, 3\]"):
        dequantize_nvfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), GlobalScale.from_amax(1.0))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    blocks=st.integers(1, 6),
    log_scale=st.floats(-6, 6),
    calib=st.floats(0.5, 2.0),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_quantize_is_nearest_on_the_block_grid(rows, blocks, log_scale, calib, seed, dtype):
    """Each element's code is the nearest e2m1 value to x / S (clamped to +-6), S = the block's decode step;
    the dequantization error is within half a grid step (at most S) plus the saturated excess."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, blocks * 16, generator=g) * 2.0**log_scale).to(dtype)
    x32 = x.to(torch.float32)
    gs = GlobalScale.from_amax(x32.abs().max() * calib)  # also globals that are off by up to 2x
    q = quantize_nvfp4(x, gs)
    vals = decode_e2m1(unpack_e2m1(q.codes)).reshape(rows, blocks, 16)
    step = (q.scales.to(torch.float32) * gs.dec).unsqueeze(-1)  # block decode step
    ok = step.expand_as(vals) > 0
    y = (x32.reshape(rows, blocks, 16) / step).clamp(-6, 6)
    dist = (vals - y).abs()
    best = (GRID.view(1, 1, 1, -1) - y.unsqueeze(-1)).abs().min(dim=-1).values
    # fp32 division vs the kernel's multiply-by-reciprocal: allow a few ulps of y
    assert torch.all(dist[ok] <= best[ok] + 1e-5 * y.abs()[ok] + 1e-6)
    dq = dequantize_nvfp4(*q, gs).reshape(rows, blocks, 16)
    xb = x32.reshape(rows, blocks, 16)
    excess = (xb.abs() - 6 * step).clamp(min=0)
    assert torch.all(((dq - xb).abs() <= step + excess + 1e-6 * xb.abs())[ok])
