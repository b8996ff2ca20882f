"""NVFP4 global scales under the two checkpoint conventions.

An NVFP4 value is ``e2m1(code) * e4m3(block_scale) * global_dec``.  Checkpoints store the per-tensor global in
one of two directions, and mixing them up silently scales a layer by ~(2688/amax)^2:

* **decode** (``dec``), ModelOpt: ``weight_scale_2``, ``input_scale`` = amax / (6 * 448).  Multiply codes by it.
  vLLM's ``layer.weight_global_scale``, ``layer.input_global_scale`` and ``alpha`` are decode scales too.
* **encode** (``enc``), compressed-tensors: ``weight_global_scale``, ``input_global_scale`` = 6 * 448 / amax.
  Quantizers multiply by it (vLLM's ``layer.input_global_scale_inv``, FlashInfer's ``global_sf``).

:class:`GlobalScale` carries both directions and is built only through constructors that name the convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .e2m1 import E2M1_MAX

E4M3_MAX = 448.0
# amax / NVFP4_AMAX_DIVISOR is the decode global that makes the largest block scale hit the e4m3 maximum.
NVFP4_AMAX_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688
BLOCK_SIZE = 16


def _scalar_f32(name: str, value: torch.Tensor | float) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name}: expected one global scale per tensor, got shape {list(t.shape)}")
    t = t.reshape(())
    if not bool(torch.isfinite(t)) or float(t) <= 0:
        raise ValueError(f"{name}: a global scale must be finite and > 0, got {float(t)}")
    return t


@dataclass(frozen=True)
class GlobalScale:
    """One per-tensor NVFP4 global scale, both directions as float32 0-d tensors (``enc == 1 / dec`` in fp32)."""

    dec: torch.Tensor
    enc: torch.Tensor

    @classmethod
    def from_decode(cls, dec: torch.Tensor | float, name: str = "global decode scale") -> GlobalScale:
        """ModelOpt ``weight_scale_2`` / ``input_scale``; vLLM's ``weight_global_scale`` / ``input_global_scale``."""
        d = _scalar_f32(name, dec)
        return cls(dec=d, enc=(1.0 / d).to(torch.float32))

    @classmethod
    def from_encode(cls, enc: torch.Tensor | float, name: str = "global encode scale") -> GlobalScale:
        """compressed-tensors ``weight_global_scale`` / ``input_global_scale``; vLLM's ``input_global_scale_inv``."""
        e = _scalar_f32(name, enc)
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

    def to(self, device: torch.device | str) -> GlobalScale:
        return GlobalScale(dec=self.dec.to(device), enc=self.enc.to(device))
