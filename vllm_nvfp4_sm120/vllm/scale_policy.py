"""Which global scales our kernels use, picked from what vLLM leaves on the layer (the math is ``format``'s).

**Linears.**  By the time a kernel's ``process_weights_after_loading`` runs, vLLM has already merged the per-part
globals of a fused layer (q/k/v, gate/up) into one ``layer.weight_global_scale`` (decode) and deleted the per-part
tensor:

* ModelOpt (``weight_scale_2``, decode): ``max`` of the parts, i.e. the largest decode;
* compressed-tensors (``weight_global_scale``, encode): ``1 / max`` of the parts, i.e. the largest *encode* —
  which is the smallest decode.

Policy:

* **W4A4 layers** use exactly vLLM's merged global (and vLLM's ``alpha``), block scales unchanged, so our routes
  compute what every in-tree kernel computes on the same layer.  The small-T W4A16 kernel that a W4A4 route runs
  on the same weight uses that same weight global; what changes with the batch size is the activations'
  precision (bf16/fp16 at decode sizes, NVFP4 above), which moves a row's output by ~9.5 % of its norm per
  linear (``dispatch/policy.py``; ``VLLM_NVFP4_SM120_DECODE=w4a4`` and vLLM's batch-invariant mode keep one
  numerics at every T).  When the
  parts differ by more than ``format.SPREAD_WARN_FRACTION``, a load-time warning names the layer and the spread
  (the first such layer; one summary line counts the others, :func:`.log.warn_layer`).
* **W4A16 layers** keep each part's own global as a per-row decode tensor (no accuracy loss, nothing to warn).

The per-part globals are captured just before vLLM merges them (:func:`capture_part_globals`, called from the
hooks in :mod:`.register`).  Without a capture (another caller, e.g. the online lm_head) the merged global is used.

**MoE experts** (:func:`moe_globals`, as the checkpoint stores them, before vLLM converts anything): the gate_up
GEMM takes one weight global per expert, w1's (as vLLM keeps; :func:`gate_up_weight_dec` warns when w3's differs),
the down GEMM w2's; a W4A4 layer quantizes each GEMM's input with one static *encode* scale from the largest
calibrated decode over the experts, their w1/w3 parts and the expert-parallel ranks (:func:`static_input_enc`).
"""

from __future__ import annotations

import torch

from ..format import SPREAD_WARN_FRACTION, GlobalScale, per_row_decode
from .log import layer_name, warn_layer

_PARTS_ATTR = "_nvfp4_sm120_part_dec"  # plain attribute: load-time only, deleted once consumed
# The two checkpoint formats whose NVFP4 methods the plugin serves (they store the globals in opposite directions).
MODELOPT = "ModelOpt"
COMPRESSED_TENSORS = "compressed-tensors"


def capture_part_globals(layer: torch.nn.Module, *, dec: torch.Tensor | None = None, enc: torch.Tensor | None = None) -> None:
    """Keep a copy of the per-part weight globals (one per fused part) before vLLM merges them."""
    if (dec is None) == (enc is None):
        raise ValueError("capture_part_globals: pass exactly one of dec= (ModelOpt) or enc= (compressed-tensors)")
    parts = (GlobalScale.from_decode(dec, per_tensor=False) if dec is not None
             else GlobalScale.from_encode(enc, per_tensor=False))
    setattr(layer, _PARTS_ATTR, parts.dec.reshape(-1).clone())


def part_globals(layer: torch.nn.Module) -> GlobalScale | None:
    """The captured per-part weight globals ``[P]``, if any."""
    parts = getattr(layer, _PARTS_ATTR, None)
    return None if parts is None else GlobalScale.from_decode(parts, per_tensor=False)


def drop_part_globals(layer: torch.nn.Module) -> None:
    """Forget the captured per-part globals (a layer our kernel hands to another one)."""
    if hasattr(layer, _PARTS_ATTR):
        delattr(layer, _PARTS_ATTR)


def _logical_widths(layer: torch.nn.Module, n: int) -> list[int]:
    widths = list(getattr(layer, "logical_widths", None) or [n])
    return widths if sum(widths) == n else [n]


def weight_dec_rows(layer: torch.nn.Module, *, w4a4: bool) -> torch.Tensor:
    """The ``[N]`` fp32 per-output-row weight decode global the linear op takes (see the module docstring).

    Load-time only (reads scale values on the host to warn).  Consumes the captured per-part globals.
    """
    if not hasattr(layer, "weight_global_scale"):
        raise ValueError(
            f"{layer_name(layer)}: expected layer.weight_global_scale (a 0-d fp32 decode global set by vLLM's NVFP4 "
            "scheme); this layer was not prepared by ModelOpt or compressed-tensors"
        )
    n = layer.weight.shape[0]
    merged = layer.weight_global_scale.detach().to(torch.float32).reshape(())
    parts = part_globals(layer)
    drop_part_globals(layer)
    widths = _logical_widths(layer, n)
    if parts is not None and parts.dec.numel() != len(widths):
        parts = None  # cannot tell which rows belong to which global: use vLLM's merged one
    if parts is not None and w4a4:
        s = parts.spread()
        if s > SPREAD_WARN_FRACTION:
            warn_layer(
                "fused parts with different weight global scales (W4A4 uses one)", layer_name(layer), s,
                f"{100 * s:.1f}%",
                "NVFP4 layer %s: the weight global scales of its %d fused parts differ by %.1f%% (decode %s); "
                "W4A4 uses one global per tensor (%.6g, as vLLM does), which rescales the other parts. "
                "Accuracy may suffer; a checkpoint with a shared global for fused weights avoids it.",
                layer_name(layer), parts.dec.numel(), 100 * s, [f"{v:.6g}" for v in parts.dec.tolist()],
                float(merged),
            )
    return per_row_decode(merged if w4a4 or parts is None else parts.dec.to(merged.device), widths, n)


# ---- MoE experts --------------------------------------------------------------------------------------------------

def moe_globals(layer: torch.nn.Module, fmt: str, *, w4a4: bool):
    """``(w13 [E, 2], w2 [E], a13, a2)`` as :class:`GlobalScale` s, in the direction ``fmt`` stores them: the
    weight globals per expert (and part), the calibrated input globals per expert (None for W4A16 layers)."""
    if fmt == COMPRESSED_TENSORS:  # ENCODE globals (2688 / amax)
        w13 = GlobalScale.from_encode(layer.w13_weight_global_scale, per_tensor=False)
        w2 = GlobalScale.from_encode(layer.w2_weight_global_scale, per_tensor=False)
        a13 = GlobalScale.from_encode(layer.w13_input_global_scale, per_tensor=False) if w4a4 else None
        a2 = GlobalScale.from_encode(layer.w2_input_global_scale, per_tensor=False) if w4a4 else None
    else:  # ModelOpt: DECODE globals (amax / 2688)
        w13 = GlobalScale.from_decode(layer.w13_weight_scale_2, per_tensor=False)
        w2 = GlobalScale.from_decode(layer.w2_weight_scale_2, per_tensor=False)
        a13 = GlobalScale.from_decode(layer.w13_input_scale, per_tensor=False) if w4a4 else None
        a2 = GlobalScale.from_decode(layer.w2_input_scale, per_tensor=False) if w4a4 else None
    return w13, w2, a13, a2


def gate_up_weight_dec(w13: GlobalScale, name: str) -> torch.Tensor:
    """Per-expert gate_up weight decode global ``[E]`` from the ``[E, 2]`` (w1, w3) ones: w1's, as vLLM keeps.

    The kernels scale the gate_up GEMM with one global per expert; a w3 global that differs rescales the up rows.
    vLLM warns once for the whole model; we name the layer and the spread (load time: reads values on the host).
    """
    w1, w3 = w13.dec[:, 0], w13.dec[:, 1]
    if not torch.allclose(w1, w3):
        differ = ~torch.isclose(w1, w3)
        ratio = float((torch.maximum(w1, w3) / torch.minimum(w1, w3))[differ].max())
        warn_layer(
            "MoE gate/up weight global scales that differ (the kernels use w1's)", name, ratio, f"ratio {ratio:.4g}",
            "NVFP4 MoE layer %s: the gate (w1) and up (w3) weight global scales differ for %d of %d experts "
            "(largest ratio %.4g); the kernels use one global per expert, w1's (as vLLM does). "
            "Accuracy may be affected.",
            name, int(differ.sum()), w1.numel(), ratio,
        )
    return w1.contiguous()


def _ep_max(t: torch.Tensor, parallel) -> torch.Tensor:
    """Max across expert-parallel ranks, so every rank quantizes with the same scale (as vLLM's global-sf backends
    do, where each rank sees every expert's scale; and required with EPLB, where experts move between ranks)."""
    if parallel.use_ep and parallel.ep_size > 1:
        from vllm.distributed.parallel_state import get_ep_group

        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=get_ep_group().device_group)
    return t


def static_input_enc(dec: torch.Tensor, name: str, parallel) -> torch.Tensor:
    """One static activation *encode* scale ``[1]`` for a GEMM input from the experts' *decode* scales.

    Max of the decode scales (the largest calibrated amax: no expert's input saturates), over the layer's experts,
    the w1/w3 parts and the expert-parallel ranks (``parallel``: vLLM's ``FusedMoEParallelConfig``).  Load time:
    validated on the host.
    """
    dec_max = _ep_max(dec.detach().to(torch.float32).max().reshape(1), parallel)
    value = float(dec_max)
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"{name}: the static activation scale of the experts must be finite and > 0 (decode amax/2688), "
            f"got max {value}; the checkpoint's input scales are missing or broken"
        )
    return GlobalScale.from_decode(dec_max, name).enc.reshape(1)
