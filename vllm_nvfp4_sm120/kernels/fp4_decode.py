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


# ---------------------------------------------------------------------------------------------------------------
# Fast 16-bit decode: packed bytes → bf16/fp16 pairs with a few lop3/prmt per 4 bytes (inline PTX, sm_80+).
#
# The CUDA cores, not DRAM, limit a weight-streaming kernel if every nibble goes through the arithmetic decode
# above (~10 instructions per element).  The e2m1 magnitudes have only 8 values, so a byte-permute (prmt) with
# the 16-bit encodings packed into its two source registers looks up 4 nibbles at once; the sign bit is OR-ed in
# separately.  Triton's own FP4 → bf16 lowering (``FP4ToBP16Ptx``) uses the same table; it is bit-exact for all
# 256 bytes (tests/kernels/test_fp4_decode.py).  Inline asm cannot run in the interpreter: kernels select it with
# a ``FAST_DECODE`` constexpr and fall back to the pure-``tl`` decode above.
#
# Calling convention (``pack=4``): 4 input bytes arrive in ``$4``; output ``$i`` is a 32-bit word holding byte i's
# two values, the low nibble (even element) in the low 16 bits.
# ---------------------------------------------------------------------------------------------------------------

# bf16 encodings of |e2m1| 0, .5, 1, 1.5, 2, 3, 4, 6 are 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0: the low bytes
# (00 00 80 C0 00 40 80 C0) and the high bytes (00 3F 3F 3F 40 40 40 40) are each one 8-entry prmt table.
_E2M1_TO_BF16X2_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 a<13>;\n"
    "and.b32 a0, $4, 0x88888888;\n"  # sign bits
    "shr.u32 a1, a0, 3;\n"  # signs of nibbles 0..3 as prmt selectors (0 or 1)
    "and.b32 a2, $4, 0x77777777;\n"  # magnitudes of nibbles 0..3 as selectors (0..7)
    "shr.u32 a3, a2, 16;\n"  # magnitudes of nibbles 4..7
    "shr.u32 a4, a0, 19;\n"  # signs of nibbles 4..7
    "prmt.b32 a5, 0xC0800000, 0xC0804000, a2;\n"  # low bytes of bf16(|v|), nibbles 0..3
    "prmt.b32 a6, 0xC0800000, 0xC0804000, a3;\n"
    "prmt.b32 a7, 0x3F3F3F00, 0x40404040, a2;\n"  # high bytes, nibbles 0..3
    "prmt.b32 a8, 0x3F3F3F00, 0x40404040, a3;\n"
    "prmt.b32 a9, 0x8000, 0, a1;\n"  # 0x80 where the sign is set
    "prmt.b32 a10, 0x8000, 0, a4;\n"
    "or.b32 a11, a7, a9;\n"
    "or.b32 a12, a8, a10;\n"
    "prmt.b32 $0, a5, a11, 0x5140;\n"  # interleave low/high bytes into bf16x2 per input byte
    "prmt.b32 $1, a5, a11, 0x7362;\n"
    "prmt.b32 $2, a6, a12, 0x5140;\n"
    "prmt.b32 $3, a6, a12, 0x7362;\n"
    "}"
)

# fp16 encodings of |e2m1| are 0x0000 3800 3C00 3E00 4000 4200 4400 4600: the low byte is always zero, so one
# table gives the high byte and the final prmt puts a zero byte under it.
_E2M1_TO_F16X2_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 a<9>;\n"
    "and.b32 a0, $4, 0x88888888;\n"
    "shr.u32 a1, a0, 3;\n"
    "and.b32 a2, $4, 0x77777777;\n"
    "shr.u32 a3, a2, 16;\n"
    "shr.u32 a4, a0, 19;\n"
    "prmt.b32 a5, 0x3E3C3800, 0x46444240, a2;\n"  # high bytes of fp16(|v|), nibbles 0..3
    "prmt.b32 a6, 0x3E3C3800, 0x46444240, a3;\n"
    "prmt.b32 a7, 0x8000, 0, a1;\n"
    "prmt.b32 a8, 0x8000, 0, a4;\n"
    "or.b32 a5, a5, a7;\n"
    "or.b32 a6, a6, a8;\n"
    "prmt.b32 $0, a5, 0, 0x1404;\n"  # bytes (0, hi(n0), 0, hi(n1))
    "prmt.b32 $1, a5, 0, 0x3424;\n"
    "prmt.b32 $2, a6, 0, 0x1404;\n"
    "prmt.b32 $3, a6, 0, 0x3424;\n"
    "}"
)


@triton.jit
def e2m1x2_to_16bit_fast(packed, DTYPE: tl.constexpr):
    """uint8 bytes → (low-nibble value, high-nibble value), two ``DTYPE`` (bf16/fp16) tensors of the same shape.

    Inline PTX: GPU only (sm_80+); bit-exact against :func:`e2m1x2_to_16bit_ref`.
    """
    if DTYPE == tl.bfloat16:
        pairs = tl.inline_asm_elementwise(
            _E2M1_TO_BF16X2_PTX, "=r,=r,=r,=r,r", [packed], dtype=tl.int32, is_pure=True, pack=4
        )
    else:
        tl.static_assert(DTYPE == tl.float16, "e2m1x2_to_16bit_fast: DTYPE must be bf16 or fp16")
        pairs = tl.inline_asm_elementwise(
            _E2M1_TO_F16X2_PTX, "=r,=r,=r,=r,r", [packed], dtype=tl.int32, is_pure=True, pack=4
        )
    lo = pairs.to(tl.int16).to(DTYPE, bitcast=True)  # truncation keeps the low 16 bits
    hi = (pairs >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return lo, hi


@triton.jit
def e2m1x2_to_16bit_ref(packed, DTYPE: tl.constexpr):
    """Pure-``tl`` twin of :func:`e2m1x2_to_16bit_fast` (interpreter, any GPU): exact, e2m1 fits bf16 and fp16."""
    p = packed.to(tl.int32)
    return e2m1_to_f32(p & 15).to(DTYPE), e2m1_to_f32(p >> 4).to(DTYPE)


@triton.jit
def e2m1x2_to_16bit(packed, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """``FAST``: the inline-PTX table; otherwise the pure-``tl`` decode.  Same bits either way."""
    if FAST:
        lo, hi = e2m1x2_to_16bit_fast(packed, DTYPE)
    else:
        lo, hi = e2m1x2_to_16bit_ref(packed, DTYPE)
    return lo, hi


@triton.jit
def e4m3_to_16bit(bits, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """e4m3 block-scale bytes (uint8) → ``DTYPE``; exact in bf16 and fp16 (2^-9 .. 448).

    ``FAST`` uses the hardware fp8 conversion (sm_89+ ``cvt.*.e4m3x2``), otherwise :func:`e4m3_to_f32`.
    """
    if FAST:
        v = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)
    else:
        v = e4m3_to_f32(bits.to(tl.int32)).to(DTYPE)
    return v


@triton.jit
def dequant_rows_16bit(codes, sf, ROWS: tl.constexpr, COLS: tl.constexpr, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """``[ROWS, COLS/2]`` packed codes and ``[ROWS, COLS/16]`` e4m3 scale bytes → ``[ROWS, COLS]`` ``DTYPE``.

    ``e2m1 * e4m3`` without the global: exact in bf16 and fp16 (at most 5 significant bits, 2^-10 .. 2688), so
    a 16-bit MMA on it with fp32 accumulation computes exactly what the block-scaled FP4 MMA would.  The
    multiply happens on ``[ROWS, COLS/16, 8]`` so each scale broadcasts over its 8 bytes without a reshuffle.
    """
    lo, hi = e2m1x2_to_16bit(codes.reshape(ROWS, COLS // 16, 8), DTYPE, FAST)
    s = e4m3_to_16bit(sf, DTYPE, FAST)[:, :, None]
    return tl.join(lo * s, hi * s).reshape(ROWS, COLS)


# ---------------------------------------------------------------------------------------------------------------
# The shift decode (inline PTX bodies: one 32-bit code word in $4 -> four 16-bit pairs in d0..d3, scratch q)
# ---------------------------------------------------------------------------------------------------------------
# Fewer integer instructions than the lop3/prmt table (13 per word for bf16 instead of 22) at the price of the pair
# order: register j holds elements j and j + 4 of the word, so the other MMA operand is permuted to match.
# bf16: the magnitude bits (e1 e0 m) of nibble i go to bits 8..6 of a 16-bit half and its sign to bit 15; the
# half is then the e2m1 value times 2^-126 (exponent field e, mantissa m/2; e = 0 gives the bf16 subnormal m/2 *
# 2^-126).  Register j takes nibbles j (low half) and j + 4 (high half).  A nibble masked out of the word and
# multiplied by 2^a + 2^b lands as two copies 6 bits apart (no carries: the copies do not overlap), one supplying
# the magnitude and one the sign, and a final mask keeps those bits.  Nibbles 2, 3, 6, 7 are first moved down a
# byte (mul.hi by 2^24: a right shift on the multiplier pipe).
SHIFT_BF16_BODY = (
    "mul.hi.u32 q, $4, 0x1000000; "
    "and.b32 d0, $4, 0x000F000F; and.b32 d1, $4, 0x00F000F0; "
    "and.b32 d2, q, 0x000F000F; and.b32 d3, q, 0x00F000F0; "
    "mul.lo.u32 d0, d0, 0x1040; mul.lo.u32 d1, d1, 0x104; "
    "mul.lo.u32 d2, d2, 0x1040; mul.lo.u32 d3, d3, 0x104; "
    "and.b32 d0, d0, 0x81C081C0; and.b32 d1, d1, 0x81C081C0; "
    "and.b32 d2, d2, 0x81C081C0; and.b32 d3, d3, 0x81C081C0; "
)
# fp16: magnitude to bits 11..9 (value times 2^-14) and sign to 15.  The two are 3 bits apart, closer than a
# nibble, so they are masked separately and added (disjoint bits); nibble 3's magnitude moves down (mul.hi).
SHIFT_F16_BODY = (
    "and.b32 d0, $4, 0x00070007; and.b32 q, $4, 0x00080008; mul.lo.u32 q, q, 4096; mad.lo.u32 d0, d0, 512, q; "
    "and.b32 d1, $4, 0x00700070; and.b32 q, $4, 0x00800080; mul.lo.u32 q, q, 256; mad.lo.u32 d1, d1, 32, q; "
    "and.b32 d2, $4, 0x07000700; and.b32 q, $4, 0x08000800; mul.lo.u32 q, q, 16; mad.lo.u32 d2, d2, 2, q; "
    "and.b32 d3, $4, 0x70007000; and.b32 q, $4, 0x80008000; mad.hi.u32 d3, d3, 0x20000000, q; "
)
# The shift decode's power of two: the MMA sees e2m1 * e4m3 * 2^-SHIFT_EXP (the scale carries 2^(126 - 7) for
# bf16 and 2^(14 - 7) for fp16, both exact), the epilogue multiplies by 2^SHIFT_EXP.
SHIFT_EXP = 7
SHIFT_SCALE = {"bf16": 2.0 ** (126 - SHIFT_EXP), "f16": 2.0 ** (14 - SHIFT_EXP)}
