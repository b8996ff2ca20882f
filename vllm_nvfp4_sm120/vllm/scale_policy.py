"""Which weight global scales our linear routes use, from what vLLM leaves on the layer.

By the time a kernel's ``process_weights_after_loading`` runs, vLLM has already merged the per-part globals of a
fused layer (q/k/v, gate/up) into one ``layer.weight_global_scale`` (decode) and deleted the per-part tensor:

* ModelOpt (``weight_scale_2``, decode): ``max`` of the parts, i.e. the largest decode;
* compressed-tensors (``weight_global_scale``, encode): ``1 / max`` of the parts, i.e. the largest *encode* —
  which is the smallest decode.

Policy:

* **W4A4 layers** use exactly vLLM's merged global (and vLLM's ``alpha``), block scales unchanged, so our routes
  compute what every in-tree kernel computes on the same layer.  The small-T W4A16 kernel that a W4A4 route runs
  on the same weight uses that same global, so the layer's output does not jump with the batch size.  When the
  parts differ by more than ``format.SPREAD_WARN_FRACTION``, a load-time warning names the layer and the spread.
* **W4A16 layers** keep each part's own global as a per-row decode tensor (no accuracy loss, nothing to warn).

The per-part globals are captured just before vLLM merges them (:func:`capture_part_globals`, called from the
hooks in :mod:`.register`).  Without a capture (another caller, e.g. the online lm_head) the merged global is used.
"""

from __future__ import annotations

import torch

from ..format import SPREAD_WARN_FRACTION, GlobalScale, per_row_decode
from .log import layer_name, logger

_PARTS_ATTR = "_nvfp4_sm120_part_dec"  # plain attribute: load-time only, deleted once consumed


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
    if hasattr(layer, _PARTS_ATTR):
        delattr(layer, _PARTS_ATTR)
    widths = _logical_widths(layer, n)
    if parts is not None and parts.dec.numel() != len(widths):
        parts = None  # cannot tell which rows belong to which global: use vLLM's merged one
    if parts is not None and w4a4:
        s = parts.spread()
        if s > SPREAD_WARN_FRACTION:
            logger.warning(
                "NVFP4 layer %s: the weight global scales of its %d fused parts differ by %.1f%% (decode %s); "
                "W4A4 uses one global per tensor (%.6g, as vLLM does), which rescales the other parts. "
                "Accuracy may suffer; a checkpoint with a shared global for fused weights avoids it.",
                layer_name(layer), parts.dec.numel(), 100 * s, [f"{v:.6g}" for v in parts.dec.tolist()],
                float(merged),
            )
    return per_row_decode(merged if w4a4 or parts is None else parts.dec.to(merged.device), widths, n)
