"""``torch.ops.nvfp4_sm120.moe``: the NVFP4 MoE layer flow as a torch custom op (what the vLLM experts class calls).

vLLM runs the model under ``torch.compile`` and CUDA graphs.  As a custom op, the layer flow is opaque to Dynamo
(its kernel selection branches on shapes inside the op, where they are plain ints) and has a fake implementation
for tracing.  The op writes the layer output into ``out`` (the buffer vLLM's modular kernel hands its experts), so
nothing is allocated for the result and there is no extra copy.  Everything it allocates inside is sized from shapes
and it never reads a device value on the host (see ``dispatch/moe_flow.py``): it can be captured in a CUDA graph.

Registered the way vLLM registers its own ops (``dispatch/oplib.py``).  On CPU tensors it computes
``format.moe_ref`` in the form the dispatch plan selects, so the glue's CPU tests see the numerics of the kernels
that would run.
"""

from __future__ import annotations

import torch

from .moe_flow import ACTIVATIONS, nvfp4_moe
from .oplib import register_op

__all__ = ["ACTIVATIONS", "moe"]


def _moe(
    x: torch.Tensor,
    w13_codes: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_dec: torch.Tensor,
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_dec: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    a13_enc: torch.Tensor | None,
    a2_enc: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    deterministic: bool,
    out: torch.Tensor,
) -> None:
    """``out [T, H] = sum_k topk_weights * down(act(gate) * up)`` over the routed experts (see ``nvfp4_moe``).

    ``a13_enc`` / ``a2_enc``: one-element fp32 *encode* activation scales (W4A4 checkpoints; the plan quantizes
    activations from a few tokens per expert on), both ``None`` for W4A16.  ``expert_map [global_E]`` maps global
    expert ids to local ones (-1: another rank's expert).
    """
    nvfp4_moe(
        x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
        a13_enc=a13_enc, a2_enc=a2_enc, expert_map=expert_map, activation=activation,
        deterministic=deterministic, out=out,
    )


def _moe_fake(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc,
              a2_enc, expert_map, activation, deterministic, out):
    # The result lives in ``out``; nothing to allocate or describe.
    return None


# Registered the way vLLM registers its own ops (see oplib): no per-call custom_op wrapper.
moe = register_op("moe", _moe, _moe_fake, mutates_args=("out",))
