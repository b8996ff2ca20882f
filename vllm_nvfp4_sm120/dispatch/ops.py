"""The torch custom ops the vLLM glue calls: opaque to ``torch.compile``, capturable in CUDA graphs.

``torch.ops.nvfp4_sm120.linear`` picks a kernel per call from :mod:`.linear` (branching on T happens inside the
op, where it is a plain int) and has a fake implementation for tracing.  On CPU tensors it computes the torch
reference of the same plan, so the glue's CPU tests see the numerics of the kernel that would run.
``torch.ops.nvfp4_sm120.flashinfer_w4a16`` serves the named comparison route of that name, on FlashInfer's
prepared weight (see there).
"""

from __future__ import annotations

import functools

import torch

from ..format import GlobalScale, linear_w4a16_ref, quantize_nvfp4, unit_values
from .linear import LinearPlan, select_linear

CPU_REFERENCE_CC = 120  # the table CPU calls follow, so CPU tests mirror what an sm_120 GPU would run


@functools.cache
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """SMs of ``device`` (the tiles and chunks of some plans depend on it); CPU: an RTX 5090's 170."""
    if device.type != "cuda":
        return 170
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_capability(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_REFERENCE_CC
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _logical(w_codes, w_scales, n, k):
    """Views of the first N rows and K columns: a route may have padded the weight in place (b12x pads to 32)."""
    return w_codes[:n, : k // 2], w_scales[:n, : k // 16]


# ---- kernel adapters: one per LinearPlan.kernel, all with the op's arguments ----------------------------------

def _w4a4_triton(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
    from ..kernels.act_quant import quantize_act_nvfp4
    from ..kernels.w4a4_gemm import w4a4_gemm

    a_codes, a_scales = quantize_act_nvfp4(x, in_enc)
    codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
    return w4a4_gemm(a_codes, a_scales, codes, scales, alpha, x.dtype, bias=bias, **tile)


def _w4a4_cublas(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **_):
    from ..kernels.act_quant import quantize_act_nvfp4
    from ..kernels.fp4_routes import scaled_mm_nvfp4

    a_codes, a_scales = quantize_act_nvfp4(x, in_enc, swizzled=True)
    return scaled_mm_nvfp4(a_codes, a_scales, w_codes, w_scales_swizzled, alpha, x.dtype, bias=bias)


def _w4a4_b12x(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **_):
    from ..kernels.fp4_routes import b12x_linear

    return b12x_linear(x, w_codes, w_scales_swizzled, in_enc, alpha, n=w_dec_rows.shape[0], bias=bias)


def _w4a16(kernel_name):
    def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
        from ..kernels import w4a16_linear

        codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
        return getattr(w4a16_linear, kernel_name)(x, codes, scales, w_dec_rows, bias, **tile)

    return run


def _w4a16_dequant_mm(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, *, chunk_n):
    from ..kernels.w4a16_dequant import w4a16_dequant_mm

    codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
    return w4a16_dequant_mm(x, codes, scales, w_dec_rows, bias, chunk_n=chunk_n)


def _fi_w4a16(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **_):
    """Route flashinfer_w4a16's plan, for callers holding FlashInfer's prepared ``(b, sf, alpha)`` of the default
    backend in the w_codes, w_scales and alpha slots.  The vLLM glue calls :func:`flashinfer_w4a16` directly."""
    return flashinfer_w4a16(x, w_codes, w_scales, alpha, bias, w_dec_rows.shape[0], "cute-dsl")


def _gluon(kind):
    def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
        from ..kernels import gluon_gemv

        codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
        tile_cls, launch = {"fma": (gluon_gemv.FmaTile, gluon_gemv.gemv_fma),
                            "mma": (gluon_gemv.MmaTile, gluon_gemv.gemv_mma)}[kind]
        return launch(x, codes, scales, w_dec_rows, bias=bias, tile=tile_cls(**tile))

    return run


LINEAR_KERNELS = {
    "w4a4_triton": _w4a4_triton,
    "w4a4_cublas": _w4a4_cublas,
    "w4a4_b12x": _w4a4_b12x,
    "w4a16_gemv": _w4a16("w4a16_gemv"),
    "w4a16_gemm": _w4a16("w4a16_gemm"),
    "w4a16_dequant_mm": _w4a16_dequant_mm,
    "gluon_gemv_fma": _gluon("fma"),
    "gluon_gemv_mma": _gluon("mma"),
    "fi_w4a16": _fi_w4a16,
}


def _reference(plan: LinearPlan, x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias):
    codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
    if not plan.is_w4a4:
        return linear_w4a16_ref(x, codes, scales, w_dec_rows, bias=bias)
    xq = quantize_nvfp4(x, GlobalScale.from_encode(in_enc))
    acc = (unit_values(*xq) @ unit_values(codes, scales).t()) * alpha.to(torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(x.dtype)


@torch.library.custom_op("nvfp4_sm120::linear", mutates_args=())
def nvfp4_linear(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_dec_rows: torch.Tensor,
    w_scales_swizzled: torch.Tensor | None,
    in_enc: torch.Tensor | None,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    route: str,
) -> torch.Tensor:
    """``x [T, K]`` times the NVFP4 weight; ``w_dec_rows [N]`` fixes N (the codes may be padded by a route).

    ``in_enc``/``alpha`` (device fp32 scalars) are required by the W4A4 plans, unused by the W4A16 ones.
    """
    t, k = x.shape
    plan = select_linear(device_capability(x.device), route, t, w_dec_rows.shape[0], k, device_sm_count(x.device))
    if plan.is_w4a4 and (in_enc is None or alpha is None):
        raise ValueError(f"route {route!r} runs W4A4 at T = {t}: in_enc and alpha are required")
    if x.device.type == "cpu":
        return _reference(plan, x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias)
    return LINEAR_KERNELS[plan.kernel](x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias,
                                       **plan.kwargs)


@nvfp4_linear.register_fake
def _(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route):
    return x.new_empty((x.shape[0], w_dec_rows.shape[0]))


# Route flashinfer_w4a16 has its own op rather than running behind nvfp4_sm120.linear: its weight is FlashInfer's
# prepared layout (cute-dsl repacks the codes), not the codes and scales that op's arguments and CPU reference
# read, and its backend is a load-time choice the dispatch plan does not carry.  There is no CPU path:
# flashinfer_w4a16_linear raises Fp4RouteUnavailable off sm_100/sm_12x (the CPU tests stub FlashInfer).
@torch.library.custom_op("nvfp4_sm120::flashinfer_w4a16", mutates_args=())
def flashinfer_w4a16(
    x: torch.Tensor,
    b: torch.Tensor,
    sf: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    backend: str,
) -> torch.Tensor:
    """``x [T, K] @ dequant(W)^T (+ bias)``, FlashInfer ``mm_bf16_fp4`` on ``prepare_flashinfer_w4a16``'s
    ``(b, sf, alpha)`` for ``backend``; ``n`` is the output size (a repacked ``b`` does not show it plainly)."""
    from ..kernels.fp4_routes import flashinfer_w4a16_linear

    return flashinfer_w4a16_linear(x, (b, sf, alpha), n, backend=backend, bias=bias)


@flashinfer_w4a16.register_fake
def _(x, b, sf, alpha, bias, n, backend):
    return x.new_empty((x.shape[0], n))
