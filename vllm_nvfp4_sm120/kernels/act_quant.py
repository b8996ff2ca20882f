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
- divisions are ``tl.div_rn`` (IEEE); a plain ``/`` is approximate on the GPU.
- e2m1 rounding is one fp32 add of a binade-dependent "magic number" (it rounds once, ties to even), or on
  sm_120 (``NATIVE_E2M1``) the hardware ``cvt.rn.satfinite.e2m1x2.f32``, which rounds the same way.
- e4m3 rounding: ``NATIVE_E4M3=True`` uses Triton's fp32 → fp8e4nv cast, which lowers to
  ``cvt.rn.satfinite.e4m3x2.f32`` (RNE; sm_89+, so on sm_90 and sm_120 alike).  The interpreter's cast is *not*
  RNE (it rounds ties away and does not carry into the exponent), so ``NATIVE_E4M3=False`` does the rounding in
  integer arithmetic on the fp32 bits; the launcher picks it on CPU.  Both are checked against each other on GPU.

Grid: rows x K-chunks, so a handful of rows with K = 28672 still spreads over many programs.  Each program reads
``BLOCK_T x BLOCK_K`` activations as ``[BLOCK_T, BLOCK_K/16, 16]`` (the 16-element scale block is the last axis, so
the block amax needs no data movement) with 16-byte vector loads.
"""

import triton
import triton.language as tl

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


@triton.jit
def _e2m1_codes(v):
    """fp32 → 4-bit e2m1 code (int32): nearest, ties to even, saturating at ±6; -0 and tiny negatives give 8.

    The e2m1 grid is {0, .5, 1, 1.5} ∪ {2, 3} ∪ {4, 6}: step 2^(d-1) in the binade d = 0 (a < 2), 1, 2 of
    max(a, 1).  Adding M = 1.5 * 2^(22+d) + 2 ulps (ulp = the step) rounds a to the grid in one fp32 add, ties to
    even, and leaves k + 2 in the sum's low bits, k = rint(a / step).  The code is k + 2d (the binades start at
    codes 0, 4, 6 and at k = 0, 2, 2), i.e. the sum's low bits plus (bits(2^d) >> 22) = 254 + 2d, mod 8.
    This is mostly float math: the H200 has twice the fp32 rate of its compare/select/logic pipe.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    pow2d = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^d
    t = a + pow2d * 6291457.0  # 6291457 = 1.5 * 2^22 + 1: exact, and the +1 is the 2 ulps
    code = t.to(tl.int32, bitcast=True) + (pow2d.to(tl.int32, bitcast=True) >> 22)
    top4 = (v.to(tl.uint32, bitcast=True) >> 28).to(tl.int32)  # bit 3 = the sign bit
    return (code & 7) | (top4 & -8)  # one bitwise select on the GPU


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
def quantize_blocks_nvfp4(x, enc, NATIVE_E4M3: tl.constexpr, NATIVE_E2M1: tl.constexpr = False):
    """fp32 blocks ``[R, NB, 16]`` → (packed e2m1 codes ``[R, NB, 8]`` uint8, e4m3 scale bytes ``[R, NB]`` uint8).

    Bit-exact with ``format.quantize_nvfp4`` given the same fp32 values and ``enc`` (the encode global, fp32
    scalar): the formula in the module docstring, in the same order.  The one implementation for every kernel
    that quantizes to NVFP4 (activations here, the W4A4 MoE intermediate in ``moe_w4a4``); a kernel with a 2-D
    ``[R, C]`` tile passes ``tl.reshape(tile, (R, C // 16, 16))``.  Element 2i of a block is the low nibble.
    ``NATIVE_E2M1`` (sm_120 only): the e2m1 rounding by the hardware convert instead of fp32/integer arithmetic
    (which costs about a dozen ALU operations per element and limits the quantizer on the H200).
    """
    amax = tl.max(tl.abs(x), axis=2)
    sf_byte, sf_val = _e4m3_rne(tl.minimum(enc * (amax * _ONE_SIXTH), 448.0), NATIVE_E4M3)
    dec = sf_val * tl.div_rn(1.0, enc)
    # 1/0 := 0 keeps an all-zero block at code 0 instead of 0 * inf = NaN.  The scalar 1.0 is broadcast by
    # div_rn itself (no tl.full: Gluon kernels call this function too, and Gluon's full needs a layout).
    is_zero = dec == 0.0
    elem_scale = tl.where(is_zero, 0.0, tl.div_rn(1.0, tl.where(is_zero, 1.0, dec)))
    scaled = x * elem_scale[:, :, None]
    if NATIVE_E2M1:
        lo, hi = tl.split(tl.reshape(scaled, (x.shape[0], x.shape[1], 8, 2)))
        return _e2m1x2_native(lo, hi), sf_byte.to(tl.uint8)
    codes = _e2m1_codes(scaled)
    lo, hi = tl.split(tl.reshape(codes, (x.shape[0], x.shape[1], 8, 2)))
    return (lo | (hi << 4)).to(tl.uint8), sf_byte.to(tl.uint8)


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

    elem = blk[:, None] * 16 + tl.arange(0, 16)[None, :]  # [NB, 16]
    x_ptrs = x_ptr + rows64[:, None, None] * stride_xt + elem[None, :, :]
    x_mask = row_ok[:, None, None] & blk_ok[None, :, None]
    # evict_last: the activation stays in L2 for whatever reads it next (the residual, the next quant).
    x = tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)

    packed, sf_byte = quantize_blocks_nvfp4(x, tl.load(enc_ptr), NATIVE_E4M3, NATIVE_E2M1)  # [BT, NB, 8], [BT, NB]
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
        if out_codes is None:
            out_codes = torch.empty((t, k // 2), dtype=torch.uint8, device=x.device)
        if out_scales is None:
            out_scales = torch.empty((sf_rows, sf_cols), dtype=torch.float8_e4m3fn, device=x.device)
        launch(x, in_enc, out_codes, out_scales.view(torch.uint8), t, k, x.stride(0), out_codes.stride(0),
               out_scales.stride(0), sf_rows, sf_cols)
        return out_codes, out_scales

    return run
