"""E2M1 (FP4) codes: value table, rounding, and the nibble packing every NVFP4 tensor uses.

A code is 4 bits ``s e e m``: bit 3 is the sign, the magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Packed tensors hold two codes per byte, **element 2i in the low nibble** and 2i+1 in the high nibble
(vLLM, FlashInfer, ModelOpt, compressed-tensors and Triton's ``dot_scaled`` all agree on this).
"""

from __future__ import annotations

import functools

import torch

from .checks import check_tensor

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Index = code 0..15; codes 8..15 are the negatives (code 8 is -0.0).
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)

# Midpoints between neighbouring magnitudes.  A tie rounds to the *even* code (the one whose mantissa bit is 0),
# as the hardware's cvt.rn.satfinite.e2m1x2 does: ties at 0.25, 1.25, 2.5, 5.0 round down, at 0.75, 1.75, 3.5 up.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.cache
def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    # Cached per device: a host-to-device copy per call would also break CUDA-graph capture.
    return _table(dtype, torch.device(device or "cpu"))


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map codes 0..15 (any integer dtype) to their values."""
    return e2m1_table(dtype, codes.device)[codes.long()]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E2M1 codes (uint8, 0..15): nearest, ties to even, saturating at +-6.

    The sign bit follows ``signbit`` so that small negative values become code 8 (-0), like the hardware.
    """
    if not x.is_floating_point():
        raise TypeError(f"round_to_e2m1: expected a floating-point tensor, got {x.dtype}")
    mag = x.abs().to(torch.float32)
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for k, mid in enumerate(_MIDPOINTS):
        # Between code k and k+1: the tie goes to whichever of the two is even.
        crossed = mag >= mid if k % 2 else mag > mid
        code += crossed.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes → ``[..., K/2]`` uint8, element 2i in the low nibble."""
    check_tensor("codes", codes, dtype=torch.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even to pack two per byte, got {list(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("codes: values must be 4-bit codes 0..15")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` uint8 → ``[..., K]`` codes (uint8)."""
    check_tensor("packed", packed, dtype=torch.uint8)
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
