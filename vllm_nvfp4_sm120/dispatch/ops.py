"""The torch custom ops the vLLM glue calls: opaque to ``torch.compile``, capturable in CUDA graphs.

``torch.ops.nvfp4_sm120.linear`` picks a plan per call from :mod:`.linear` (branching on T happens inside the
op, where it is a plain int) and runs it with the launcher :data:`.registry.LINEAR_KERNELS` names for it; it has a
fake implementation for tracing.  On CPU tensors it computes the torch reference of the plan an sm_120 GPU would
run, so the glue's CPU tests see the numerics of the kernel that would run there.
``torch.ops.nvfp4_sm120.flashinfer_w4a16`` serves the named comparison route of that name, on FlashInfer's
prepared weight (see there).
"""

from __future__ import annotations

import torch

from ..format import GlobalScale, linear_w4a16_ref, quantize_nvfp4, unit_values
from .hw import SM120_REFERENCE, capability_of
from .linear import LinearPlan, select_linear
from .policy import current_policy
from .registry import LINEAR_KERNELS, run_flashinfer_w4a16


def _reference(plan: LinearPlan, x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias):
    n, k = w_dec_rows.shape[0], x.shape[1]
    codes, scales = w_codes[:n, : k // 2], w_scales[:n, : k // 16]  # a route may have padded the weight
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
    cap = capability_of(x.device) if x.device.type == "cuda" else SM120_REFERENCE
    plan = select_linear(cap, route, t, w_dec_rows.shape[0], k)
    if plan.is_w4a4 and (in_enc is None or alpha is None):
        raise ValueError(f"route {route!r} runs W4A4 at T = {t}: in_enc and alpha are required")
    if x.device.type == "cpu":
        if current_policy().batch_invariant and t > 1:
            # The CPU matmul picks its kernel by M (rows differ in the last bits between T = 1 and T = 16): one
            # row at a time, as the batch-invariant GPU plan computes each row independently of the others.
            return torch.cat([_reference(plan, x[i:i + 1], w_codes, w_scales, w_dec_rows, in_enc, alpha, bias)
                              for i in range(t)])
        return _reference(plan, x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias)
    return LINEAR_KERNELS[plan.kernel](x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias,
                                       **plan.kwargs)


@nvfp4_linear.register_fake
def _(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route):
    return x.new_empty((x.shape[0], w_dec_rows.shape[0]))


# Route flashinfer_w4a16 has its own op rather than running behind nvfp4_sm120.linear: its weight is FlashInfer's
# prepared layout (cute-dsl repacks the codes), not the codes and scales that op's arguments and CPU reference
# read, and its backend is a load-time choice the dispatch plan does not carry.  There is no CPU path:
# flashinfer_w4a16_linear raises Fp4RouteUnavailable off CUDA (the CPU tests stub FlashInfer).
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
    return run_flashinfer_w4a16(x, b, sf, alpha, bias, n, backend)


@flashinfer_w4a16.register_fake
def _(x, b, sf, alpha, bias, n, backend):
    return x.new_empty((x.shape[0], n))
