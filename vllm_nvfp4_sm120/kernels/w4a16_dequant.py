"""W4A16 prefill as dequantize-then-cuBLAS: ``out[T, N] = x @ dequant(W)^T (+ bias)``, chunk by chunk of rows.

At prefill sizes the Triton W4A16 GEMM (``w4a16_linear.w4a16_gemm``) is limited by the e2m1 decode in its inner
loop: every weight tile is decoded again for every row tile of ``x``.  Here the weight is decoded once per call,
``chunk_n`` rows at a time, into a 16-bit scratch ``[chunk_n, K]`` that cuBLAS then multiplies at its full rate
(``torch.mm`` writing straight into the output's column slice ``out[:, n0:n0 + rows]``).  The checkpoint's codes
and scales stay the only persistent copy of the weight; the scratch is one per-call temporary whose size depends
only on (chunk_n, K), reused by every chunk (kernels on one stream run in order, so the next chunk's dequant
cannot overwrite rows the previous chunk's GEMM still reads).  The dispatch table picks ``chunk_n`` so that each
GEMM still fills the GPU while the scratch stays small enough to live in L2 between the two kernels.

Numerics.  The scratch holds ``e2m1(code) * e4m3(scale) * w_dec_rows[r]`` rounded once to the activation dtype,
formed exactly as ``format.dequantize_nvfp4`` forms it: ``(fp32(scale) * dec)`` in fp32, times the e2m1 value in
fp32, round to nearest even.  So the scratch is bit-exact against the reference dequant; the GEMM is cuBLAS with
fp32 accumulation; the bias is pre-loaded into ``out`` and added by cuBLAS (``beta = 1``) in fp32 before the one
final rounding.  Unlike ``w4a16_gemm`` (exact ``e2m1 * e4m3`` products, global applied in fp32 after the sum),
the weight itself is rounded to 16 bits here — what vLLM's dequantize + matmul fallbacks do as well.

``FAST_DECODE=True`` decodes with the lop3/prmt inline-PTX table and rounds with the hardware ``cvt.rn``;
``FAST_DECODE=False`` is pure ``tl`` integer/float arithmetic that the interpreter runs (its fp32 → bf16 cast is
not round-to-nearest-even, so the bf16 rounding is done on the bits).  Both give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4_decode import e2m1x2_to_16bit, e4m3_to_f32
from .common import check_linear_inputs, interpreting, trivial_linear_output

# One dequant program writes BLOCK_R x BLOCK_K outputs: with 4 warps each thread loads one 16-byte vector of codes
# and stores 64 contiguous bytes, and a chunk of a few hundred rows still gives several programs per SM.
DEQUANT_BLOCK_R = 16
DEQUANT_BLOCK_K = 256
DEQUANT_NUM_WARPS = 4

# For the sm_120 compile harness: argument types as the launcher passes them (bf16 output).
NVFP4_DEQUANT_SIGNATURE = {
    "codes_ptr": "*u8", "scales_ptr": "*u8", "dec_ptr": "*fp32", "out_ptr": "*bf16",
    "R": "i32", "K": "i32",
    "stride_cr": "i32", "stride_sr": "i32", "stride_or": "i32",
    "EVEN_K": "constexpr", "FAST_DECODE": "constexpr", "BLOCK_R": "constexpr", "BLOCK_K": "constexpr",
}
# What the JIT marks divisible by 16 on real checkpoint shapes (K % 256 == 0: row strides K/2, K/16, K).  R is not:
# the last chunk is ragged.
NVFP4_DEQUANT_DIVISIBLE = [k for k, v in NVFP4_DEQUANT_SIGNATURE.items() if v.startswith("*")] + [
    "K", "stride_cr", "stride_sr", "stride_or",
]


@triton.jit
def _f32_to_bf16_rne(v):
    """fp32 → bf16, round to nearest even, on the bits (finite inputs): what ``cvt.rn.bf16.f32`` and torch do."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _nvfp4_dequant_kernel(
    codes_ptr, scales_ptr, dec_ptr, out_ptr,
    R, K,
    stride_cr, stride_sr, stride_or,
    EVEN_K: tl.constexpr,
    FAST_DECODE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[r, :] = e2m1(codes[r]) * e4m3(scales[r]) * dec[r]`` in ``out``'s dtype, for ``R`` rows."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    r_ok = offs_r < R
    rows = offs_r[:, None].to(tl.int64)

    if EVEN_K:
        # No K mask: the loads and stores stay 16-byte vectors.
        c_mask = r_ok[:, None]
        s_mask = r_ok[:, None]
        o_mask = r_ok[:, None]
    else:
        c_mask = r_ok[:, None] & (offs_kb < K // 2)[None, :]
        s_mask = r_ok[:, None] & (offs_ks < K // 16)[None, :]
        o_mask = r_ok[:, None] & (offs_k < K)[None, :]
    # Every byte is read once: keep it from pushing the scratch (which the GEMM reads next) out of L2.
    codes = tl.load(codes_ptr + rows * stride_cr + offs_kb[None, :], mask=c_mask, other=0,
                    eviction_policy="evict_first")
    sf = tl.load(scales_ptr + rows * stride_sr + offs_ks[None, :], mask=s_mask, other=0,
                 eviction_policy="evict_first")
    dec = tl.load(dec_ptr + offs_r, mask=r_ok, other=0.0)

    # The reference's order (format.dequantize_nvfp4): block = fp32(scale) * dec, then value * block, in fp32.
    if FAST_DECODE:
        s = sf.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # hardware fp8 convert (sm_89+), exact
    else:
        s = e4m3_to_f32(sf.to(tl.int32))
    block = (s * dec[:, None])[:, :, None]
    # e2m1 values are exact in 16 bits, and so in fp32: decode to 16 bits (the fast table) and widen.
    lo, hi = e2m1x2_to_16bit(codes.reshape(BLOCK_R, BLOCK_K // 16, 8), dtype, FAST_DECODE)
    w = tl.join(lo.to(tl.float32) * block, hi.to(tl.float32) * block).reshape(BLOCK_R, BLOCK_K)

    if dtype == tl.bfloat16 and not FAST_DECODE:
        w16 = _f32_to_bf16_rne(w)
    else:
        w16 = w.to(dtype)  # cvt.rn (round to nearest even); numpy's fp16 cast in the interpreter is RNE too
    tl.store(out_ptr + rows * stride_or + offs_k[None, :], w16, mask=o_mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def _launch_dequant(codes, scales_u8, w_dec_rows, out, fast_decode: bool) -> None:
    rows, k = out.shape
    if rows == 0 or k == 0:
        return
    grid = (triton.cdiv(rows, DEQUANT_BLOCK_R), triton.cdiv(k, DEQUANT_BLOCK_K))
    _nvfp4_dequant_kernel[grid](
        codes, scales_u8, w_dec_rows, out,
        rows, k,
        codes.stride(0), scales_u8.stride(0), out.stride(0),
        EVEN_K=k % DEQUANT_BLOCK_K == 0, FAST_DECODE=bool(fast_decode),
        BLOCK_R=DEQUANT_BLOCK_R, BLOCK_K=DEQUANT_BLOCK_K,
        num_warps=DEQUANT_NUM_WARPS,
    )


def dequantize_rows(codes, scales, w_dec_rows, dtype, out=None, *, fast_decode: bool | None = None):
    """``[R, K/2]`` codes, ``[R, K/16]`` e4m3 scales, ``[R]`` fp32 per-row decode globals → ``[R, K]`` ``dtype``.

    Bit-exact against ``format.dequantize_nvfp4(codes, scales, GlobalScale.from_decode(dec), dtype)`` row by row.
    ``out`` (``[R, K]``, ``dtype``, last dimension contiguous; rows may be strided) receives the result.
    ``fast_decode=None``: the inline-PTX decode on a GPU, the pure-``tl`` decode in the interpreter.
    """
    import torch

    from ..format.checks import ACT_DTYPES, as_e4m3, check_tensor

    if dtype not in ACT_DTYPES:
        raise TypeError(f"dtype: expected bfloat16 or float16, got {str(dtype).removeprefix('torch.')}")
    check_tensor("codes", codes, dtype=torch.uint8, ndim=2, last_dim_contiguous=True)
    r, k = codes.shape[0], codes.shape[1] * 2
    if k % 16:
        raise ValueError(f"codes: K = {k} (2 x last dimension) must be a multiple of 16 (one e4m3 scale per 16)")
    scales = as_e4m3("scales", scales)
    check_tensor("scales", scales, shape=[r, k // 16], last_dim_contiguous=True, device=codes.device)
    check_tensor("w_dec_rows", w_dec_rows, dtype=torch.float32, shape=[r], device=codes.device)
    if r > 1 and w_dec_rows.stride(0) != 1:
        raise ValueError(f"w_dec_rows: must be contiguous, got stride {w_dec_rows.stride()}")
    if out is None:
        out = torch.empty((r, k), dtype=dtype, device=codes.device)
    check_tensor("out", out, dtype=dtype, shape=[r, k], last_dim_contiguous=True, device=codes.device)
    if fast_decode is None:
        fast_decode = not interpreting()
    _launch_dequant(codes, scales.view(torch.uint8), w_dec_rows, out, fast_decode)
    return out


def w4a16_dequant_mm(
    x,
    w_codes,
    w_scales,
    w_dec_rows,
    bias=None,
    *,
    chunk_n: int,
    fast_decode: bool | None = None,
    out=None,
):
    """``x [T, K] @ W^T * w_dec_rows (+ bias)`` → ``[T, N]`` in ``x.dtype``: dequantize ``chunk_n`` weight rows at a
    time into one reused 16-bit scratch and multiply each chunk with cuBLAS into ``out[:, n0:n0 + rows]``.

    Meant for prefill (the dispatch table sends T >= its threshold here and picks ``chunk_n``); any T works.
    No host sync and shape-only allocation (the scratch is ``[min(chunk_n, N), K]``): capturable in CUDA graphs.
    ``bias`` is pre-loaded into ``out``, so an fp32 bias is rounded to ``x.dtype`` first (vLLM's is ``x.dtype``).
    """
    import torch

    t, n, k, w_scales, out = check_linear_inputs("w4a16_dequant_mm", x, w_codes, w_scales, w_dec_rows, bias, out)
    if not isinstance(chunk_n, int) or chunk_n < 1:
        raise ValueError(f"w4a16_dequant_mm: chunk_n must be a positive int, got {chunk_n!r}")
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    run = prepare_w4a16_dequant_mm(t, n, k, chunk_n=chunk_n, has_bias=bias is not None, fast_decode=fast_decode)
    return run(x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias, out)


def prepare_w4a16_dequant_mm(t: int, n: int, k: int, *, chunk_n: int, has_bias: bool, fast_decode: bool | None = None):
    """A ready :func:`w4a16_dequant_mm` for ``x [t, k]`` and an ``[n, k]`` weight (chunks, grids and compile-time
    arguments fixed once): ``run(x, w_codes, w_scales_u8, w_dec_rows, bias, out) -> out`` checks nothing (its
    inputs are those :func:`w4a16_dequant_mm` accepts, ``t, n, k > 0``)."""
    import torch

    from .launch import ReadyKernel

    if fast_decode is None:
        fast_decode = not interpreting()
    chunk_n = min(chunk_n, n)
    chunks = [(n0, min(chunk_n, n - n0)) for n0 in range(0, n, chunk_n)]
    const = dict(EVEN_K=k % DEQUANT_BLOCK_K == 0, FAST_DECODE=bool(fast_decode), BLOCK_R=DEQUANT_BLOCK_R,
                 BLOCK_K=DEQUANT_BLOCK_K, num_warps=DEQUANT_NUM_WARPS)
    # One ready launch per chunk size (the last chunk may be shorter).
    launches = {rows: ReadyKernel(_nvfp4_dequant_kernel, (triton.cdiv(rows, DEQUANT_BLOCK_R),
                                                          triton.cdiv(k, DEQUANT_BLOCK_K)), **const)
                for rows in {rows for _, rows in chunks}}

    whole = len(chunks) == 1  # the one chunk is the whole [n, k] weight: no row views to make

    def run(x, w_codes, scales_u8, w_dec_rows, bias, out):
        scratch = torch.empty((chunk_n, k), dtype=x.dtype, device=x.device)
        if has_bias:
            # cuBLAS adds it (beta = 1) to the fp32 accumulator before the single rounding, as the reference does.
            out.copy_(bias.expand(t, n))
        for n0, rows in chunks:
            if whole:
                w, codes, sf, dec, dst = scratch, w_codes, scales_u8, w_dec_rows, out
            else:
                # A column slice of a row-major out is a valid cuBLAS matrix (leading dimension N): torch writes it
                # in place, without a temporary (aten addmm_out_cuda_impl / prepare_matrix_for_cublas).
                w, codes, sf = scratch[:rows], w_codes[n0:n0 + rows], scales_u8[n0:n0 + rows]
                dec, dst = w_dec_rows[n0:n0 + rows], out[:, n0:n0 + rows]
            launches[rows](codes, sf, dec, w, rows, k, codes.stride(0), sf.stride(0), w.stride(0))
            if has_bias:
                dst.addmm_(x, w.t())
            else:
                torch.mm(x, w.t(), out=dst)
        return out

    return run
