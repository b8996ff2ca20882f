"""The 128x4 swizzled block-scale layout taken by CUTLASS, cuBLAS (``torch._scaled_mm``) and FlashInfer ``mm_fp4``.

Rows are padded to 128 and scale columns to 4 (with zeros).  A 128x4 tile of scales is stored as 512 contiguous
bytes ordered ``[row % 32][(row % 128) // 32][col % 4]``; tiles follow row-tile-major then column-tile.  Scale
``(m, k)`` of a ``[M, Kb]`` matrix lives at byte

    (m // 128) * (ceil(Kb/4) * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)

which is FlashInfer's ``get_sf_out_offset_128x4`` and vLLM's ``swizzle_blockscale``
(``reshape(B, M/128, 4, 32, Kb/4, 4).permute(0, 1, 4, 3, 2, 5)``).  Leading dimensions (MoE experts) are batched.
"""

from __future__ import annotations

import torch

from .checks import check_tensor


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    return round_up(rows, 128), round_up(cols, 4)


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """``[..., M, Kb]`` linear scales → ``[..., round_up(M,128), round_up(Kb,4)]`` swizzled (same dtype)."""
    check_tensor("scales", scales, ndim=(2, 3))
    *lead, m, kb = scales.shape
    mp, kp = swizzled_shape(m, kb)
    batch = scales.shape[0] if lead else 1
    flat = scales.reshape(batch, m, kb)
    padded = flat.new_zeros((flat.shape[0], mp, kp))
    padded[:, :m, :kb] = flat
    if mp == 0 or kp == 0:  # no rows (T = 0) or no scale columns: nothing to interleave
        return padded.reshape(*lead, mp, kp)
    tiles = padded.reshape(-1, mp // 128, 4, 32, kp // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.contiguous().reshape(*lead, mp, kp)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`, cropped to ``[..., rows, cols]``.  Accepts a flat buffer per batch too."""
    mp, kp = swizzled_shape(rows, cols)
    if swizzled.numel() % (mp * kp):
        raise ValueError(
            f"scales: a 128x4-swizzled buffer for [{rows}, {cols}] scales holds a multiple of {mp}x{kp} "
            f"elements, got shape {list(swizzled.shape)}"
        )
    tiles = swizzled.reshape(-1, mp // 128, kp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
    linear = tiles.reshape(-1, mp, kp)[:, :rows, :cols]
    lead = swizzled.shape[:-2] if swizzled.dim() >= 3 else ()
    return linear.reshape(*lead, rows, cols).contiguous()


def swizzled_offset(m: torch.Tensor, k: torch.Tensor, cols: int) -> torch.Tensor:
    """Byte offset of scale ``(m, k)`` in the swizzled buffer of a matrix with ``cols`` scale columns."""
    k_tiles = round_up(cols, 4) // 4
    return (m // 128) * (k_tiles * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)
