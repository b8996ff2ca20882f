"""E2M1 and E4M3 decodes shared by the Triton kernels.

``e2m1_to_f32`` / ``e4m3_to_f32`` are pure ``tl`` arithmetic: they run in the interpreter and on any GPU, and
are exact.  They are the portable replacement for the sm_120 FP4 MMA (the "emulated" path the H200 runs):
e2m1 x e4m3 products fit fp16/bf16 exactly, so decode + 16-bit MMA with fp32 accumulation gives the same sums
as the block-scaled MMA up to fp32 summation order.
"""

import triton
import triton.language as tl


@triton.jit
def e2m1_to_f32(code):
    """4-bit code (int32, 0..15; bit 3 = sign) → fp32 value."""
    s = (code >> 3) & 1
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(s == 1, -mag, mag)


@triton.jit
def e4m3_to_f32(bits):
    """float8_e4m3fn byte (int32, 0..255) → fp32 (the NaN code 0x7F/0xFF is not a valid block scale)."""
    s = (bits >> 7) & 1
    e = (bits >> 3) & 15
    m = (bits & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where(s == 1, -mag, mag)


@triton.jit
def unpack_rows_f32(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS, COLS/2]`` packed bytes → ``[ROWS, COLS]`` fp32, element 2i from the low nibble."""
    p = packed.to(tl.int32)
    return tl.join(e2m1_to_f32(p & 15), e2m1_to_f32(p >> 4)).reshape(ROWS, COLS)


@triton.jit
def expand_scales_f32(sf, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS, COLS/16]`` e4m3 bytes → ``[ROWS, COLS]`` fp32, each scale repeated over its 16 elements."""
    s = e4m3_to_f32(sf.to(tl.int32))
    return tl.broadcast_to(s[:, :, None], (ROWS, COLS // 16, 16)).reshape(ROWS, COLS)
