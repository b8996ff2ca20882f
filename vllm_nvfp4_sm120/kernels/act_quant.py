"""NVFP4 activation quantization: bf16/fp16 ``[T, K]`` → e2m1 codes ``[T, K/2]`` + e4m3 block scales.

Bit-exact with :func:`vllm_nvfp4_sm120.format.quantize_nvfp4` (vLLM's ``ref_nvfp4_quant`` order of operations)::

    block_scale = e4m3_rne(min(enc * (amax16 * fp32(1/6)), 448))
    code        = e2m1_rne(clamp(x * (1 / (block_scale * (1 / enc))), -6, 6))      (1/0 := 0)

``enc`` is the static input ENCODE global (vLLM's ``layer.input_global_scale_inv``), read from a device tensor.
Scales come out linear ``[T, K/16]`` or in the 128x4-swizzled layout that ``torch._scaled_mm`` and FlashInfer
``mm_fp4`` take (``[round_up(T,128), round_up(K/16,4)]``); the kernel writes the zero padding of that layout
itself (its grid covers the padded rows and columns, whose masked loads give amax 0 → scale 0), so the output
buffer may come from ``torch.empty`` and nothing extra runs under a CUDA graph.

Exactness on every target:
- divisions are ``tl.div_rn`` (IEEE), the block reciprocal of the GPU build ``rcp.rn.f32`` (the same correctly
  rounded value); a plain ``/`` is approximate on the GPU.
- e2m1 rounding: the code is RNE of a concave piecewise-linear map of |x| (three fp32 lines, each one fused
  multiply-add onto a "magic number", then their minimum; see ``_e2m1_nibbles``), or on sm_120 (``NATIVE_E2M1``)
  the hardware ``cvt.rn.satfinite.e2m1x2.f32``, which rounds the same way.
- e4m3 rounding: ``NATIVE_E4M3=True`` uses Triton's fp32 → fp8e4nv cast, which lowers to
  ``cvt.rn.satfinite.e4m3x2.f32`` (RNE; sm_89+, so on sm_90 and sm_120 alike).  The interpreter's cast is *not*
  RNE (it rounds ties away and does not carry into the exponent), so ``NATIVE_E4M3=False`` does the rounding in
  integer arithmetic on the fp32 bits; the launcher picks it on CPU.  Both are checked against each other on GPU.

Grid: rows x K-chunks, so a handful of rows with K = 28672 still spreads over many programs.  Each program reads
``BLOCK_T x BLOCK_K`` activations with 16-byte vector loads, laid out so that one thread holds a whole 16-element
scale block (two loads, the halves on a leading axis of the tile): the block amax, the scale and its reciprocal
are computed once per block, with no shuffle between threads.  bf16 rows are read as 32-bit pairs, so that each
value becomes fp32 with one shift or mask (the row stride must be even).

On the H200 the quantizer is bound by the ALU pipe (compare, select, logic and shifts issue at half the fp32 rate),
so the per-element sequence is written to keep most of its work on the fp32 and integer multiply-add pipes: the
rounding in fp32 lines, the nibble packing by multiply-adds and byte permutes in inline PTX, the bf16 block amax
as packed bf16x2 maxima.  The PTX parts have pure-Triton twins for the interpreter (``_PACK_PTX``), checked
against the same reference; the instruction count per element is pinned by a compile test.
"""

import triton
import triton.language as tl

from .common import interpreting

# For the sm_120 compile harness: argument types as the launcher passes them (bf16 activations).
ACT_QUANT_SIGNATURE = {
    "x_ptr": "*bf16", "enc_ptr": "*fp32", "codes_ptr": "*u8", "sf_ptr": "*u8",
    "T": "i32", "K": "i32", "stride_xt": "i32", "stride_ct": "i32", "stride_st": "i32",
    "SF_ROWS": "i32", "SF_COLS": "i32",
    "SWIZZLED": "constexpr", "NATIVE_E4M3": "constexpr", "NATIVE_E2M1": "constexpr", "BLOCK_T": "constexpr",
    "BLOCK_K": "constexpr",
}
# Real checkpoint shapes: K, the strides and the scale-buffer sizes are multiples of 16 (K % 256 == 0, K/16 % 16
# == 0 for every K we ship; T and SF_ROWS are not).  Without these the loads are not vectorized.
ACT_QUANT_DIVISIBLE = [k for k, v in ACT_QUANT_SIGNATURE.items() if v.startswith("*")] + [
    "K", "stride_xt", "stride_ct", "stride_st", "SF_COLS",
]

# fp32(1/6): the reference multiplies amax by the fp32 reciprocal of 6, not by 6's exact inverse.
_ONE_SIXTH = tl.constexpr(0.16666667163372040)  # 0x3E2AAAAB
# 1.5 * 2^23: adding it to a value in [0, 2^22) rounds that value to an integer, ties to even, in one fp32 add;
# the integer is then the low bits of the sum (bits - 0x4B400000).  Used for the e4m3 subnormal range.
_MAGIC = tl.constexpr(12582912.0)
_MAGIC_BITS = tl.constexpr(0x4B400000)


# 2^23: adding a value v in [0, 8) to it rounds v to an integer, ties to even (fp32 has ulp 1 in [2^23, 2^24)), and
# the integer is then the low byte of the sum's bit pattern (0x4B000000 + v).
_E2M1_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _e2m1_nibbles(v):
    """fp32 → int32 whose low byte is the 4-bit e2m1 code of ``v`` (bits 4-7 zero, garbage from bit 24 up).

    Nearest, ties to even, saturating at ±6; the sign bit follows ``v``'s (-0 and tiny negatives give 8).
    The code of a = |v| in [0, 6] is RNE(f(a)) with f the line through the grid points (value, code) =
    (0, 0), (.5, 1), (1, 2), (1.5, 3), (2, 4), (3, 5), (4, 6), (6, 7): f(a) = min(2a, a + 2, a/2 + 4), a concave
    map, so the minimum of three lines.  Rounding is monotone, hence RNE(min) = min(RNE), and each line is rounded
    once by adding it to 2^23 in one fused multiply-add (exact slope and offset, one rounding); f maps the
    midpoints between grid values to half-integers and even codes are the grid values with an even mantissa, so
    ties land where the reference sends them.  NaN: ``minimum`` keeps the 6, so code 7 with ``v``'s sign bit.
    Three fp32 pipe operations and three compares per value: the H200 runs fp32 at twice its compare rate.
    """
    sign = (v.to(tl.uint32, bitcast=True) >> 28).to(tl.int32) & 8
    return _e2m1_magnitudes(v) | sign


# Eight e2m1 codes → one 32-bit word of packed bytes (byte k = pair k, its first value in the low nibble).  The
# magnitudes by Horner's rule on the _e2m1_magnitudes words in the integer multiply-add pipe (their 2^23 bit
# patterns sum to 17 * 0x4B000000 = 0xFB000000 mod 2^32, cancelled by one add); the sign bits by byte permutes
# that replicate each value's sign byte (selector nibble 8 | byte): two signs per permute, a third gathers four,
# and one mask-or each for bits 3 and 7 of the bytes.  pack=4: $1-$4 the low values' magnitude words, $5-$8 the
# high ones', $9-$12 and $13-$16 the fp32 values themselves (for the sign bits; a NaN from the scaling multiply
# is the positive canonical NaN, as in _e2m1_nibbles).
_PACK_E2M1X8 = tl.constexpr(
    "{\n.reg .b32 w, a, b, c, d;\n"
    "mad.lo.u32 w, $8, 16, $4;\nmad.lo.u32 w, w, 16, $7;\nmad.lo.u32 w, w, 16, $3;\nmad.lo.u32 w, w, 16, $6;\n"
    "mad.lo.u32 w, w, 16, $2;\nmad.lo.u32 w, w, 16, $5;\nmad.lo.u32 w, w, 16, $1;\nadd.u32 w, w, 0x05000000;\n"
    "prmt.b32 a, $9, $10, 0xFBFB;\nprmt.b32 b, $11, $12, 0xFBFB;\nprmt.b32 a, a, b, 0x5410;\n"
    "prmt.b32 c, $13, $14, 0xFBFB;\nprmt.b32 d, $15, $16, 0xFBFB;\nprmt.b32 c, c, d, 0x5410;\n"
    "and.b32 a, a, 0x08080808;\nand.b32 c, c, 0x80808080;\nor.b32 w, w, a;\nor.b32 $0, w, c;\n}"
)
# The interpreter cannot run PTX: there (False) the same bytes come from _e2m1_nibbles and a shift-add per byte,
# the block amax from fp32 and the reciprocal from div_rn.
_PACK_PTX = tl.constexpr(not interpreting())


@triton.jit
def _e2m1_magnitudes(v):
    """fp32 → int32 bit pattern 0x4B000000 + e2m1 magnitude code of ``v`` (see :func:`_e2m1_nibbles`)."""
    a = tl.minimum(tl.abs(v), 6.0)
    c = tl.minimum(tl.minimum(a * 2.0 + _E2M1_MAGIC, a + (_E2M1_MAGIC + 2.0)), a * 0.5 + (_E2M1_MAGIC + 4.0))
    return c.to(tl.int32, bitcast=True)


@triton.jit
def _e2m1x8_pack_ptx(lo, hi):
    """fp32 pairs → packed e2m1 bytes (``lo`` in the low nibble) by :data:`_PACK_E2M1X8` (GPU only)."""
    return tl.inline_asm_elementwise(_PACK_E2M1X8, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [_e2m1_magnitudes(lo), _e2m1_magnitudes(hi), lo, hi],
                                     dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _e2m1_codes(v):
    """fp32 → 4-bit e2m1 code (int32): nearest, ties to even, saturating at ±6; -0 and tiny negatives give 8."""
    return _e2m1_nibbles(v) & 15


@triton.jit
def _e4m3_rne(s, NATIVE: tl.constexpr):
    """fp32 in [0, 448] → (e4m3fn byte as int32, its value as fp32), round to nearest even."""
    if NATIVE:
        f8 = s.to(tl.float8e4nv)
        byte = f8.to(tl.uint8, bitcast=True).to(tl.int32)
        value = f8.to(tl.float32)
    else:
        bits = s.to(tl.int32, bitcast=True)
        # Normal range [2^-6, 448]: keep 3 mantissa bits; adding 0x7FFFF plus the kept LSB rounds half to even,
        # and a mantissa carry bumps the exponent by itself.
        rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # mask 0xFFF00000
        normal_byte = (rounded >> 20) - (120 << 3)  # fp32 exponent bias 127 → e4m3 bias 7
        # Subnormal range (< 2^-6): multiples of 2^-9; n = 8 is 2^-6, which is also byte 8.
        n = (s * 512.0 + _MAGIC).to(tl.int32, bitcast=True) - _MAGIC_BITS
        subnormal = s < 0.015625
        byte = tl.where(subnormal, n, normal_byte)
        value = tl.where(subnormal, n.to(tl.float32) * 0.001953125, rounded.to(tl.float32, bitcast=True))
    return byte, value


# sm_120a (and sm_100a): the hardware fp32 → e2m1 convert, two values per byte (the first source is the high
# nibble), round to nearest even, saturating at ±6 -- the rounding of _e2m1_codes in one instruction per pair.
# pack=4: four bytes built from four (hi, lo) pairs and returned in one 32-bit register.
_CVT_E2M1X2 = tl.constexpr(
    "{\n.reg .b8 b0, b1, b2, b3;\n"
    "cvt.rn.satfinite.e2m1x2.f32 b0, $5, $1;\ncvt.rn.satfinite.e2m1x2.f32 b1, $6, $2;\n"
    "cvt.rn.satfinite.e2m1x2.f32 b2, $7, $3;\ncvt.rn.satfinite.e2m1x2.f32 b3, $8, $4;\n"
    "mov.b32 $0, {b0, b1, b2, b3};\n}"
)


@triton.jit
def _e2m1x2_native(lo, hi):
    """fp32 pairs → packed e2m1 bytes (``lo`` in the low nibble) by ``cvt.rn.satfinite.e2m1x2.f32`` (sm_120a)."""
    return tl.inline_asm_elementwise(_CVT_E2M1X2, "=r,r,r,r,r,r,r,r,r", [lo, hi], dtype=tl.uint8,
                                     is_pure=True, pack=4)


@triton.jit
def _rcp_rn_ptx(v):
    """Correctly rounded fp32 reciprocal (``rcp.rn.f32``: the value of ``div_rn(1, v)``, with fewer instructions)."""
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _absmax_bf16x2_ptx(a, b):
    """Two bf16 pairs (int32) → the pair of their larger magnitudes (sign bits: the xor of the two signs)."""
    return tl.inline_asm_elementwise("max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _block_scales(amax, enc, NATIVE_E4M3: tl.constexpr, PTX: tl.constexpr):
    """Block amax (fp32) → (e4m3 scale byte as uint8, the fp32 factor that takes the block to the e2m1 range)."""
    sf_byte, sf_val = _e4m3_rne(tl.minimum(enc * (amax * _ONE_SIXTH), 448.0), NATIVE_E4M3)
    dec = sf_val * tl.div_rn(1.0, enc)
    # 1/0 := 0 keeps an all-zero block at code 0 instead of 0 * inf = NaN.  The scalar 1.0 is broadcast by
    # div_rn itself (no tl.full: Gluon kernels call this function too, and Gluon's full needs a layout).
    is_zero = dec == 0.0
    if PTX:
        elem_scale = tl.where(is_zero, 0.0, _rcp_rn_ptx(dec))
    else:
        elem_scale = tl.where(is_zero, 0.0, tl.div_rn(1.0, tl.where(is_zero, 1.0, dec)))
    return sf_byte.to(tl.uint8), elem_scale


@triton.jit
def _e2m1_bytes(scaled, NATIVE_E2M1: tl.constexpr, PTX: tl.constexpr):
    """fp32 ``[R, NB, 16]`` (scaled) → packed e2m1 codes ``[R, NB, 8]`` uint8, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(scaled, (scaled.shape[0], scaled.shape[1], 8, 2)))
    if NATIVE_E2M1:
        return _e2m1x2_native(lo, hi)
    if PTX:
        return _e2m1x8_pack_ptx(lo, hi)
    # Element 2i's code in bits 0-3, 2i+1's in bits 4-7 (one multiply-add per byte); the garbage of
    # _e2m1_nibbles starts at bit 24, so the truncation to uint8 drops it.
    return (_e2m1_nibbles(lo) + (_e2m1_nibbles(hi) << 4)).to(tl.uint8)


@triton.jit
def quantize_blocks_nvfp4(x, enc, NATIVE_E4M3: tl.constexpr, NATIVE_E2M1: tl.constexpr = False):
    """fp32 blocks ``[R, NB, 16]`` → (packed e2m1 codes ``[R, NB, 8]`` uint8, e4m3 scale bytes ``[R, NB]`` uint8).

    Bit-exact with ``format.quantize_nvfp4`` given the same fp32 values and ``enc`` (the encode global, fp32
    scalar): the formula in the module docstring, in the same order.  The one implementation for every kernel
    that quantizes to NVFP4 (activations here, the W4A4 MoE intermediate in ``moe_w4a4``); a kernel with a 2-D
    ``[R, C]`` tile passes ``tl.reshape(tile, (R, C // 16, 16))``.  Element 2i of a block is the low nibble.
    ``NATIVE_E2M1`` (sm_120 only): the e2m1 rounding by the hardware convert instead of fp32/integer arithmetic
    (which costs seven operations per element, three of them compares, and the byte packing).
    The activation kernel runs the same steps with its own block amax and the PTX variants (``_PACK_PTX``).
    """
    sf_byte, elem_scale = _block_scales(tl.max(tl.abs(x), axis=2), enc, NATIVE_E4M3, False)
    return _e2m1_bytes(x * elem_scale[:, :, None], NATIVE_E2M1, False), sf_byte


@triton.jit(do_not_specialize=["T", "SF_ROWS"])  # token counts vary per call
def _act_quant_kernel(
    x_ptr, enc_ptr, codes_ptr, sf_ptr,
    T, K, stride_xt, stride_ct, stride_st,
    SF_ROWS, SF_COLS,
    SWIZZLED: tl.constexpr,
    NATIVE_E4M3: tl.constexpr,
    NATIVE_E2M1: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)  # scale-block (column) index
    row_ok = rows < T
    blk_ok = blk < K // 16
    rows64 = rows.to(tl.int64)

    # The tile is [2, BLOCK_T, NB, 8 values]: the two halves of a scale block on the leading axis, so that Triton's
    # layout keeps both in one thread (lanes and warps go to the block and row axes) and the block amax is a
    # reduction in registers.  evict_last: the activation stays in L2 for whatever reads it next (the residual,
    # the next quant).
    half = tl.arange(0, 2)[:, None, None, None]
    x_mask = row_ok[None, :, None, None] & blk_ok[None, None, :, None]
    if x_ptr.dtype.element_ty == tl.bfloat16:
        # 32-bit pairs (value 2i in the low half): bf16 → fp32 is then one shift or one mask per value, and the
        # block amax takes seven packed bf16x2 maxima (exact: a maximum rounds nothing) and one fp32 one.
        w = blk[:, None] * 8 + tl.arange(0, 4)[None, :]  # [NB, 4] pair index in the row
        p_ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + half * 4 + rows64[None, :, None, None] * (stride_xt // 2)
        p = tl.load(p_ptrs + w[None, None, :, :], mask=x_mask, other=0, eviction_policy="evict_last")
        x = tl.join((p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True))
        x = tl.reshape(tl.permute(x, (1, 2, 0, 3, 4)), (BLOCK_T, NB, 16))
        if _PACK_PTX:
            m = tl.reduce(tl.reduce(p, 3, _absmax_bf16x2_ptx), 0, _absmax_bf16x2_ptx)  # [BT, NB] bf16 pairs
            amax = tl.maximum(tl.abs((m << 16).to(tl.float32, bitcast=True)),
                              tl.abs((m & -65536).to(tl.float32, bitcast=True)))
        else:
            amax = tl.max(tl.abs(x), axis=2)
    else:
        elem = blk[:, None] * 16 + tl.arange(0, 8)[None, :]  # [NB, 8]
        x_ptrs = x_ptr + half * 8 + rows64[None, :, None, None] * stride_xt + elem[None, None, :, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = tl.reshape(tl.permute(x, (1, 2, 0, 3)), (BLOCK_T, NB, 16))
        amax = tl.max(tl.abs(x), axis=2)

    sf_byte, elem_scale = _block_scales(amax, tl.load(enc_ptr), NATIVE_E4M3, _PACK_PTX)
    packed = _e2m1_bytes(x * elem_scale[:, :, None], NATIVE_E2M1, _PACK_PTX)  # [BT, NB, 8]
    byte_idx = blk[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NB, 8]
    c_ptrs = codes_ptr + rows64[:, None, None] * stride_ct + byte_idx[None, :, :]
    tl.store(c_ptrs, packed, mask=row_ok[:, None, None] & blk_ok[None, :, None])

    if SWIZZLED:
        # format.swizzle.swizzled_offset; the grid covers the padded rows/columns, whose scale is 0.
        r = rows64[:, None]
        c = blk[None, :]
        sf_off = (r // 128) * (SF_COLS * 128) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
        sf_mask = (r < SF_ROWS) & (c < SF_COLS)
    else:
        sf_off = rows64[:, None] * stride_st + blk[None, :]
        sf_mask = row_ok[:, None] & blk_ok[None, :]
    # Contiguity 1 (true of any offsets) keeps Triton from staging the bytes through shared memory to build
    # 4-byte stores: each thread stores its blocks' bytes, and a warp's 32 lanes still cover 32 adjacent bytes.
    # (A one-block tile has nothing to stage, and Triton's coalescing pass fails on the hint there.)
    if BLOCK_T * NB > 1:
        tl.store(sf_ptr + tl.max_contiguous(sf_off, [1, 1]), sf_byte, mask=sf_mask)
    else:
        tl.store(sf_ptr + sf_off, sf_byte, mask=sf_mask)


def has_native_e2m1(device) -> bool:
    """Whether ``cvt.rn.satfinite.e2m1x2.f32`` exists on ``device`` (compile-checked for sm_120 only)."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 12


def quantize_act_nvfp4(
    x,
    in_enc,
    *,
    block_t: int,
    block_k: int,
    num_warps: int,
    swizzled: bool = False,
    out_codes=None,
    out_scales=None,
    native_e4m3: bool | None = None,
    native_e2m1: bool | None = None,
):
    """Quantize activations ``x [T, K]`` (bf16/fp16, rows may be strided, T may be 0) with the encode global.

    ``block_t x block_k`` elements per program (powers of two, ``block_k >= 16``), the tile the dispatch picks
    for the shape (``dispatch.linear.act_quant_config``).

    Returns ``(codes [T, K/2] uint8, scales)``; scales are float8_e4m3fn ``[T, K/16]`` or, with ``swizzled``,
    the 128x4 layout ``[round_up(T,128), round_up(K/16,4)]`` (contiguous, zero padding written here).
    ``out_codes`` may be a row-strided view (e.g. into a K-padded buffer); ``out_scales`` may be e4m3 or uint8.
    ``in_enc``: one fp32 element on x's device, the ENCODE global (vLLM ``input_global_scale_inv``).
    NaN/inf in ``x`` are not checked (that would need a host sync); NVFP4 cannot represent them.
    bf16 rows are read as 32-bit pairs: a view whose rows do not start on 4-byte boundaries (odd row stride, odd
    start) is copied first (:func:`pair_aligned`).
    ``native_e4m3`` / ``native_e2m1``: None = the hardware converts where they exist (e4m3: any GPU from sm_89;
    e2m1: sm_120), the exact arithmetic otherwise.
    """
    import torch

    from ..format.checks import ACT_DTYPES, as_e4m3, check_tensor
    from ..format.swizzle import swizzled_shape

    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, k = x.shape
    if k == 0 or k % 16:
        raise ValueError(f"x: K = {k} (last dimension of shape {list(x.shape)}) must be a positive multiple of 16")
    x = pair_aligned(x)
    check_tensor("in_enc", in_enc, dtype=torch.float32, device=x.device)
    if in_enc.numel() != 1:
        raise ValueError(f"in_enc: expected one fp32 encode global scale, got shape {list(in_enc.shape)}")

    if out_codes is None:
        out_codes = torch.empty((t, k // 2), dtype=torch.uint8, device=x.device)
    check_tensor("out_codes", out_codes, dtype=torch.uint8, shape=[t, k // 2], device=x.device,
                 last_dim_contiguous=True)

    sf_rows, sf_cols = swizzled_shape(t, k // 16) if swizzled else (t, k // 16)
    if out_scales is None:
        out_scales = torch.empty((sf_rows, sf_cols), dtype=torch.float8_e4m3fn, device=x.device)
    out_scales = as_e4m3("out_scales", out_scales)
    layout = "128x4-swizzled " if swizzled else ""
    check_tensor(f"out_scales ({layout}e4m3 scales)", out_scales, shape=[sf_rows, sf_cols], device=x.device,
                 last_dim_contiguous=True)
    if swizzled and not out_scales.is_contiguous():
        raise ValueError(f"out_scales: the 128x4-swizzled buffer must be contiguous, got strides {out_scales.stride()}")

    if block_k % 16 or block_k & (block_k - 1) or block_t < 1 or block_t & (block_t - 1):
        raise ValueError(
            f"quantize_act_nvfp4: block_k ({block_k}) must be a power of two >= 16, block_t ({block_t}) a power of two"
        )
    if sf_rows == 0:
        return out_codes, out_scales
    run = prepare_act_quant(t, k, x.device, block_t=block_t, block_k=block_k, num_warps=num_warps, swizzled=swizzled,
                            native_e4m3=native_e4m3, native_e2m1=native_e2m1)
    return run(x, in_enc, out_codes, out_scales)


def pair_aligned(x):
    """``x``, or a contiguous copy where the kernel could not read its bf16 rows as 32-bit pairs (an odd row stride
    or an odd start: a view into a larger buffer).  Never an error: activations arrive as vLLM hands them over."""
    import torch

    t = x.shape[0]
    if x.dtype == torch.bfloat16 and t > 0 and ((t > 1 and x.stride(0) & 1) or x.data_ptr() & 3):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def prepare_act_quant(t: int, k: int, device, *, block_t: int, block_k: int, num_warps: int, swizzled: bool = False,
                      native_e4m3: bool | None = None, native_e2m1: bool | None = None):
    """A ready launch of :func:`quantize_act_nvfp4` for ``x [t, k]`` on ``device`` (grid and compile-time arguments
    fixed once).  The returned ``run(x, in_enc, out_codes=None, out_scales=None) -> (codes, scales)`` checks
    nothing: its inputs are those :func:`quantize_act_nvfp4` accepts (``t > 0``), the outputs allocated when not
    given."""
    import torch

    from ..format.swizzle import swizzled_shape
    from .launch import ReadyKernel

    sf_rows, sf_cols = swizzled_shape(t, k // 16) if swizzled else (t, k // 16)
    if native_e4m3 is None:
        native_e4m3 = device.type == "cuda"  # the interpreter's fp8 cast is not RNE
    if native_e2m1 is None:
        native_e2m1 = has_native_e2m1(device)
    launch = ReadyKernel(_act_quant_kernel, (triton.cdiv(sf_rows, block_t), triton.cdiv(sf_cols * 16, block_k)),
                         SWIZZLED=swizzled, NATIVE_E4M3=native_e4m3, NATIVE_E2M1=native_e2m1, BLOCK_T=block_t,
                         BLOCK_K=block_k, num_warps=num_warps)

    def run(x, in_enc, out_codes=None, out_scales=None):
        x = pair_aligned(x)  # per call: the address of a view can change while its signature does not
        if out_codes is None:
            out_codes = torch.empty((t, k // 2), dtype=torch.uint8, device=x.device)
        if out_scales is None:
            out_scales = torch.empty((sf_rows, sf_cols), dtype=torch.float8_e4m3fn, device=x.device)
        launch(x, in_enc, out_codes, out_scales.view(torch.uint8), t, k, x.stride(0), out_codes.stride(0),
               out_scales.stride(0), sf_rows, sf_cols)
        return out_codes, out_scales

    return run
