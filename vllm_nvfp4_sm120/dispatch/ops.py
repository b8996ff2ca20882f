"""The torch custom ops the vLLM glue calls: opaque to ``torch.compile``, capturable in CUDA graphs.

``torch.ops.nvfp4_sm120.linear`` picks a plan per call from :mod:`.linear` (branching on T happens inside the
op, where it is a plain int) and runs the ready launcher :func:`.registry.prepare_linear` builds for it; both are
cached per call signature (:mod:`.linear_call`), so a call with a known signature costs a dict lookup and the
launch.  It has a fake implementation for tracing.  On CPU tensors it computes the torch reference of the plan an
sm_120 GPU would run, so the glue's CPU tests see the numerics of the kernel that would run there; the checks are
the same on both devices.
``torch.ops.nvfp4_sm120.flashinfer_w4a16`` serves the named comparison route of that name, on FlashInfer's
prepared weight (see there).

Both are registered the way vLLM registers its own ops (:mod:`.oplib`): ``torch.library.custom_op``'s per-call
wrapper costs more host time than a small kernel's launch.
"""

from __future__ import annotations

import torch

from . import linear_call
from .oplib import register_op
from .registry import run_flashinfer_w4a16


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
    return linear_call.linear(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route)


def _linear_fake(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route):
    return x.new_empty((x.shape[0], w_dec_rows.shape[0]))


linear = register_op("linear", nvfp4_linear, _linear_fake)


# Route flashinfer_w4a16 has its own op rather than running behind nvfp4_sm120.linear: its weight is FlashInfer's
# prepared layout (cute-dsl repacks the codes), not the codes and scales that op's arguments and CPU reference
# read, and its backend is a load-time choice the dispatch plan does not carry.  There is no CPU path:
# flashinfer_w4a16_linear raises Fp4RouteUnavailable off CUDA (the CPU tests stub FlashInfer).
def _flashinfer_w4a16(
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


def _flashinfer_w4a16_fake(x, b, sf, alpha, bias, n, backend):
    return x.new_empty((x.shape[0], n))


flashinfer_w4a16 = register_op("flashinfer_w4a16", _flashinfer_w4a16, _flashinfer_w4a16_fake)
