"""W4A4 Triton GEMM (kernels/w4a4_gemm.py) against the torch reference.

CPU: the self-decode path (DECODE=True) in the interpreter.  GPU (H200, Triton 3.8): the native ``dot_scaled``
source (decomposed by Triton on sm_90, OMMA on sm_120) and the self-decode path on real checkpoint shapes.
The sm_120 compile checks of every tile in the dispatch table live in tests/dispatch.
"""

import pytest
import torch

from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE
from vllm_nvfp4_sm120.dispatch.linear import select_linear
from vllm_nvfp4_sm120.format import quantize_nvfp4, random_nvfp4, unit_values
from vllm_nvfp4_sm120.kernels.w4a4_gemm import w4a4_gemm

REAL_SHAPES = [  # (N, K): Qwen3-32B and Llama-3.3-70B linears
    (10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600), (57344, 8192), (8192, 28672),
]
SMALL = dict(block_m=16, block_n=16, block_k=64, group_m=8, num_warps=4, num_stages=3)  # tiny shapes' tails


def _tile(t, n, k):
    """The W4A4 tile the sm_120 dispatch runs at T (from T = 17 on: below it, the route runs a W4A16 kernel)."""
    return select_linear(SM120_REFERENCE, "triton", max(t, 17), n, k).kwargs


def _problem(t, n, k, device, gen, a_row_pad=0):
    w = random_nvfp4((n, k), gen=gen, device=device)
    a = random_nvfp4((t, k + 2 * a_row_pad), gen=gen, device=device)  # row-strided view when padded
    a_codes, a_scales = a.codes[:, : k // 2], a.scales[:, : k // 16]
    alpha = torch.tensor(0.37, device=device)
    return a_codes, a_scales, w.codes, w.scales, alpha


def _reference(a_codes, a_scales, w_codes, w_scales, alpha, bias=None):
    acc = unit_values(a_codes, a_scales) @ unit_values(w_codes, w_scales).t() * alpha
    return acc if bias is None else acc + bias.float()


def _close(out, ref):
    # Products are exact; only fp32 summation order and the final rounding to 16 bits differ.
    scale = ref.abs().max().item() if ref.numel() else 1.0
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-3 * scale)


@pytest.mark.parametrize("t", [0, 1, 3, 17])
@pytest.mark.parametrize("n, k", [(8, 64), (24, 96), (40, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_path_interpreter(t, n, k, bias, gen):
    if torch.cuda.is_available():
        pytest.skip("interpreter test (CPU only)")
    a_codes, a_scales, w_codes, w_scales, alpha = _problem(t, n, k, "cpu", gen, a_row_pad=16)
    b = torch.randn(n, generator=gen).to(torch.float16) if bias else None
    out = w4a4_gemm(a_codes, a_scales, w_codes, w_scales, alpha, torch.float16, bias=b, decode=True, **SMALL)
    assert out.shape == (t, n) and out.dtype == torch.float16
    _close(out, _reference(a_codes, a_scales, w_codes, w_scales, alpha, b))


def test_matches_w4a4_linear_reference(gen):
    if torch.cuda.is_available():
        pytest.skip("interpreter test (CPU only)")
    from vllm_nvfp4_sm120.format import linear_w4a4_ref, make_linear

    p = make_linear(24, 64, gen=gen)
    x = torch.randn(5, 64, generator=gen).to(torch.float16)
    xq = quantize_nvfp4(x, p.input_gs)
    alpha = (p.input_gs.dec * p.weight_gs.dec).reshape(())
    out = w4a4_gemm(xq.codes, xq.scales, p.codes, p.scales, alpha, torch.float16, decode=True, **SMALL)
    ref = linear_w4a4_ref(x, p.codes, p.scales, p.weight_gs, p.input_gs)
    torch.testing.assert_close(out, ref, rtol=2**-9, atol=1e-3)


def test_bad_input_names_tensor():
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    alpha = torch.ones(())
    with pytest.raises(ValueError, match=r"w_scales: expected shape \[6, 4\], got \[4, 4\]"):
        w4a4_gemm(codes, scales, torch.zeros(6, 32, dtype=torch.uint8), scales, alpha, torch.bfloat16, **SMALL)
    with pytest.raises(TypeError, match="a_codes: expected dtype uint8"):
        w4a4_gemm(codes.float(), scales, codes, scales, alpha, torch.bfloat16, **SMALL)
    with pytest.raises(ValueError, match="block_k"):
        w4a4_gemm(codes, scales, codes, scales, alpha, torch.bfloat16, **(SMALL | dict(block_k=32)))
    with pytest.raises(ValueError, match=r"w_codes: expected shape \[\*, 32\]"):
        w4a4_gemm(codes, scales, torch.zeros(4, 16, dtype=torch.uint8), scales, alpha, torch.bfloat16, **SMALL)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", REAL_SHAPES)
@pytest.mark.parametrize("t", [1, 17, 256, 2048])
@pytest.mark.parametrize("decode", [False, True])
def test_real_shapes_gpu(n, k, t, decode, gen):
    args = _problem(t, n, k, "cuda", gen, a_row_pad=8 if t == 17 else 0)
    out = w4a4_gemm(*args, torch.bfloat16, decode=decode, **_tile(t, n, k))
    _close(out, _reference(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("t, n, k", [(0, 64, 128), (3, 24, 96), (130, 200, 320)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_small_odd_shapes_gpu(t, n, k, out_dtype, gen):
    args = _problem(t, n, k, "cuda", gen)
    bias = torch.randn(n, device="cuda").to(out_dtype)
    out = w4a4_gemm(*args, out_dtype, bias=bias, **_tile(t, n, k))
    assert out.shape == (t, n) and out.dtype == out_dtype
    _close(out, _reference(*args, bias=bias))
