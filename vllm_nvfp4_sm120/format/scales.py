"""NVFP4 global scales under the two checkpoint conventions.

An NVFP4 value is ``e2m1(code) * e4m3(block_scale) * global_dec``.  Checkpoints store the per-tensor global in
one of two directions, and mixing them up silently scales a layer by ~(2688/amax)^2:

* **decode** (``dec``), ModelOpt: ``weight_scale_2``, ``input_scale`` = amax / (6 * 448).  Multiply codes by it.
  vLLM's ``layer.weight_global_scale``, ``layer.input_global_scale`` and ``alpha`` are decode scales too.
* **encode** (``enc``), compressed-tensors: ``weight_global_scale``, ``input_global_scale`` = 6 * 448 / amax.
  Quantizers multiply by it (vLLM's ``layer.input_global_scale_inv``, FlashInfer's ``global_sf``).

:class:`GlobalScale` carries both directions and is built only through constructors that name the convention, for
one tensor or for the per-part / per-expert globals a fused or MoE weight keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .e2m1 import E2M1_MAX

E4M3_MAX = 448.0
# amax / NVFP4_AMAX_DIVISOR is the decode global that makes the largest block scale hit the e4m3 maximum.
NVFP4_AMAX_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688
BLOCK_SIZE = 16


# Above this relative spread between the weight globals of a fused layer's parts (q/k/v, gate/up), the single
# per-tensor global a W4A4 kernel applies rescales the other parts enough to be worth a load-time warning.
SPREAD_WARN_FRACTION = 0.05


def _scalar_f32(name: str, value: torch.Tensor | float) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name}: expected one global scale per tensor, got shape {list(t.shape)}")
    t = t.reshape(())
    if not bool(torch.isfinite(t)) or float(t) <= 0:
        raise ValueError(f"{name}: a global scale must be finite and > 0, got {float(t)}")
    return t


def _f32(value: torch.Tensor | float) -> torch.Tensor:
    """Many globals (any shape) as float32, detached from any ``Parameter``; values are not checked here: a
    checkpoint may leave an unused expert at 0, and the callers validate what they reduce."""
    return torch.as_tensor(value, dtype=torch.float32).detach()


@dataclass(frozen=True)
class GlobalScale:
    """NVFP4 global scales, both directions as float32 tensors (``enc == 1 / dec`` in fp32).

    One per tensor (0-d) by default.  ``per_tensor=False`` keeps what a checkpoint stores for a fused or MoE
    weight, one global per part and/or per expert (``[P]``, ``[E]``, ``[E, 2]``), so the caller never inverts a
    convention by hand; :meth:`max`, :meth:`spread` and :func:`per_row_decode` reduce or expand them.
    """

    dec: torch.Tensor
    enc: torch.Tensor

    @classmethod
    def from_decode(
        cls, dec: torch.Tensor | float, name: str = "global decode scale", *, per_tensor: bool = True
    ) -> GlobalScale:
        """ModelOpt ``weight_scale_2`` / ``input_scale``; vLLM's ``weight_global_scale`` / ``input_global_scale``."""
        d = _scalar_f32(name, dec) if per_tensor else _f32(dec)
        return cls(dec=d, enc=(1.0 / d).to(torch.float32))

    @classmethod
    def from_encode(
        cls, enc: torch.Tensor | float, name: str = "global encode scale", *, per_tensor: bool = True
    ) -> GlobalScale:
        """compressed-tensors ``weight_global_scale`` / ``input_global_scale``; vLLM's ``input_global_scale_inv``."""
        e = _scalar_f32(name, enc) if per_tensor else _f32(enc)
        return cls(dec=(1.0 / e).to(torch.float32), enc=e)

    @classmethod
    def from_amax(cls, amax: torch.Tensor | float) -> GlobalScale:
        """The calibration rule both formats use: enc = 6 * 448 / amax.  An all-zero tensor gets 1.0."""
        a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
        if not bool(torch.isfinite(a)):
            raise ValueError(f"amax: must be finite, got {float(a)}")
        if float(a) == 0.0:
            return cls.from_encode(1.0)
        return cls.from_encode((NVFP4_AMAX_DIVISOR / a).to(torch.float32))

    @classmethod
    def of(cls, x: torch.Tensor) -> GlobalScale:
        return cls.from_amax(x.detach().abs().max().to(torch.float32) if x.numel() else 0.0)

    def max(self, name: str = "largest global decode scale") -> GlobalScale:
        """The largest decode (the smallest encode) as one per-tensor global: no part or expert saturates under it
        (ModelOpt's merge of a fused weight's parts; a static activation scale shared by the experts)."""
        return GlobalScale.from_decode(self.dec.max(), name)

    def spread(self) -> float:
        """Relative spread of the decode globals, ``max / min - 1`` (0 for a single one).  Reads values on the host."""
        return float(self.dec.max() / self.dec.min() - 1.0) if self.dec.numel() > 1 else 0.0

    def to(self, device: torch.device | str) -> GlobalScale:
        return GlobalScale(dec=self.dec.to(device), enc=self.enc.to(device))


def per_row_decode(weight_dec: torch.Tensor | float, logical_widths: Sequence[int] | None, n: int) -> torch.Tensor:
    """The contiguous ``[N]`` fp32 decode global of each output row of an ``[N, K]`` weight, from one global, one per
    fused part (qkv, gate_up; ``logical_widths`` rows each) or one per row: what the W4A16 kernels apply."""
    dec = torch.as_tensor(weight_dec, dtype=torch.float32).reshape(-1)
    widths = list(logical_widths) if logical_widths is not None else [n]
    if sum(widths) != n:
        raise ValueError(f"logical_widths: parts {widths} sum to {sum(widths)}, weight has {n} rows")
    if dec.numel() == 1:
        return dec.expand(n).contiguous()
    if dec.numel() == len(widths):
        return torch.repeat_interleave(dec, torch.tensor(widths, device=dec.device))
    if dec.numel() == n:
        return dec.contiguous()
    raise ValueError(f"weight_dec: expected 1, {len(widths)} (one per part) or {n} (one per row) globals, "
                     f"got {dec.numel()}")
