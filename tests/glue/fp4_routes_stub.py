"""Make the cuBLAS and b12x routes selectable on a CPU-only machine.

Their requirements (``dispatch/vendor.py``) rightly refuse a CPU or a missing toolkit; here they are replaced to
accept, while the real load-time layout functions (``kernels/fp4_routes.py``) run.  On CPU the op computes the torch
reference and never calls the route GEMMs.

The FlashInfer W4A16 route has no CPU reference in its op (its weight is FlashInfer's layout): for it,
:func:`install_flashinfer_w4a16` fakes FlashInfer itself, so our preparation and run functions execute for real.
"""

from __future__ import annotations

import types

import torch

from vllm_nvfp4_sm120.dispatch import vendor
from vllm_nvfp4_sm120.format import linear_w4a16_ref, unswizzle_128x4

REFUSALS = ("cublas_refusal", "b12x_refusal")


def install(mp) -> None:
    """The cuBLAS and b12x requirements accept every layer (until ``mp`` is undone)."""
    for refusal in REFUSALS:
        mp.setattr(vendor, refusal, lambda capability, n, k, **kw: None)


# ---- FlashInfer W4A16 (prepare_bf16_fp4_weights / mm_bf16_fp4) on CPU ------------------------------------------

FI_W4A16_CALLS: list[dict] = []  # what the fake mm_bf16_fp4 was called with, newest last


def _fake_prepare_bf16_fp4_weights(b, b_descale, alpha=None, *, backend, block_size=16):
    """Each backend's documented shapes and dtypes; the cute-dsl packing order is our own (invertible) one."""
    n, k = b.shape[0], 2 * b.shape[1]
    scales = unswizzle_128x4(b_descale.view(torch.float8_e4m3fn), n, k // 16)
    if backend == "cute-dsl":  # a repacked copy: int32 (K/16, 2N) codes, uint8 (K/16, N) scales
        packed = b.reshape(n, k // 16, 8).transpose(0, 1).contiguous().view(torch.int32).reshape(k // 16, 2 * n)
        return packed, scales.t().contiguous().view(torch.uint8), alpha
    if backend == "cudnn":  # the codes as they are, linear e4m3 scales
        return b, scales, alpha
    return b, b_descale, alpha  # cute-dsl-native: the inputs


def _fake_mm_bf16_fp4(a, b, b_descale, alpha=None, *, backend, out_dtype=None, out=None, block_size=16,
                      enable_pdl=True):
    """The W4A16 reference on the original weight, recovered from the fake preparation's layout."""
    FI_W4A16_CALLS.append(dict(a=a, b=b, b_descale=b_descale, alpha=alpha, backend=backend))
    k = a.shape[1]
    if backend == "cute-dsl":
        n = b.shape[1] // 2
        codes = b.view(torch.uint8).reshape(k // 16, n, 8).transpose(0, 1).reshape(n, k // 2)
        scales = b_descale.t().contiguous().view(torch.float8_e4m3fn)
    else:
        codes, n = b, b.shape[0]
        scales = b_descale if backend == "cudnn" else unswizzle_128x4(b_descale, n, k // 16)
    dec = alpha if alpha is not None else torch.ones(1)
    return linear_w4a16_ref(a, codes, scales, dec).to(out_dtype or a.dtype)


def _fake_is_backend_supported(backend, cc):
    return cc in vendor.W4A16_CCS.get(backend, ())


_fake_mm_bf16_fp4.is_backend_supported = _fake_is_backend_supported


def install_flashinfer_w4a16(mp) -> types.SimpleNamespace:
    """Make ``fp4_routes`` see the fake FlashInfer W4A16 on CPU tensors: only FlashInfer and the CUDA-tensor check
    are replaced; the requirement (``dispatch/vendor.py``), preparation and run functions are the real ones."""
    from vllm_nvfp4_sm120.kernels import fp4_routes

    fake = types.SimpleNamespace(__version__="fake", prepare_bf16_fp4_weights=_fake_prepare_bf16_fp4_weights,
                                 mm_bf16_fp4=_fake_mm_bf16_fp4)
    FI_W4A16_CALLS.clear()
    mp.setattr(fp4_routes, "flashinfer", lambda: fake)
    mp.setattr(fp4_routes, "require_cuda", lambda route, t: None)
    return fake
