"""W4A16 linears on the checkpoint's own NVFP4 weight: ``out[T, N] = (x @ W^T) * w_dec_rows (+ bias)``.

``x`` is bf16/fp16 ``[T, K]`` (rows may be strided); ``W`` is the checkpoint's row-major codes ``[N, K/2]`` (element
2i in the low nibble) with linear e4m3 block scales ``[N, K/16]``, read as stored: one copy, no repack.  The
weight is decoded in registers to ``e2m1 * e4m3`` in the activation dtype — exact, at most 5 significant bits —
and fed to a 16-bit ``tl.dot`` with fp32 accumulation.  The per-tensor decode global is applied per output row
in the epilogue (``w_dec_rows [N]`` fp32): a fused weight (qkv, gate_up) keeps one global per logical part and
the caller expands them to rows (``format.LinearProblem.dec_rows``).

Two kernels:

* ``_w4a16_gemv_kernel`` (T = 1..16, decode): streams the weight once.  The MMA is swapped (``W [BN, BK] @
  x^T [BK, 16]``) so that the weight rows fill the MMA's M = 16.. side and the few tokens its N = 16 side;
  tokens past T are masked to zero.  Grid ``(N tiles, SPLIT_K, T tiles of 16)``: when N alone gives too few
  programs to keep DRAM busy, K is split and the fp32 partials go to a workspace ``[SPLIT_K, T, N]`` that a small
  finish kernel sums **in split order**.  That two-pass reduction was chosen over fp32 atomics because it is
  deterministic (run to run and batch to batch), needs no zeroing pass before each call, and under CUDA graphs its
  workspace size depends only on (SPLIT_K, T, N); its extra traffic is ``SPLIT_K * T * N * 8`` bytes, a few percent
  of the weight for the splits the dispatch picks (and mostly L2-resident).
* ``_w4a16_gemm_kernel`` (T > 16, prefill): ``x [BM, BK] @ W^T [BK, BN]`` tiles in grouped order, the decoded
  weight tile reused by BM rows, pipelined loads of x and the packed weight.

``FAST_DECODE=True`` decodes with the lop3/prmt inline-PTX table (sm_80+, sm_90, sm_120; bit-exact);
``FAST_DECODE=False`` with pure ``tl`` arithmetic, which the interpreter can run (fp16 only there: bf16
``tl.dot`` is wrong in the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import check_linear_inputs, check_workspace, interpreting, trivial_linear_output
from .fp4_decode import dequant_rows_16bit
from .launch import ReadyKernel
from .tile_order import grouped_tile

# The MMA's token side: tl.dot needs every dimension >= 16, so the decode kernel pads T up to 16 with masked rows.
GEMV_BLOCK_T = 16

# ---------------------------------------------------------------------------------------------------------------
# Decode (small batch) kernel
# ---------------------------------------------------------------------------------------------------------------

# For the sm_120 compile harness: argument types as the launcher passes them (bf16 activations).
W4A16_GEMV_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "w_sf_ptr": "*u8", "dec_ptr": "*fp32", "bias_ptr": "*bf16",
    "out_ptr": "*bf16", "ws_ptr": "*fp32",
    "T": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32",
    "stride_xt": "i32", "stride_wn": "i32", "stride_wsn": "i32", "stride_ot": "i32",
    "HAS_BIAS": "constexpr", "SPLIT": "constexpr", "EVEN_K": "constexpr", "FAST_DECODE": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "BLOCK_T": "constexpr",
}
# What the JIT marks divisible by 16 on real checkpoint shapes (N % 16 == 0, K % 256 == 0).  T is not: it is the
# batch size.
W4A16_GEMV_DIVISIBLE = [k for k, v in W4A16_GEMV_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "K_SPLIT", "stride_xt", "stride_wn", "stride_wsn", "stride_ot",
]


@triton.jit(do_not_specialize=["T"])  # token counts vary per call
def _w4a16_gemv_kernel(
    x_ptr, w_ptr, w_sf_ptr, dec_ptr, bias_ptr, out_ptr, ws_ptr,
    T, N, K, K_SPLIT,
    stride_xt, stride_wn, stride_wsn, stride_ot,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    FAST_DECODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    n_ok = offs_n < N
    t_ok = offs_t < T

    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    # K_SPLIT is a multiple of BLOCK_K; saying so keeps the weight and scale loads 16-byte vectors (Triton
    # only knows K_SPLIT % 16 == 0, so k_begin // 16 would look unaligned).
    kb_begin = tl.multiple_of(pid_k * (K_SPLIT // 2), BLOCK_K // 2)
    ks_begin = tl.multiple_of(pid_k * (K_SPLIT // 16), BLOCK_K // 16)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (kb_begin + offs_kb)[None, :]
    w_sf_ptrs = w_sf_ptr + offs_n[:, None].to(tl.int64) * stride_wsn + (ks_begin + offs_ks)[None, :]
    x_ptrs = x_ptr + offs_t[None, :].to(tl.int64) * stride_xt + (k_begin + offs_k)[:, None]  # x^T: [BLOCK_K, BLOCK_T]

    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # K_SPLIT is a multiple of BLOCK_K, so only the last tile of the last split can cross K; zero codes and
        # zero activations past K add exactly 0.  The weight is read once: do not let it push x out of L2.
        if EVEN_K:
            # No K mask: the loads stay 16-byte vectors (a mask on K // 16 would split them into bytes).
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
            w_sf = tl.load(w_sf_ptrs, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=t_ok[None, :], other=0.0, eviction_policy="evict_last")
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & ((k0 // 2 + offs_kb) < K // 2)[None, :], other=0,
                        eviction_policy="evict_first")
            w_sf = tl.load(w_sf_ptrs, mask=n_ok[:, None] & ((k0 // 16 + offs_ks) < K // 16)[None, :], other=0,
                           eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=((k0 + offs_k) < K)[:, None] & t_ok[None, :], other=0.0,
                         eviction_policy="evict_last")
        wv = dequant_rows_16bit(w, w_sf, BLOCK_N, BLOCK_K, dtype, FAST_DECODE)
        acc = tl.dot(wv, xt, acc)
        w_ptrs += BLOCK_K // 2
        w_sf_ptrs += BLOCK_K // 16
        x_ptrs += BLOCK_K

    mask = n_ok[:, None] & t_ok[None, :]
    if SPLIT:
        # Raw fp32 partial sums; the finish kernel adds them in split order and applies the epilogue.
        ws_ptrs = ws_ptr + (pid_k * T + offs_t[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=mask)
    else:
        acc = acc * tl.load(dec_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_t[None, :].to(tl.int64) * stride_ot + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


W4A16_FINISH_SIGNATURE = {
    "ws_ptr": "*fp32", "dec_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
    "T": "i32", "N": "i32", "SPLIT_K": "i32", "stride_ot": "i32",
    "HAS_BIAS": "constexpr", "BLOCK_N": "constexpr",
}
W4A16_FINISH_DIVISIBLE = ["ws_ptr", "dec_ptr", "bias_ptr", "out_ptr", "N", "stride_ot"]


@triton.jit(do_not_specialize=["T"])  # token counts vary per call
def _w4a16_splitk_finish_kernel(
    ws_ptr, dec_ptr, bias_ptr, out_ptr,
    T, N, SPLIT_K, stride_ot,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[t, n] = sum_s ws[s, t, n] * dec[n] (+ bias[n])``, summed in split order (deterministic)."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(ws_ptr + (s * T + t).to(tl.int64) * N + offs_n, mask=n_ok, other=0.0)
    acc = acc * tl.load(dec_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


FINISH_BLOCK_N = 1024

# ---------------------------------------------------------------------------------------------------------------
# Prefill GEMM kernel
# ---------------------------------------------------------------------------------------------------------------

W4A16_GEMM_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "w_sf_ptr": "*u8", "dec_ptr": "*fp32", "bias_ptr": "*bf16",
    "out_ptr": "*bf16",
    "T": "i32", "N": "i32", "K": "i32",
    "stride_xt": "i32", "stride_wn": "i32", "stride_wsn": "i32", "stride_ot": "i32",
    "HAS_BIAS": "constexpr", "EVEN_K": "constexpr", "FAST_DECODE": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
    "SWAP_AB": "constexpr",
}
W4A16_GEMM_DIVISIBLE = [k for k, v in W4A16_GEMM_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_xt", "stride_wn", "stride_wsn", "stride_ot",
]


@triton.jit(do_not_specialize=["T"])  # token counts vary per call
def _w4a16_gemm_kernel(
    x_ptr, w_ptr, w_sf_ptr, dec_ptr, bias_ptr, out_ptr,
    T, N, K,
    stride_xt, stride_wn, stride_wsn, stride_ot,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    FAST_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), T, N, BLOCK_M, BLOCK_N, GROUP_M)
    dtype = x_ptr.dtype.element_ty

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    m_ok = offs_m < T
    n_ok = offs_n < N

    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_kb[None, :]
    w_sf_ptrs = w_sf_ptr + offs_n[:, None].to(tl.int64) * stride_wsn + offs_ks[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Zero codes and zero activations past K contribute exactly 0: a K tail needs no special case.
        if EVEN_K:
            # No K mask: the loads stay 16-byte vectors (a mask on K // 16 would split them into bytes).
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            w_sf = tl.load(w_sf_ptrs, mask=n_ok[:, None], other=0)
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & ((k0 // 2 + offs_kb) < K // 2)[None, :], other=0)
            w_sf = tl.load(w_sf_ptrs, mask=n_ok[:, None] & ((k0 // 16 + offs_ks) < K // 16)[None, :], other=0)
        wv = dequant_rows_16bit(w, w_sf, BLOCK_N, BLOCK_K, dtype, FAST_DECODE)
        if SWAP_AB:
            acc = tl.dot(wv, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(wv), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        w_sf_ptrs += BLOCK_K // 16

    if SWAP_AB:
        acc = tl.trans(acc)
    acc = acc * tl.load(dec_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------
# Launchers (tiles from dispatch/linear.py)
# ---------------------------------------------------------------------------------------------------------------


def w4a16_gemv(
    x,
    w_codes,
    w_scales,
    w_dec_rows,
    bias=None,
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
    fast_decode: bool | None = None,
    out=None,
    workspace=None,
):
    """``x [T, K] @ W^T * w_dec_rows (+ bias)`` with the decode kernel (meant for small T; any T works).

    ``split_k`` (the dispatch picks it from the shape and the SM count) splits K into that many parts, at most;
    with more than one the fp32 partials need a workspace of ``split_k * T * N`` floats: pass ``workspace`` (any
    fp32 tensor with that many elements) to reuse one, else it is allocated here (size from shapes only, fine
    under CUDA graph capture).
    ``fast_decode=None``: the inline-PTX decode on a GPU, the pure-``tl`` decode in the interpreter.
    """
    import torch

    t, n, k, w_scales, out = check_linear_inputs("w4a16_gemv", x, w_codes, w_scales, w_dec_rows, bias, out)
    if block_k % 64 or block_n % 16 or block_n < 16:
        raise ValueError(f"w4a16_gemv: block_k ({block_k}) must be a multiple of 64 and block_n ({block_n}) of 16")
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    if workspace is not None and (numel := gemv_workspace_numel(t, n, k, block_k, split_k)):
        check_workspace(workspace, numel, x.device)
    run = prepare_w4a16_gemv(t, n, k, block_n=block_n, block_k=block_k, split_k=split_k,
                             num_warps=num_warps, num_stages=num_stages, has_bias=bias is not None,
                             fast_decode=fast_decode)
    return run(x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias, out, workspace)


def _gemv_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(K per split, number of splits)``: at most ``split_k`` splits of whole ``block_k`` tiles, none empty."""
    k_split = triton.cdiv(triton.cdiv(k, max(1, split_k)), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def gemv_workspace_numel(t: int, n: int, k: int, block_k: int, split_k: int) -> int:
    """fp32 elements of the split-K workspace :func:`w4a16_gemv` needs (0 without a split)."""
    splits = _gemv_splits(k, block_k, split_k)[1]
    return splits * t * n if splits > 1 else 0


def prepare_w4a16_gemv(t: int, n: int, k: int, *, block_n: int, block_k: int, split_k: int, num_warps: int,
                       num_stages: int, has_bias: bool, fast_decode: bool | None = None):
    """A ready launch of :func:`w4a16_gemv` for ``x [t, k]`` and an ``[n, k]`` weight: grids and
    compile-time arguments fixed here, once.  The returned ``run(x, w_codes, w_scales_u8, w_dec_rows, bias, out,
    workspace=None) -> out`` checks nothing (its inputs are those :func:`w4a16_gemv` accepts, ``t, n, k > 0``); it
    allocates the split-K workspace when none is given."""
    import torch

    if fast_decode is None:
        fast_decode = not interpreting()
    k_split, splits = _gemv_splits(k, block_k, split_k)
    split = splits > 1
    main = ReadyKernel(_w4a16_gemv_kernel, (triton.cdiv(n, block_n), splits, triton.cdiv(t, GEMV_BLOCK_T)),
                       HAS_BIAS=has_bias, SPLIT=split, EVEN_K=k % block_k == 0, FAST_DECODE=bool(fast_decode),
                       BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=GEMV_BLOCK_T, num_warps=num_warps,
                       num_stages=num_stages)
    finish = ReadyKernel(_w4a16_splitk_finish_kernel, (t, triton.cdiv(n, FINISH_BLOCK_N)),
                         HAS_BIAS=has_bias, BLOCK_N=FINISH_BLOCK_N, num_warps=4)
    numel = splits * t * n

    def run(x, w_codes, w_scales_u8, w_dec_rows, bias, out, workspace=None):
        bias_arg = out if bias is None else bias
        if split and workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=x.device)
        main(x, w_codes, w_scales_u8, w_dec_rows, bias_arg, out, workspace if split else out,
             t, n, k, k_split, x.stride(0), w_codes.stride(0), w_scales_u8.stride(0), out.stride(0))
        if split:
            finish(workspace, w_dec_rows, bias_arg, out, t, n, splits, out.stride(0))
        return out

    return run


def w4a16_gemm(
    x,
    w_codes,
    w_scales,
    w_dec_rows,
    bias=None,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    swap_ab: bool = False,
    fast_decode: bool | None = None,
    out=None,
):
    """``x [T, K] @ W^T * w_dec_rows (+ bias)`` with the prefill GEMM (meant for T above the decode sizes).

    ``swap_ab`` computes the transposed tile ``W [BN, BK] @ x^T`` so the decoded weight is the MMA's A operand
    (on sm_90 wgmma takes it straight from registers).

    ``fast_decode=None``: the inline-PTX decode on a GPU, the pure-``tl`` decode in the interpreter.
    """
    import torch

    t, n, k, w_scales, out = check_linear_inputs("w4a16_gemm", x, w_codes, w_scales, w_dec_rows, bias, out)
    if block_k % 16 or block_k < 16 or block_m < 16 or block_n < 16:
        raise ValueError(f"w4a16_gemm: block_m/n/k ({block_m}, {block_n}, {block_k}) must be >= 16, block_k % 16 == 0")
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    run = prepare_w4a16_gemm(t, n, k, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                             num_warps=num_warps, num_stages=num_stages, swap_ab=swap_ab, has_bias=bias is not None,
                             fast_decode=fast_decode)
    return run(x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias, out)


def prepare_w4a16_gemm(t: int, n: int, k: int, *, block_m: int, block_n: int, block_k: int, group_m: int,
                       num_warps: int, num_stages: int, swap_ab: bool, has_bias: bool, fast_decode: bool | None = None):
    """A ready launch of :func:`w4a16_gemm` for ``x [t, k]`` and an ``[n, k]`` weight (grid and compile-time
    arguments fixed once); ``run(x, w_codes, w_scales_u8, w_dec_rows, bias, out) -> out`` checks nothing."""
    if fast_decode is None:
        fast_decode = not interpreting()
    launch = ReadyKernel(_w4a16_gemm_kernel, (triton.cdiv(t, block_m) * triton.cdiv(n, block_n),),
                         HAS_BIAS=has_bias, EVEN_K=k % block_k == 0, FAST_DECODE=bool(fast_decode),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, SWAP_AB=bool(swap_ab),
                         num_warps=num_warps, num_stages=num_stages)

    def run(x, w_codes, w_scales_u8, w_dec_rows, bias, out):
        launch(x, w_codes, w_scales_u8, w_dec_rows, out if bias is None else bias, out, t, n, k,
               x.stride(0), w_codes.stride(0), w_scales_u8.stride(0), out.stride(0))
        return out

    return run
