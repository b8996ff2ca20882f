"""Vendor NVFP4 GEMM routes for sm_120: cuBLAS (``torch._scaled_mm``), FlashInfer ``b12x`` and FlashInfer W4A16.

None of these can run on the CPU or on the H200 (sm_90): cuBLAS block-scaled FP4 needs sm_100/sm_120, b12x and
``cute-dsl-native`` are sm_120/121 kernels.  Which GPU, toolkit and shape a route can serve is the dispatch's
question (``dispatch/vendor.py``, one requirement function per backend, asked at load time and before each run).
Each route here has

* a **load-time preparation** of the checkpoint weight (the codes stay the checkpoint's own tensor unless the
  route must pad them; only the *scales* get a swizzled copy), testable on the CPU;
* a **run** function that checks its arguments and raises :class:`Fp4RouteUnavailable` for tensors that are not
  on a CUDA device.

Only our activation quantizer is a Triton kernel here (its tile comes from the dispatch).  FlashInfer is imported
lazily (it is optional).
Global scales: ``in_enc`` is the input ENCODE global (vLLM ``input_global_scale_inv``), ``alpha`` the product of
the input and weight DECODE globals (vLLM ``layer.alpha``); both are device fp32 tensors with one element.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..format.checks import ACT_DTYPES, as_e4m3, check_tensor
from ..format.swizzle import round_up, swizzle_128x4, swizzled_shape
from .act_quant import quantize_act_nvfp4

# What vLLM pads every FlashInfer NVFP4 GEMM weight to (pad_nvfp4_weight_for_cutlass): N and K multiples of 32.
B12X_ALIGN = 32
W4A16_BACKENDS = ("cute-dsl", "cudnn", "cute-dsl-native")
OUT_DTYPES = (torch.bfloat16, torch.float16)


class Fp4RouteUnavailable(RuntimeError):
    """The route cannot run here (GPU, toolkit, FlashInfer); the message says why and what it needs."""


def require_cuda(route: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise Fp4RouteUnavailable(f"{route}: needs CUDA tensors, got a tensor on {t.device}")


def _check_alpha(alpha: torch.Tensor, device: torch.device) -> None:
    check_tensor("alpha", alpha, dtype=torch.float32, device=device)
    if alpha.numel() != 1:
        raise ValueError(
            f"alpha: expected one fp32 value (input decode x weight decode), got shape {list(alpha.shape)}"
        )


def _check_weight(w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    check_tensor("w_codes", w_codes, dtype=torch.uint8, ndim=2)
    n, k = w_codes.shape[0], 2 * w_codes.shape[1]
    if k % 16:
        raise ValueError(f"w_codes: K = {k} (2 x last dimension) is not a multiple of 16")
    w_scales = as_e4m3("w_scales", w_scales)
    check_tensor("w_scales", w_scales, shape=[n, k // 16])
    return n, k, w_scales


# ---------------------------------------------------------------------------------------------------------------
# cuBLAS: torch._scaled_mm on float4_e2m1fn_x2


def prepare_cublas_weight(w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Load time: the codes as they are, the scales swizzled to 128x4 (e4m3, zero padded)."""
    _, _, w_scales = _check_weight(w_codes, w_scales)
    return w_codes, swizzle_128x4(w_scales)


@functools.cache
def _unit_global(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def scaled_mm_nvfp4(
    a_codes: torch.Tensor,
    a_scales_swizzled: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales_swizzled: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    fused_alpha: bool = True,
) -> torch.Tensor:
    """``alpha * (A @ W^T) (+ bias)`` with cuBLAS: A ``[M, K/2]``, W ``[N, K/2]`` codes, 128x4-swizzled e4m3 scales.

    ``fused_alpha``: torch's two-level NVFP4 recipe (block scales + one global per operand; torch multiplies the
    two globals on the device and cuBLAS applies the product in its epilogue, one rounding like the reference).
    ``fused_alpha=False`` is vLLM's TorchNvFp4LinearKernel: single-level ``_scaled_mm`` then ``out * alpha``.
    """
    check_tensor("a_codes", a_codes, dtype=torch.uint8, ndim=2)
    check_tensor("w_codes", w_codes, dtype=torch.uint8, ndim=2, device=a_codes.device)
    m, kh = a_codes.shape
    n = w_codes.shape[0]
    check_tensor("w_codes", w_codes, shape=[n, kh])
    if not a_codes.is_contiguous() or not w_codes.is_contiguous():
        raise ValueError("a_codes, w_codes: torch._scaled_mm needs contiguous row-major FP4 codes")
    kb = 2 * kh // 16
    for name, sf, rows in (("a_scales_swizzled", a_scales_swizzled, m), ("w_scales_swizzled", w_scales_swizzled, n)):
        sf = as_e4m3(name, sf)
        check_tensor(f"{name} (128x4-swizzled e4m3 scales)", sf, shape=list(swizzled_shape(rows, kb)),
                     device=a_codes.device)
        if not sf.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, got strides {sf.stride()}")
    _check_alpha(alpha, a_codes.device)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected bfloat16 or float16, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, dtype=out_dtype, shape=[n], device=a_codes.device)
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a_codes.device)
    require_cuda("cublas", a_codes)

    a = a_codes.view(torch.float4_e2m1fn_x2)
    b = w_codes.view(torch.float4_e2m1fn_x2).t()  # [K/2, N] column-major, as _scaled_mm wants
    sa = as_e4m3("a_scales_swizzled", a_scales_swizzled)
    sb = as_e4m3("w_scales_swizzled", w_scales_swizzled)
    if fused_alpha:
        return F.scaled_mm(
            a, b,
            [sa, alpha.reshape(1)], [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
            [sb, _unit_global(a_codes.device)], [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
            swizzle_a=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
            swizzle_b=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
            bias=bias, output_dtype=out_dtype,
        )
    out = torch._scaled_mm(a, b, scale_a=sa.reshape(-1), scale_b=sb.reshape(-1), out_dtype=out_dtype)
    out = out * alpha
    return out if bias is None else out + bias


def cublas_linear(x, in_enc, w_codes, w_scales_swizzled, alpha, *, quant_tile: dict, bias=None,
                  fused_alpha: bool = True):
    """The whole cublas route: our activation quant (swizzled scales, on ``quant_tile``) + :func:`scaled_mm_nvfp4`;
    out is x.dtype."""
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2)
    a_codes, a_sf = quantize_act_nvfp4(x, in_enc, swizzled=True, **quant_tile)
    return scaled_mm_nvfp4(a_codes, a_sf, w_codes, w_scales_swizzled, alpha, x.dtype, bias, fused_alpha=fused_alpha)


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer


def flashinfer():
    """The ``flashinfer`` module; :class:`Fp4RouteUnavailable` saying why when it cannot be imported."""
    try:
        import flashinfer
    except Exception as err:  # ImportError, or a broken install raising at import
        raise Fp4RouteUnavailable(f"flashinfer is not importable: {type(err).__name__}: {err}") from err
    return flashinfer


def prepare_b12x_weight(w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Load time: codes padded with zeros to N, K multiples of 32 (the same tensor when already aligned, so the
    padded copy *replaces* the checkpoint's), scales swizzled to 128x4 (their padding covers the padded N and K).
    """
    n, k, w_scales = _check_weight(w_codes, w_scales)
    pad_n, pad_k = round_up(n, B12X_ALIGN) - n, round_up(k, B12X_ALIGN) - k
    if pad_n or pad_k:
        w_codes = F.pad(w_codes, (0, pad_k // 2, 0, pad_n)).contiguous()
    return w_codes, swizzle_128x4(w_scales)


def b12x_linear(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales_swizzled: torch.Tensor,
    in_enc: torch.Tensor,
    alpha: torch.Tensor,
    n: int,
    *,
    quant_tile: dict,
    bias: torch.Tensor | None = None,
    quantizer: str = "ours",
) -> torch.Tensor:
    """``alpha * (quant(x) @ W^T) (+ bias)`` via ``mm_fp4(backend="b12x")`` on a :func:`prepare_b12x_weight` weight.

    ``n``: the layer's real output size (the weight may be padded).  ``quantizer``: "ours"
    (:func:`quantize_act_nvfp4` on ``quant_tile``) or "flashinfer" (``fp4_quantize`` with ``nvfp4_4over6=None``).
    The bias is added to the bf16/fp16 output (mm_fp4 has no bias epilogue): one more rounding than the reference.
    """
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, k = x.shape
    check_tensor("w_codes", w_codes, dtype=torch.uint8, ndim=2, device=x.device)
    n_pad, k_pad = w_codes.shape[0], 2 * w_codes.shape[1]
    if k_pad != round_up(k, B12X_ALIGN) or n_pad != round_up(n, B12X_ALIGN):
        raise ValueError(
            f"w_codes: expected the prepare_b12x_weight layout [{round_up(n, B12X_ALIGN)}, "
            f"{round_up(k, B12X_ALIGN) // 2}] for N = {n}, K = {k}, got {list(w_codes.shape)}"
        )
    sf = as_e4m3("w_scales_swizzled", w_scales_swizzled)
    check_tensor("w_scales_swizzled (128x4-swizzled e4m3 scales)", sf, shape=list(swizzled_shape(n, k // 16)),
                 device=x.device)
    _check_alpha(alpha, x.device)
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, shape=[n], device=x.device)
    if quantizer not in ("ours", "flashinfer"):
        raise ValueError(f"quantizer: expected 'ours' or 'flashinfer', got {quantizer!r}")
    if t == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    require_cuda("b12x", x)
    fi = flashinfer()

    if quantizer == "ours":
        # A K-padded code buffer gets its zero bytes from torch.zeros (no host sync; CUDA-graph safe).
        codes = torch.zeros((t, k_pad // 2), dtype=torch.uint8, device=x.device) if k_pad != k else None
        view = codes[:, : k // 2] if codes is not None else None
        a_codes, a_sf = quantize_act_nvfp4(x, in_enc, swizzled=True, out_codes=view, **quant_tile)
        a_codes = codes if codes is not None else a_codes
    else:
        a_codes, a_sf = fi.fp4_quantize(x, in_enc, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                                        nvfp4_4over6=None)
        if k_pad != k:
            a_codes = F.pad(a_codes, (0, (k_pad - k) // 2))
    out = fi.mm_fp4(a_codes, w_codes.t(), a_sf, sf.t(), alpha.reshape(1), x.dtype, backend="b12x")
    if n_pad != n:
        out = out[:, :n].contiguous()
    return out if bias is None else out + bias


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer W4A16: mm_bf16_fp4 (a named comparison option: cute-dsl repacks the weight at load)


def prepare_flashinfer_w4a16(
    w_codes: torch.Tensor, w_scales: torch.Tensor, weight_dec: torch.Tensor, *, backend: str = "cute-dsl"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Load time: ``prepare_bf16_fp4_weights(codes, swizzled scales, weight decode global, backend)``.

    ``cute-dsl`` and ``cudnn`` return a repacked copy (so this route is a named option, not a default);
    ``cute-dsl-native`` returns the inputs.  Runs on the GPU (FlashInfer reads the device's capability).
    """
    _, _, w_scales = _check_weight(w_codes, w_scales)
    check_tensor("weight_dec", weight_dec, dtype=torch.float32, device=w_codes.device)
    if weight_dec.numel() != 1:
        raise ValueError(f"weight_dec: one decode global per weight (got {weight_dec.numel()}); fused parts with "
                         "different globals need the W4A16 kernel, which applies each part's own")
    if backend not in W4A16_BACKENDS:
        raise ValueError(f"backend: expected one of {W4A16_BACKENDS}, got {backend!r}")
    return flashinfer().prepare_bf16_fp4_weights(w_codes.contiguous(), swizzle_128x4(w_scales), weight_dec.reshape(1),
                                       backend=backend)


def flashinfer_w4a16_linear(x, prepared, n: int, *, backend: str = "cute-dsl", bias=None) -> torch.Tensor:
    """``x @ dequant(W)^T (+ bias)`` via ``mm_bf16_fp4`` on a :func:`prepare_flashinfer_w4a16` result."""
    check_tensor("x", x, dtype=torch.bfloat16, ndim=2, last_dim_contiguous=True)
    b, sf, alpha = prepared
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, shape=[n], device=x.device)
    if x.shape[0] == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    require_cuda(f"flashinfer_w4a16[{backend}]", x)
    out = flashinfer().mm_bf16_fp4(x.contiguous(), b, sf, alpha, backend=backend, out_dtype=x.dtype)
    return out if bias is None else out + bias
