"""Gluon W4A16 kernels for small batches (decode): ``out[T, N] = (x[T, K] @ W^T) * w_dec_rows[N] (+ bias)``.

The weight is the checkpoint's, untouched: codes ``[N, K/2]`` uint8 (element 2i in the low nibble) and linear e4m3
block scales ``[N, K/16]``.  Activations are bf16/fp16 ``[T, K]`` (row stride free, last dim contiguous); the output
has the activations' dtype.  ``w_dec_rows [N]`` fp32 is the per-output-row decode global (each fused part its own).

gemv_fma (T = 1..2, CUDA cores)
    A warp owns whole weight rows and walks K in steps of 1024: lane ``l`` holds 16 contiguous code bytes (two
    16-element scale groups, one 16-byte load) and the 32 matching activations (64 bytes).  Each group is summed
    in fp32 and multiplied by its scale once (the scale is constant over the group, so this is the same sum with
    15 fewer multiplies); lanes are reduced with shuffles at the end.  No shared memory.

gemv_mma (T up to 32, tensor cores, bf16/fp16 ``mma.sync`` m16n8k16)
    Weight rows on M (16 per CTA), tokens on N, and each warp its own 128-k block per step (warp ``w`` takes block
    ``i * WARPS + w``); the MMA is batched over warps (a rank-3 MMA layout with ``warps_per_cta = [WARPS, 1, 1]``)
    and the warps' partial sums are added at the end.  **k permutation**: inside each 128-k block the MMA operand
    index ``k' = 32c + 8t + j`` (c, t in 0..3, j in 0..7) holds memory element ``k = 32t + 8c + j``, i.e. bits
    [3:5) and [5:7) of k are swapped (an involution).  With ``k_width = 8`` the mma_v2 operand layout gives lane
    ``4g + t`` the operand indices ``{32c + 8t + j}`` — after the swap, memory ``[32t, 32t + 32)`` — for row g (and
    g + 8) of A and token g of B.  So one plain 16-byte load of codes per row and one 64-byte load of activations per
    token land in the mma fragments, the same permutation on both operands leaves the dot product unchanged, and
    the kernel asserts at compile time that the register relabelling needs no data movement
    (``convert_layout(..., assert_trivial=True)``).  tests/kernels/test_gluon_gemv.py models the mapping in Python
    and runs the kernel against the dequant reference (GPU).

e2m1 decode (``DECODE`` constexpr): the native cvt or the portable lop3/prmt table of :mod:`.gluon_common`.  e2m1 x
e4m3 products are exact in fp16 and bf16, so every path is exact up to fp32 summation order.

Cache policy: activations ``evict_last`` (every CTA re-reads them), weights the default policy (a weight
``evict_first`` measured slower in a full model step: it left dirty L2 lines for the next kernels).
K is a constexpr and the K loop is unrolled: one compile per (K, tile), as the model's shapes are few.  The
launchers take their tile (:class:`FmaTile` / :class:`MmaTile`) from the dispatch (``dispatch/linear.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .common import check_linear_inputs, trivial_linear_output
from .gluon_common import DECODE_CVT, DECODE_PORTABLE, default_decode  # noqa: F401  (the values of DECODE)
from .gluon_compat import HAS_GLUON, ampere, gl, gluon, require_gluon
from .launch import ReadyKernel

# ---------------------------------------------------------------------------------------------------------------
# Tiles (which one runs is the dispatch's choice)
# ---------------------------------------------------------------------------------------------------------------
FMA_K_STEP = 1024  # 32 lanes x 32 elements (16 code bytes) per warp step
MMA_K_BLOCK = 128  # the permuted block: 4 lanes x 32 elements
MMA_BLOCK_M = 16  # one m16 tile of weight rows per CTA
_K_STEP = gl.constexpr(FMA_K_STEP) if HAS_GLUON else None


@dataclass(frozen=True)
class FmaTile:
    block_t: int  # tokens per CTA (grid dim 1 covers the rest)
    rows_per_warp: int
    num_warps: int

    @property
    def block_n(self) -> int:
        return self.rows_per_warp * self.num_warps


@dataclass(frozen=True)
class MmaTile:
    block_t: int  # mma N: 8, 16 or 32 tokens per CTA
    num_warps: int  # warps split K: each takes every num_warps-th 128-k block
    block_m: int = MMA_BLOCK_M


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
# For the sm_120 compile harness: argument types as the launchers pass them (bf16 activations).
GEMV_FMA_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "wdec_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
    "T": "i32", "N": "i32", "stride_xt": "i32", "stride_wn": "i32", "stride_wsn": "i32", "stride_ot": "i32",
    "K": "constexpr", "HAS_BIAS": "constexpr", "DECODE": "constexpr", "BLOCK_T": "constexpr",
    "ROWS_PER_WARP": "constexpr", "WARPS": "constexpr",
}
GEMV_MMA_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "wdec_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
    "T": "i32", "N": "i32", "stride_xt": "i32", "stride_wn": "i32", "stride_wsn": "i32", "stride_ot": "i32",
    "K": "constexpr", "HAS_BIAS": "constexpr", "DECODE": "constexpr", "BLOCK_T": "constexpr", "WARPS": "constexpr",
}
# What the JIT marks divisible by 16 on checkpoint shapes (K % 256 == 0, so every row stride is).
GEMV_FMA_DIVISIBLE = [k for k, v in GEMV_FMA_SIGNATURE.items() if v.startswith("*")] + [
    "N", "stride_xt", "stride_wn", "stride_wsn", "stride_ot",
]
GEMV_MMA_DIVISIBLE = GEMV_FMA_DIVISIBLE


if HAS_GLUON:
    from .gluon_common import e2m1_pairs, split_pairs

    @gluon.jit(do_not_specialize=["T"])  # token counts vary per call
    def _gemv_fma_kernel(
        x_ptr, w_ptr, ws_ptr, wdec_ptr, bias_ptr, out_ptr,
        T, N, stride_xt, stride_wn, stride_wsn, stride_ot,
        K: gl.constexpr, HAS_BIAS: gl.constexpr, DECODE: gl.constexpr,
        BLOCK_T: gl.constexpr, ROWS_PER_WARP: gl.constexpr, WARPS: gl.constexpr,
    ):
        # Product tile [BLOCK_T, ROWS, 64 groups, 16]: tokens and rows in registers, lane l owns groups 2l, 2l+1.
        ROWS: gl.constexpr = ROWS_PER_WARP * WARPS
        L4: gl.constexpr = gl.BlockedLayout([BLOCK_T, ROWS_PER_WARP, 2, 16], [1, 1, 32, 1], [1, WARPS, 1, 1],
                                            [3, 2, 1, 0])
        C4: gl.constexpr = gl.BlockedLayout([BLOCK_T, ROWS_PER_WARP, 2, 8], [1, 1, 32, 1], [1, WARPS, 1, 1],
                                            [3, 2, 1, 0])
        # Codes as loaded: [ROWS, 512 bytes], 16 contiguous bytes per lane (one 16-byte load per row and step).
        CL: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 16], [1, 32], [WARPS, 1], [1, 0])
        W3: gl.constexpr = gl.SliceLayout(0, L4)  # weight values [ROWS, 64, 16]
        X3: gl.constexpr = gl.SliceLayout(1, L4)  # activations [BLOCK_T, 64, 16]
        C3: gl.constexpr = gl.SliceLayout(0, C4)  # codes [ROWS, 64, 8]
        S2: gl.constexpr = gl.SliceLayout(2, W3)  # scales [ROWS, 64]
        A3: gl.constexpr = gl.SliceLayout(3, L4)  # group sums [BLOCK_T, ROWS, 64]
        GROUPS: gl.constexpr = _K_STEP // 16
        STEPS: gl.constexpr = (K + _K_STEP - 1) // _K_STEP

        pid_n = gl.program_id(0)
        pid_t = gl.program_id(1)

        # Rows past N re-read row N-1 (no masks on the weight stream); only the store is masked.
        rows_c = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, CL))
        rows_c = gl.minimum(rows_c, N - 1).to(gl.int64)
        b_c = gl.arange(0, _K_STEP // 2, layout=gl.SliceLayout(0, CL))
        code_off = rows_c[:, None] * stride_wn + b_c[None, :]

        rows_s = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S2))
        rows_s = gl.minimum(rows_s, N - 1).to(gl.int64)
        g_s = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, S2))
        scale_off = rows_s[:, None] * stride_wsn + g_s[None, :]

        toks = pid_t * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3)))
        toks = gl.minimum(toks, T - 1).to(gl.int64)
        g_x = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
        e_x = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
        k_x = g_x[None, :, None] * 16 + e_x[None, None, :]
        x_off = toks[:, None, None] * stride_xt + k_x

        acc = gl.zeros([BLOCK_T, ROWS, GROUPS], gl.float32, A3)
        for s in gl.static_range(STEPS):
            k0 = s * _K_STEP
            if k0 + _K_STEP <= K:
                raw = gl.load(w_ptr + code_off + k0 // 2)
                sc = gl.load(ws_ptr + scale_off + k0 // 16)
                x = gl.load(x_ptr + x_off + k0, eviction_policy="evict_last")
            else:  # the K tail (K % 1024 != 0): zero codes, scales and activations contribute nothing
                raw = gl.load(w_ptr + code_off + k0 // 2, mask=(k0 // 2 + b_c[None, :]) < K // 2, other=0)
                sc = gl.load(ws_ptr + scale_off + k0 // 16, mask=(k0 + 16 * g_s[None, :]) < K, other=0)
                x = gl.load(x_ptr + x_off + k0, mask=(k0 + k_x) < K, other=0.0, eviction_policy="evict_last")
            codes = gl.convert_layout(raw.reshape([ROWS, GROUPS, 8]), C3, assert_trivial=True)
            lo, hi = split_pairs(e2m1_pairs(codes, DECODE, True), gl.float16)
            # [ROWS, 64, 8] x2 -> [ROWS, 64, 8, 2] -> [ROWS, 64, 16]: element 2b + h, i.e. memory order.
            w = gl.convert_layout(gl.join(lo, hi).reshape([ROWS, GROUPS, 16]), W3, assert_trivial=True)
            part = gl.sum(w.to(gl.float32)[None, :, :, :] * x.to(gl.float32)[:, None, :, :], axis=3)
            scale = gl.convert_layout(sc.to(gl.float8e4nv, bitcast=True).to(gl.float32),
                                      gl.SliceLayout(0, A3), assert_trivial=True)
            acc += part * scale[None, :, :]

        y = gl.sum(acc, axis=2)  # [BLOCK_T, ROWS]: the lane reduction
        Y2: gl.constexpr = gl.SliceLayout(2, A3)
        rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, Y2))
        toks_o = pid_t * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, Y2))
        row_ok = rows < N
        y = y * gl.load(wdec_ptr + rows, mask=row_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)[None, :]
        out_ptrs = out_ptr + toks_o[:, None].to(gl.int64) * stride_ot + rows[None, :]
        gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(toks_o[:, None] < T) & row_ok[None, :])

    @gluon.jit(do_not_specialize=["T"])  # token counts vary per call
    def _gemv_mma_kernel(
        x_ptr, w_ptr, ws_ptr, wdec_ptr, bias_ptr, out_ptr,
        T, N, stride_xt, stride_wn, stride_wsn, stride_ot,
        K: gl.constexpr, HAS_BIAS: gl.constexpr, DECODE: gl.constexpr,
        BLOCK_T: gl.constexpr, WARPS: gl.constexpr,
    ):
        BM: gl.constexpr = 16
        KB: gl.constexpr = 128  # the permuted block
        DT: gl.constexpr = x_ptr.dtype.element_ty
        F16: gl.constexpr = DT == gl.float16
        ITERS: gl.constexpr = (K + KB * WARPS - 1) // (KB * WARPS)

        # mma_v2 batched over warps: dim 0 is the warp, i.e. which 128-k block of the step it multiplies.
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
        # Codes [WARPS, BM, 64 bytes]: lane 4g + t reads rows g, g + 8 at bytes [16t, 16t + 16) (one 16-byte load
        # each); C4 is the same placement seen as [WARPS, BM, 8 groups, 8 bytes], to apply the scales.
        C3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        C4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        S3: gl.constexpr = gl.SliceLayout(3, C4)  # scales [WARPS, BM, 8]: 2 bytes per lane
        # Activations [WARPS, BLOCK_T, 128]: lane 4g + t reads token g (+8, +16, +24) at k [32t, 32t + 32).
        X3: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])

        pid_m = gl.program_id(0)
        pid_t = gl.program_id(1)

        # ---- code and scale offsets (rows past N re-read row N-1; only the store is masked)
        w_c = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, C3)))
        m_c = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, C3)))
        b_c = gl.arange(0, KB // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, C3)))
        rows_c = gl.minimum(pid_m * BM + m_c, N - 1).to(gl.int64)
        kb_c = w_c[:, None, None] * (KB // 2) + b_c[None, None, :]
        code_off = rows_c[None, :, None] * stride_wn + kb_c

        w_s = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, S3)))
        m_s = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, S3)))
        g_s = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, S3)))
        rows_s = gl.minimum(pid_m * BM + m_s, N - 1).to(gl.int64)
        ks_s = w_s[:, None, None] * (KB // 16) + g_s[None, None, :]
        scale_off = rows_s[None, :, None] * stride_wsn + ks_s

        # ---- activation offsets (tokens past T re-read token T-1)
        w_x = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3)))
        n_x = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
        k_x = gl.arange(0, KB, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
        toks = gl.minimum(pid_t * BLOCK_T + n_x, T - 1).to(gl.int64)
        kx = w_x[:, None, None] * KB + k_x[None, None, :]
        x_off = toks[None, :, None] * stride_xt + kx

        acc = gl.zeros([WARPS, BM, BLOCK_T], gl.float32, MMA)
        for i in gl.static_range(ITERS):
            k0 = i * KB * WARPS
            if k0 + KB * WARPS <= K:
                raw = gl.load(w_ptr + code_off + k0 // 2)
                sc = gl.load(ws_ptr + scale_off + k0 // 16)
                x = gl.load(x_ptr + x_off + k0, eviction_policy="evict_last")
            else:  # K tail: whole blocks of some warps and/or part of one block
                raw = gl.load(w_ptr + code_off + k0 // 2, mask=(k0 // 2 + kb_c) < K // 2, other=0)
                sc = gl.load(ws_ptr + scale_off + k0 // 16, mask=(k0 // 16 + ks_s) < K // 16, other=0)
                x = gl.load(x_ptr + x_off + k0, mask=(k0 + kx) < K, other=0.0, eviction_policy="evict_last")
            # Weights: decode, scale per 16-group (exact in fp16/bf16), then the k permutation as a relabelling.
            codes = gl.convert_layout(raw.reshape([WARPS, BM, 8, 8]), C4, assert_trivial=True)
            lo, hi = split_pairs(e2m1_pairs(codes, DECODE, F16), DT)
            s16 = sc.to(gl.float8e4nv, bitcast=True).to(DT)[:, :, :, None]
            w = gl.join(lo * s16, hi * s16)  # [WARPS, BM, 8, 8, 2]: memory k = 16 g + 2 b + h = 32 t + 8 c + j
            w = w.reshape([WARPS, BM, 4, 4, 8]).permute(0, 1, 3, 2, 4).reshape([WARPS, BM, KB])
            a = gl.convert_layout(w, A_OP, assert_trivial=True)
            # Activations: the same relabelling of k, then K-major for operand B.
            xv = x.reshape([WARPS, BLOCK_T, 4, 4, 8]).permute(0, 1, 3, 2, 4).reshape([WARPS, BLOCK_T, KB])
            b = gl.convert_layout(xv.permute(0, 2, 1), B_OP, assert_trivial=True)
            acc = ampere.mma_v2(a, b, acc)

        y = gl.sum(acc, axis=0)  # [BM, BLOCK_T]: the cross-warp reduction (through shared memory)
        O2: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, WARPS], [0, 1])  # rows fastest: coalesced
        y = gl.convert_layout(y, O2)
        rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, O2))
        toks_o = pid_t * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, O2))
        row_ok = rows < N
        y = y * gl.load(wdec_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if HAS_BIAS:
            y += gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)[:, None]
        out_ptrs = out_ptr + toks_o[None, :].to(gl.int64) * stride_ot + rows[:, None]
        gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (toks_o[None, :] < T))


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------
def _check_gemv_args(fn, x, w_codes, w_scales, w_dec_rows, bias, out):
    """The linear launchers' checks; the Gluon kernels also want the bias in x's dtype."""
    from ..format.checks import check_tensor

    t, n, k, w_scales, out = check_linear_inputs(fn, x, w_codes, w_scales, w_dec_rows, bias, out)
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype)
    return t, n, k, w_scales, out


def prepare_gemv(kind: str, t: int, n: int, k: int, device, dtype, *, tile: FmaTile | MmaTile, has_bias: bool,
                 decode: int | None = None):
    """A ready launch of the ``kind`` ("fma" / "mma") gemv for ``x [t, k]`` of ``dtype`` on ``device`` and an
    ``[n, k]`` weight: grid and compile-time arguments fixed here, once.  The returned
    ``run(x, w_codes, w_scales_u8, w_dec_rows, bias, out) -> out`` checks nothing: its inputs are those
    :func:`gemv_fma` / :func:`gemv_mma` accept, with ``t, n, k > 0`` (the callers' trivial cases are theirs)."""
    decode = default_decode(device, dtype) if decode is None else decode
    const = dict(K=k, HAS_BIAS=has_bias, DECODE=decode, BLOCK_T=tile.block_t, WARPS=tile.num_warps,
                 num_warps=tile.num_warps)
    if kind == "fma":
        kernel, block_rows = _gemv_fma_kernel, tile.block_n
        const["ROWS_PER_WARP"] = tile.rows_per_warp
    else:
        kernel, block_rows = _gemv_mma_kernel, tile.block_m
    launch = ReadyKernel(kernel, (triton.cdiv(n, block_rows), triton.cdiv(t, tile.block_t)), **const)

    def run(x, w_codes, w_scales_u8, w_dec_rows, bias, out):
        launch(x, w_codes, w_scales_u8, w_dec_rows, out if bias is None else bias, out,
               t, n, x.stride(0), w_codes.stride(0), w_scales_u8.stride(0), out.stride(0))
        return out

    return run


def gemv_fma(x, w_codes, w_scales, w_dec_rows, *, tile: FmaTile, bias=None, decode: int | None = None, out=None):
    """``(x @ W^T) * w_dec_rows (+ bias)`` on CUDA cores; meant for T <= 2 (any T works, in blocks of tile.block_t).

    ``decode=None``: :func:`.gluon_common.default_decode` for x's GPU."""
    require_gluon("gemv_fma")
    t, n, k, w_scales, out = _check_gemv_args("gemv_fma", x, w_codes, w_scales, w_dec_rows, bias, out)
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    run = prepare_gemv("fma", t, n, k, x.device, x.dtype, tile=tile, has_bias=bias is not None, decode=decode)
    return run(x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias, out)


def gemv_mma(x, w_codes, w_scales, w_dec_rows, *, tile: MmaTile, bias=None, decode: int | None = None, out=None):
    """``(x @ W^T) * w_dec_rows (+ bias)`` on tensor cores (bf16/fp16 mma.sync); meant for T <= 32 (any T works,
    in blocks of tile.block_t).  ``decode`` as in :func:`gemv_fma`."""
    require_gluon("gemv_mma")
    t, n, k, w_scales, out = _check_gemv_args("gemv_mma", x, w_codes, w_scales, w_dec_rows, bias, out)
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    run = prepare_gemv("mma", t, n, k, x.device, x.dtype, tile=tile, has_bias=bias is not None, decode=decode)
    return run(x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias, out)
