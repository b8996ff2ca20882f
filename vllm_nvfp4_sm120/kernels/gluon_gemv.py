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

e2m1 decode (``DECODE`` constexpr): ``DECODE_CVT`` uses the native ``cvt.rn.{f16,bf16}x2.e2m1x2`` (sm_100a/sm_120a;
the bf16 form needs PTX ISA 9.2, i.e. Triton >= 3.8); ``DECODE_PORTABLE`` is an exact lop3/prmt table that runs on
any sm_80+ (the H200 tests use it).  Both give, per code byte, one 32-bit register holding two 16-bit floats (low
half = low nibble = even k); the asm strings live in ``E2M1_ASM`` below and are checked bit-exactly on CPU by a
PTX model in the tests.  e2m1 x e4m3 products are exact in fp16 and bf16, so every path is exact up to fp32
summation order.

Cache policy: activations ``evict_last`` (every CTA re-reads them), weights the default policy (a weight
``evict_first`` measured slower in a full model step: it left dirty L2 lines for the next kernels).
K is a constexpr and the K loop is unrolled: one compile per (K, tile), as the model's shapes are few.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .gluon_compat import HAS_GLUON, ampere, gl, gluon, ptx_isa_version, require_gluon
from .w4a16_linear import check_linear_inputs, trivial_linear_output

# ---------------------------------------------------------------------------------------------------------------
# e2m1 decode: inline PTX, 4 code bytes in ($4) -> 4 registers out ($0..$3), output i = byte i as a 16-bit pair.
# ---------------------------------------------------------------------------------------------------------------
DECODE_CVT = 0  # native cvt (sm_100a / sm_120a)
DECODE_PORTABLE = 1  # lop3/prmt table, any sm_80+

_CVT_TEMPLATE = (
    "{ .reg .b8 b<4>; mov.b32 {b0, b1, b2, b3}, $4; "
    "cvt.rn.%s.e2m1x2 $0, b0; cvt.rn.%s.e2m1x2 $1, b1; cvt.rn.%s.e2m1x2 $2, b2; cvt.rn.%s.e2m1x2 $3, b3; }"
)
# prmt(a, b, sel) picks byte sel_nibble from the 8 bytes {b:a}; a code's low 3 bits index the magnitude table,
# (code >> 3) indexes {0x00, 0x80} for the sign byte (Triton's FP4ToBP16 trick, notes §5).
E2M1_ASM = {
    ("cvt", "f16"): _CVT_TEMPLATE % (("f16x2",) * 4),
    ("cvt", "bf16"): _CVT_TEMPLATE % (("bf16x2",) * 4),
    # fp16 |e2m1| = 0, .5, 1, 1.5, 2, 3, 4, 6 has a zero low byte; high bytes 00 38 3C 3E 40 42 44 46.
    ("portable", "f16"): (
        "{ .reg .b32 a<11>; "
        "and.b32 a0, $4, 0x88888888; shr.u32 a1, a0, 3; shr.u32 a2, a0, 19; "
        "and.b32 a3, $4, 0x77777777; shr.u32 a4, a3, 16; "
        "prmt.b32 a5, 0x3E3C3800, 0x46444240, a3; prmt.b32 a6, 0x3E3C3800, 0x46444240, a4; "
        "prmt.b32 a7, 0x8000, 0, a1; prmt.b32 a8, 0x8000, 0, a2; "
        "or.b32 a9, a5, a7; or.b32 a10, a6, a8; "
        "prmt.b32 $0, a9, 0, 0x1404; prmt.b32 $1, a9, 0, 0x3424; "
        "prmt.b32 $2, a10, 0, 0x1404; prmt.b32 $3, a10, 0, 0x3424; }"
    ),
    # Triton's own bf16 table (Fp4ToFpOpToLLVM), bit-exact on the H200 for all 256 bytes (notes §5).
    ("portable", "bf16"): (
        "{ .reg .b32 a<13>; "
        "and.b32 a0, $4, 0x88888888; shr.u32 a1, a0, 3; and.b32 a2, $4, 0x77777777; shr.u32 a3, a2, 16; "
        "shr.u32 a4, a0, 19; "
        "prmt.b32 a5, 0xC0800000, 0xC0804000, a2; prmt.b32 a6, 0xC0800000, 0xC0804000, a3; "
        "prmt.b32 a7, 0x3F3F3F00, 0x40404040, a2; prmt.b32 a8, 0x3F3F3F00, 0x40404040, a3; "
        "prmt.b32 a9, 0x8000, 0, a1; prmt.b32 a10, 0x8000, 0, a4; "
        "or.b32 a11, a7, a9; or.b32 a12, a8, a10; "
        "prmt.b32 $0, a5, a11, 0x5140; prmt.b32 $1, a5, a11, 0x7362; "
        "prmt.b32 $2, a6, a12, 0x5140; prmt.b32 $3, a6, a12, 0x7362; }"
    ),
}
E2M1_ASM_CONSTRAINTS = "=r,=r,=r,=r,r"
# Gluon reads asm strings only from constexpr globals.
_ASM_CVT_F16 = gl.constexpr(E2M1_ASM[("cvt", "f16")]) if HAS_GLUON else None
_ASM_CVT_BF16 = gl.constexpr(E2M1_ASM[("cvt", "bf16")]) if HAS_GLUON else None
_ASM_PORTABLE_F16 = gl.constexpr(E2M1_ASM[("portable", "f16")]) if HAS_GLUON else None
_ASM_PORTABLE_BF16 = gl.constexpr(E2M1_ASM[("portable", "bf16")]) if HAS_GLUON else None
_ASM_CONSTRAINTS = gl.constexpr(E2M1_ASM_CONSTRAINTS) if HAS_GLUON else None

# ---------------------------------------------------------------------------------------------------------------
# Tiles and the config
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


# Every tile gemv_config can return (the tests compile and run each one).
FMA_TILES = (FmaTile(1, 1, 4), FmaTile(2, 1, 4), FmaTile(1, 2, 4), FmaTile(2, 2, 4))
MMA_TILES = tuple(MmaTile(bt, w) for bt in (8, 16, 32) for w in (4, 8))
GEMV_MAX_T = 32


def all_gemv_tiles() -> list[tuple[str, FmaTile | MmaTile]]:
    return [("fma", t) for t in FMA_TILES] + [("mma", t) for t in MMA_TILES]


def gemv_config(t: int, n: int, k: int, sm_count: int) -> tuple[str, FmaTile | MmaTile] | None:
    """``("fma" | "mma", tile)`` for a small-batch W4A16 linear, or ``None`` when T is too large for a gemv.

    First guesses from the bandwidth arithmetic, to be tuned on sm_120 (nothing here was measured on one):
    - T <= 2: CUDA cores.  One row per warp keeps 4 warps x 16 B per lane in flight per step; with fewer rows than
      ~16 per SM (small N) the same work in 2-row warps halves the number of CTAs that each reload x.
    - T <= 32: tensor cores, the smallest mma N that covers T (8/16/32; each token block is a separate CTA row
      of the grid, so T = 33+ goes to the GEMM).  8 warps (8 x 1 KB of codes per step) when 16-row CTAs would give
      fewer than 4 CTAs per SM, else 4.
    """
    if t > GEMV_MAX_T or n <= 0 or k <= 0:
        return None
    if t <= 2:
        rows_per_warp = 2 if n >= 64 * sm_count else 1
        return "fma", FmaTile(block_t=max(t, 1), rows_per_warp=rows_per_warp, num_warps=4)
    block_t = 8 if t <= 8 else 16 if t <= 16 else 32
    warps = 8 if triton.cdiv(n, MMA_BLOCK_M) < 4 * sm_count else 4
    return "mma", MmaTile(block_t=block_t, num_warps=warps)


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

    @gluon.jit
    def _e2m1_pairs(codes, DECODE: gl.constexpr, F16: gl.constexpr):
        """uint8 codes -> int32 of the same shape and layout: two 16-bit floats per byte, low half = low nibble."""
        if DECODE == 0:
            if F16:
                pairs = gl.inline_asm_elementwise(_ASM_CVT_F16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
            else:
                pairs = gl.inline_asm_elementwise(_ASM_CVT_BF16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
        else:
            if F16:
                pairs = gl.inline_asm_elementwise(_ASM_PORTABLE_F16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
            else:
                pairs = gl.inline_asm_elementwise(_ASM_PORTABLE_BF16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
        return pairs

    @gluon.jit
    def _split_pairs(pairs, dtype: gl.constexpr):
        """int32 pairs -> (low-nibble values, high-nibble values) as ``dtype`` (fp16 or bf16)."""
        lo = pairs.to(gl.int16).to(dtype, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(dtype, bitcast=True)
        return lo, hi

    @gluon.jit
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
            lo, hi = _split_pairs(_e2m1_pairs(codes, DECODE, True), gl.float16)
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

    @gluon.jit
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
            lo, hi = _split_pairs(_e2m1_pairs(codes, DECODE, F16), DT)
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
def decode_for(cc_major: int, dtype: torch.dtype, ptx_isa: int) -> int:
    """The native cvt where the GPU has it (sm_100+, incl. sm_120) *and* the PTX ISA Triton will emit accepts it
    (bf16 needs 9.2, fp16 8.7), else the portable table.  The ISA follows the ptxas Triton uses, which an
    import can change: FlashInfer points ``TRITON_PTXAS_BLACKWELL_PATH`` at a system CUDA >= 13 ptxas, and CUDA
    13.0's emits PTX 9.0, which rejects the bf16 cvt."""
    needed = 92 if dtype == torch.bfloat16 else 87
    return DECODE_CVT if cc_major >= 10 and ptx_isa >= needed else DECODE_PORTABLE


def default_decode(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    major = torch.cuda.get_device_capability(device)[0]
    return decode_for(major, dtype, ptx_isa_version(major * 10) if major >= 10 else 0)


def _check_gemv_args(fn, x, w_codes, w_scales, w_dec_rows, bias, out):
    """The linear launchers' checks; the Gluon kernels also want the bias in x's dtype."""
    from ..format.checks import check_tensor

    t, n, k, w_scales, out = check_linear_inputs(fn, x, w_codes, w_scales, w_dec_rows, bias, out)
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype)
    return t, n, k, w_scales, out


def gemv_fma(x, w_codes, w_scales, w_dec_rows, *, bias=None, tile: FmaTile | None = None,
             decode: int | None = None, out=None):
    """``(x @ W^T) * w_dec_rows (+ bias)`` on CUDA cores; meant for T <= 2 (any T works, in blocks of tile.block_t)."""
    require_gluon("gemv_fma")
    t, n, k, w_scales, out = _check_gemv_args("gemv_fma", x, w_codes, w_scales, w_dec_rows, bias, out)
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    tile = tile or FmaTile(block_t=min(t, 2), rows_per_warp=1, num_warps=4)
    decode = default_decode(x.device, x.dtype) if decode is None else decode
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(t, tile.block_t))
    _gemv_fma_kernel[grid](
        x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias if bias is not None else out, out,
        t, n, x.stride(0), w_codes.stride(0), w_scales.stride(0), out.stride(0),
        K=k, HAS_BIAS=bias is not None, DECODE=decode, BLOCK_T=tile.block_t,
        ROWS_PER_WARP=tile.rows_per_warp, WARPS=tile.num_warps, num_warps=tile.num_warps,
    )
    return out


def gemv_mma(x, w_codes, w_scales, w_dec_rows, *, bias=None, tile: MmaTile | None = None,
             decode: int | None = None, out=None):
    """``(x @ W^T) * w_dec_rows (+ bias)`` on tensor cores (bf16/fp16 mma.sync); meant for T <= 32."""
    require_gluon("gemv_mma")
    t, n, k, w_scales, out = _check_gemv_args("gemv_mma", x, w_codes, w_scales, w_dec_rows, bias, out)
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    tile = tile or MmaTile(block_t=8 if t <= 8 else 16 if t <= 16 else 32, num_warps=4)
    decode = default_decode(x.device, x.dtype) if decode is None else decode
    grid = (triton.cdiv(n, tile.block_m), triton.cdiv(t, tile.block_t))
    _gemv_mma_kernel[grid](
        x, w_codes, w_scales.view(torch.uint8), w_dec_rows, bias if bias is not None else out, out,
        t, n, x.stride(0), w_codes.stride(0), w_scales.stride(0), out.stride(0),
        K=k, HAS_BIAS=bias is not None, DECODE=decode, BLOCK_T=tile.block_t, WARPS=tile.num_warps,
        num_warps=tile.num_warps,
    )
    return out


def gemv(x, w_codes, w_scales, w_dec_rows, *, bias=None, sm_count: int | None = None, decode: int | None = None,
         out=None):
    """Pick the kernel and tile with :func:`gemv_config` and run it (T must be <= GEMV_MAX_T)."""
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    cfg = gemv_config(x.shape[0], w_codes.shape[0], x.shape[1], sm_count)
    if cfg is None:
        raise ValueError(f"x: T = {x.shape[0]} tokens is more than a gemv handles (<= {GEMV_MAX_T}); use the GEMM")
    kind, tile = cfg
    fn = gemv_fma if kind == "fma" else gemv_mma
    return fn(x, w_codes, w_scales, w_dec_rows, bias=bias, tile=tile, decode=decode, out=out)
