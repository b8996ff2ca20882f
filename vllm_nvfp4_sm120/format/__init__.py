"""Layer 1 — the NVFP4 format: codes, scales, swizzle, global-scale conventions, torch references.

Pure torch, no GPU needed.  Every kernel test compares against :mod:`.reference`.
"""

from .checks import check_finite, check_multiple, check_tensor
from .e2m1 import E2M1_MAX, E2M1_VALUES, decode_e2m1, pack_e2m1, round_to_e2m1, unpack_e2m1
from .quant import NvFp4, dequantize_nvfp4, quant_dequant_nvfp4, quantize_nvfp4
from .reference import (
    gated_activation,
    linear_w4a4_ref,
    linear_w4a16_ref,
    moe_ref,
    topk_route,
    unit_values,
)
from .scales import BLOCK_SIZE, E4M3_MAX, NVFP4_AMAX_DIVISOR, SPREAD_WARN_FRACTION, GlobalScale, per_row_decode
from .testing import LinearProblem, make_linear, make_moe_bank, random_nvfp4
from .swizzle import round_up, swizzle_128x4, swizzled_offset, swizzled_shape, unswizzle_128x4

__all__ = [
    "BLOCK_SIZE", "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "NVFP4_AMAX_DIVISOR", "SPREAD_WARN_FRACTION", "GlobalScale",
    "LinearProblem", "NvFp4", "check_finite", "check_multiple", "check_tensor", "decode_e2m1", "dequantize_nvfp4",
    "gated_activation", "linear_w4a4_ref", "linear_w4a16_ref", "make_linear", "make_moe_bank", "moe_ref",
    "pack_e2m1", "per_row_decode", "quant_dequant_nvfp4", "quantize_nvfp4", "random_nvfp4", "round_to_e2m1",
    "round_up", "swizzle_128x4", "swizzled_offset", "swizzled_shape", "topk_route", "unit_values", "unpack_e2m1",
    "unswizzle_128x4",
]
