"""W4A4 NVFP4 GEMM on Triton ``tl.dot_scaled``: ``out[M, N] = alpha * (A_fp4 @ W_fp4^T) (+ bias)``.

Operands are what the checkpoint and the activation quantizer give, untouched:
  A: codes ``[M, K/2]`` u8 + linear e4m3 scales ``[M, K/16]``;  W: codes ``[N, K/2]`` u8 (row-major, as loaded)
  + linear e4m3 scales ``[N, K/16]``.  ``alpha`` is a device fp32 scalar (input decode x weight decode) so no host
  sync is needed.

``DECODE=False``: ``tl.dot_scaled(e2m1, e2m1, ue4m3 scales)`` — the native ``mma ... kind::mxf4nvf4 ...
scale_vec::4X`` (OMMA) on sm_120, tcgen05 on sm_100, and on sm_90 Triton >= 3.8 decomposes it into an exact
fp4 → bf16 decode + wgmma.  ``DECODE=True``: the kernel decodes itself (pure ``tl``) and runs an fp16 ``tl.dot``;
this is what the interpreter and Triton < 3.8 can run, and it is exact for the same reason.  W's tile is read
as ``[BLOCK_K/2, BLOCK_N]`` (K-packed) because ``rhs_k_pack=False`` crashes or miscompiles on sm_120.
"""

import triton
import triton.language as tl

from .fp4_decode import expand_scales_f32, unpack_rows_f32
from .launch import ReadyKernel
from .tile_order import grouped_tile


# For the sm_120 compile harness: argument types as the launcher passes them (bf16 output).
W4A4_SIGNATURE = {
    "a_ptr": "*u8", "a_sf_ptr": "*u8", "w_ptr": "*u8", "w_sf_ptr": "*u8", "out_ptr": "*bf16", "alpha_ptr": "*fp32",
    "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_asm": "i32",
    "stride_wn": "i32", "stride_wsn": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr", "DECODE": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
}
# What the JIT marks divisible by 16 for real checkpoint shapes (K % 256 == 0): without it there is no
# multi-stage pipelining and the 64x64 tile spills, so the compile check would not describe what runs.
W4A4_DIVISIBLE = [k for k, v in W4A4_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_am", "stride_asm", "stride_wn", "stride_wsn", "stride_om",
]


@triton.jit(do_not_specialize=["M"])  # token counts vary per call
def _w4a4_gemm_kernel(
    a_ptr, a_sf_ptr, w_ptr, w_sf_ptr, out_ptr, alpha_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    HAS_BIAS: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)  # packed bytes
    offs_ks = tl.arange(0, BLOCK_K // 16)  # block scales
    m_ok = offs_m < M
    n_ok = offs_n < N

    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_kb[None, :]
    a_sf_ptrs = a_sf_ptr + offs_m[:, None].to(tl.int64) * stride_asm + offs_ks[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_kb[:, None]  # [BLOCK_K/2, BLOCK_N]
    w_sf_ptrs = w_sf_ptr + offs_n[:, None].to(tl.int64) * stride_wsn + offs_ks[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Zero codes and zero scales past K contribute exactly 0, so a K tail needs no special case.
        kb_ok = (k0 // 2 + offs_kb) < K // 2
        ks_ok = (k0 // 16 + offs_ks) < K // 16
        a = tl.load(a_ptrs, mask=m_ok[:, None] & kb_ok[None, :], other=0)
        w = tl.load(w_ptrs, mask=kb_ok[:, None] & n_ok[None, :], other=0)
        a_sf = tl.load(a_sf_ptrs, mask=m_ok[:, None] & ks_ok[None, :], other=0)
        w_sf = tl.load(w_sf_ptrs, mask=n_ok[:, None] & ks_ok[None, :], other=0)
        if DECODE:
            av = unpack_rows_f32(a, BLOCK_M, BLOCK_K) * expand_scales_f32(a_sf, BLOCK_M, BLOCK_K)
            wv = unpack_rows_f32(tl.trans(w), BLOCK_N, BLOCK_K) * expand_scales_f32(w_sf, BLOCK_N, BLOCK_K)
            acc = tl.dot(av.to(tl.float16), tl.trans(wv.to(tl.float16)), acc)
        else:
            acc = tl.dot_scaled(
                a, a_sf.to(tl.float8e4nv, bitcast=True), "e2m1",
                w, w_sf.to(tl.float8e4nv, bitcast=True), "e2m1", acc,
            )
        a_ptrs += BLOCK_K // 2
        w_ptrs += BLOCK_K // 2
        a_sf_ptrs += BLOCK_K // 16
        w_sf_ptrs += BLOCK_K // 16

    acc = acc * tl.load(alpha_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w4a4_gemm(
    a_codes,
    a_scales,
    w_codes,
    w_scales,
    alpha,
    out_dtype,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    bias=None,
    decode: bool = False,
    out=None,
):
    """``alpha * (A @ W^T) (+ bias)`` for NVFP4 A ``[M, K/2]`` and W ``[N, K/2]`` with linear e4m3 scales, on the
    tile the dispatch picks (``dispatch/linear.py``)."""
    import torch

    from ..format.checks import as_e4m3, check_tensor

    check_tensor("a_codes", a_codes, dtype=torch.uint8, ndim=2, last_dim_contiguous=True)
    check_tensor("w_codes", w_codes, dtype=torch.uint8, ndim=2, last_dim_contiguous=True)
    m, kh = a_codes.shape
    n = w_codes.shape[0]
    k = 2 * kh
    if k % 16 or block_k < 64 or block_k % 64:
        raise ValueError(f"w4a4_gemm: K = {k} must be a multiple of 16 and block_k ({block_k}) a multiple of 64")
    check_tensor("w_codes", w_codes, shape=[None, kh])
    a_scales = as_e4m3("a_scales", a_scales)
    w_scales = as_e4m3("w_scales", w_scales)
    check_tensor("a_scales", a_scales, shape=[m, k // 16], last_dim_contiguous=True)
    check_tensor("w_scales", w_scales, shape=[n, k // 16], last_dim_contiguous=True)
    check_tensor("alpha", alpha, dtype=torch.float32)
    if alpha.numel() != 1:
        raise ValueError(f"alpha: expected one fp32 value, got shape {list(alpha.shape)}")
    if bias is not None:
        check_tensor("bias", bias, shape=[n])
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a_codes.device)
    if m == 0 or n == 0:
        return out
    run = prepare_w4a4_gemm(m, n, k, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                            num_warps=num_warps, num_stages=num_stages, has_bias=bias is not None, decode=decode)
    return run(a_codes, a_scales.view(torch.uint8), w_codes, w_scales.view(torch.uint8), alpha, bias, out)


def prepare_w4a4_gemm(m: int, n: int, k: int, *, block_m: int, block_n: int, block_k: int, group_m: int,
                      num_warps: int, num_stages: int, has_bias: bool, decode: bool = False):
    """A ready launch of :func:`w4a4_gemm` for ``A [m, k]`` and ``W [n, k]`` (grid and compile-time arguments fixed
    once); ``run(a_codes, a_scales_u8, w_codes, w_scales_u8, alpha, bias, out) -> out`` checks nothing (its inputs
    are those :func:`w4a4_gemm` accepts, ``m, n > 0``)."""
    launch = ReadyKernel(_w4a4_gemm_kernel, (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),),
                         HAS_BIAS=has_bias, DECODE=decode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages)

    def run(a_codes, a_scales_u8, w_codes, w_scales_u8, alpha, bias, out):
        launch(a_codes, a_scales_u8, w_codes, w_scales_u8, out, alpha, out if bias is None else bias, m, n, k,
               a_codes.stride(0), a_scales_u8.stride(0), w_codes.stride(0), w_scales_u8.stride(0), out.stride(0))
        return out

    return run
