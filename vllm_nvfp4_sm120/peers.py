"""Peer kernels timed side by side with ours in the benchmarks.  Never a dependency: each factory returns a
callable ``x -> out`` when the peer is importable and takes the layer, else a one-line reason to print.

gemlite (``gemlite.helper.A16W4_NVFP``, weight-only NVFP4): built from the checkpoint's own tensors, no repack on
our side.  What its source (0.6.x) does with them, and so what we pass:
- ``weight_packed``: our codes ``[N, K/2]`` uint8 as they are (it reads element 2i from the low nibble, as we do;
  ``GemLiteLinearTriton.pack(..., packed=True)`` only takes a transposed view);
- ``scales``: our linear e4m3 block scales ``[N, K/16]`` (``uint8`` is viewed as ``float8_e4m3fn``);
- ``meta_scale``: the **encode** global (``W ~ W_q * scale / meta_scale``; it stores ``1 / meta_scale`` and
  multiplies the accumulator by it), i.e. ``GlobalScale.enc``.  One global per layer: a fused layer whose parts
  have different globals cannot be expressed, and the factory says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .format.checks import check_tensor
from .format.scales import GlobalScale


def _import_gemlite():
    """gemlite's helper class, or the reason it is unavailable (any import failure: not installed, no GPU)."""
    try:
        from gemlite.helper import A16W4_NVFP
    except Exception as e:  # ImportError, or gemlite's import-time CUDA queries failing without a GPU
        return None, f"gemlite not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return A16W4_NVFP, None


def gemlite_nvfp4_linear(codes: torch.Tensor, scales: torch.Tensor, weight_gs: GlobalScale | torch.Tensor, *,
                         dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                         ) -> Callable[[torch.Tensor], torch.Tensor] | str:
    """gemlite's NVFP4 weight-only layer on our weight, or why it cannot be built.

    ``weight_gs``: the layer's one global (a :class:`GlobalScale`), or per-row decode globals ``[N]`` that must all
    be equal (the benchmarks' form); different per-part globals give a reason instead of a wrong layer.
    """
    check_tensor("codes", codes, dtype=torch.uint8, ndim=2)
    n, half_k = codes.shape
    check_tensor("scales", scales, dtype=(torch.float8_e4m3fn, torch.uint8), shape=[n, half_k // 8])
    if isinstance(weight_gs, torch.Tensor):
        check_tensor("weight_gs", weight_gs, dtype=torch.float32, shape=[n])
        if n and not bool((weight_gs == weight_gs[0]).all()):
            return "gemlite: one global per layer; this weight has different per-part globals"
        weight_gs = GlobalScale.from_decode(weight_gs[0] if n else torch.tensor(1.0))
    a16w4_nvfp, reason = _import_gemlite()
    if reason:
        return reason
    helper = a16w4_nvfp(device=codes.device, dtype=dtype)
    layer = helper.from_packed_weights(codes, scales=scales, meta_scale=weight_gs.enc.to(codes.device),
                                       bias=bias)
    return layer
