"""Reference NVFP4 quantization and dequantization (pure torch; CPU or GPU).

NVFP4: 16-element blocks along the last dimension, one e4m3 block scale per block, one fp32 global per tensor.
The float32 operation order follows vLLM's ``ref_nvfp4_quant`` and FlashInfer's ``cvt_warp_fp16_to_fp4`` (with
exact reciprocals), so the codes and scales here are bit-identical to vLLM's emulation:

    block_scale = e4m3(min(enc * (amax16 * (1/6)), 448))           round to nearest even
    code        = e2m1(clamp(x * (1 / (block_scale * (1/enc))), -6, 6))
    value       = e2m1(code) * (block_scale * dec)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import as_e4m3, check_finite, check_tensor
from .e2m1 import E2M1_MAX, decode_e2m1, pack_e2m1, round_to_e2m1, unpack_e2m1
from .scales import BLOCK_SIZE, E4M3_MAX, GlobalScale
from .swizzle import unswizzle_128x4


class NvFp4(NamedTuple):
    """A quantized tensor: packed codes ``[..., K/2]`` uint8 and linear block scales ``[..., K/16]`` e4m3."""

    codes: torch.Tensor
    scales: torch.Tensor


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    # 1/0 -> 0 keeps all-zero blocks at zero instead of 0 * inf = NaN (vLLM's get_reciprocal does the same).
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / x)


def quantize_nvfp4(x: torch.Tensor, global_scale: GlobalScale, *, name: str = "x") -> NvFp4:
    """Quantize ``[..., K]`` (fp32/bf16/fp16, K % 16 == 0) to NVFP4 with the tensor's global scale."""
    check_tensor(name, x, dtype=(torch.float32, torch.bfloat16, torch.float16))
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: last dimension must be a multiple of {BLOCK_SIZE}, got shape {list(x.shape)}")
    check_finite(name, x)
    enc = global_scale.enc.to(x.device)
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = enc * (amax * _reciprocal(torch.tensor(E2M1_MAX, device=x.device)))
    scale = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    elem_scale = _reciprocal(scale.to(torch.float32) * _reciprocal(enc))
    scaled = (blocks * elem_scale).clamp(-E2M1_MAX, E2M1_MAX).reshape(x.shape)
    return NvFp4(pack_e2m1(round_to_e2m1(scaled)), scale.squeeze(-1))


def dequantize_nvfp4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: GlobalScale,
    dtype: torch.dtype = torch.float32,
    *,
    swizzled: bool = False,
) -> torch.Tensor:
    """``[..., K/2]`` codes with ``[..., K/16]`` scales (or the 128x4-swizzled buffer) → ``[..., K]`` values."""
    check_tensor("codes", codes, dtype=torch.uint8)
    scales = as_e4m3("scales", scales)
    lead, k = codes.shape[:-1], codes.shape[-1] * 2
    if k % BLOCK_SIZE:
        raise ValueError(f"codes: K = {k} (2 x last dimension) is not a multiple of {BLOCK_SIZE}")
    if swizzled:
        scales = unswizzle_128x4(scales, rows=lead[-1] if lead else 1, cols=k // BLOCK_SIZE)
    check_tensor("scales", scales, shape=[*lead, k // BLOCK_SIZE])
    values = decode_e2m1(unpack_e2m1(codes)).reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    block = scales.to(torch.float32) * global_scale.dec.to(codes.device)
    return (values * block.unsqueeze(-1)).reshape(*lead, k).to(dtype)


def quant_dequant_nvfp4(x: torch.Tensor, global_scale: GlobalScale, dtype: torch.dtype | None = None) -> torch.Tensor:
    q = quantize_nvfp4(x, global_scale)
    return dequantize_nvfp4(q.codes, q.scales, global_scale, dtype or x.dtype)
