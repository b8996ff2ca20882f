"""Which kernel and tile serve an NVFP4 linear: ``(compute capability, route, T, N, K) → LinearPlan``.

A *route* is what the user names (``--linear-backend nvfp4_sm120_<route>``); it fixes the prefill GEMM.  Small
batches go to a W4A16 kernel on the same weight whatever the route: at decode sizes the GEMM is bound by reading
the weight, and a W4A16 kernel reads the same bytes without quantizing the activation first.

The table is data: one list of rows per (architecture family, route), first row whose ``max_t`` admits T wins.
Tiles were compile-checked for sm_120 (no spills, smem ≤ 99 KB) in ``tests/dispatch/test_linear_dispatch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton

from ..kernels import gluon_gemv
from ..kernels.gluon_compat import gluon_enabled
from ..kernels.w4a16_linear import (
    GEMV_BLOCK_T,
    GEMV_MAX_T,
    W4A16_GEMM_CONFIGS,
    W4A16_GEMM_CONFIGS_SM90,
    W4A16_GEMV_CONFIGS,
)

ROUTES = ("triton", "cublas", "b12x", "w4a16", "flashinfer_w4a16")
W4A4_ROUTES = ("triton", "cublas", "b12x")


@dataclass(frozen=True)
class LinearPlan:
    kernel: str  # a key of dispatch.ops.LINEAR_KERNELS
    params: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict[str, object]:
        return dict(self.params)

    @property
    def is_w4a4(self) -> bool:
        return self.kernel.startswith("w4a4")


@dataclass(frozen=True)
class Row:
    max_t: int | None  # None: any T
    plan: LinearPlan
    why: str = field(default="", compare=False)


def _p(kernel: str, **params) -> LinearPlan:
    return LinearPlan(kernel, tuple(sorted(params.items())))


# W4A4 tiles of kernels/w4a4_gemm.py.  128x128x128 needs 8 warps (4 warps spill 16 B on sm_120);
# 64x128 keeps more CTAs in flight for mid-sized T.
_W4A4_BIG = _p("w4a4_triton", block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
_W4A4_MID = _p("w4a4_triton", block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
# W4A16 rows name the kernel; the tile is chosen by w4a16_plan from the shape and the SM count.
_W4A16_SMALL = _p("w4a16_gemv")
_W4A16_BIG = _p("w4a16_gemm")
# Prefill on a W4A16 route: dequantize row chunks to a 16-bit scratch + cuBLAS; chunk_n from dequant_mm_chunk_n.
_W4A16_DEQUANT_MM = _p("w4a16_dequant_mm")

# Smallest T that the w4a16 route sends to dequant + cuBLAS, per architecture family.  Below it the Triton GEMM
# decodes the weight once per 128-row tile of x, which is cheap for few tiles; above it that repeated decode
# limits the GEMM, while decoding once into a scratch costs a fixed ~2.5 bytes per weight.  H200 (docs/
# benchmarks.md): at T = 128 the Triton GEMM is faster on 5 of 8 Qwen3-32B / Llama-3.3-70B linears, at T = 192
# dequant + cuBLAS on all 8 (1.0-2.2x), at 2048 / 8192 it reaches 0.80-0.86x / 0.90-1.00x cuBLAS bf16.  sm_120:
# unmeasured; kept higher because there the in-register decode costs relatively less (mma.sync peak ~1/5 of the
# H200's wgmma) and the scratch's DRAM traffic relatively more (1.8 TB/s).
DEQUANT_MM_MIN_T_SM120 = 256
DEQUANT_MM_MIN_T_PORTABLE = 160


def _w4a16_rows(dequant_mm_min_t: int) -> list[Row]:
    return [
        Row(16, _W4A16_SMALL, "decode sizes"),
        Row(dequant_mm_min_t - 1, _W4A16_BIG, "mid-size batches: few row tiles, decoding per tile is cheap"),
        Row(None, _W4A16_DEQUANT_MM, "prefill: decode the weight once per call, cuBLAS does the GEMM"),
    ]

_SM120: dict[str, list[Row]] = {
    "triton": [
        Row(16, _W4A16_SMALL, "decode sizes: weight-read bound, skip the activation quant"),
        Row(64, _W4A4_MID, "few row tiles: narrower M keeps all SMs busy"),
        Row(None, _W4A4_BIG, "prefill: largest tile that fits without spills"),
    ],
    "cublas": [
        Row(16, _W4A16_SMALL, "cuBLAS FP4 pays the activation quant at decode sizes"),
        Row(None, _p("w4a4_cublas"), "prefill: cuBLAS block-scaled FP4 GEMM"),
    ],
    "b12x": [
        Row(8, _W4A16_SMALL, "b12x is tuned down to small M; below 8 the W4A16 read wins"),
        Row(None, _p("w4a4_b12x"), "prefill: FlashInfer b12x"),
    ],
    "w4a16": _w4a16_rows(DEQUANT_MM_MIN_T_SM120),  # no activation scales (W4A16 checkpoint)
    "flashinfer_w4a16": [Row(None, _p("fi_w4a16"), "FlashInfer mm_bf16_fp4 on its repacked weight (named only)")],
}

# Hopper and older: only the portable kernels.  The W4A4 Triton kernel runs there with the FP4 MMA decomposed by
# Triton (>= 3.8) into an exact decode + wgmma: correct, not fast; it exists for the proofs and benchmarks.
_PORTABLE: dict[str, list[Row]] = {
    "triton": _SM120["triton"],
    "w4a16": _w4a16_rows(DEQUANT_MM_MIN_T_PORTABLE),
}

TABLE: dict[int, dict[str, list[Row]]] = {12: _SM120, 10: _PORTABLE, 9: _PORTABLE, 8: _PORTABLE}


def _rows(cc: int, route: str) -> list[Row]:
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {ROUTES}, got {route!r}")
    family = TABLE.get(cc // 10)
    if family is None or route not in family:
        raise ValueError(f"route {route!r} has no kernels for compute capability {cc}")
    return family[route]


# Where the Gluon gemv serves the small-T rows (unless VLLM_NVFP4_SM120_DISABLE_GLUON=1).  sm_120: the issue's
# target, with the native cvt e2m1 decode.  sm_90: measured on the H200 (docs/benchmarks.md, 2026-11-29)
# faster than the Triton split-K kernel in 27 of 28 (shape, T <= 32) rows, 1.04-2.75x, with the portable decode.
GLUON_GEMV_ARCHS = (12, 9)


def select_linear(cc: int, route: str, t: int, n: int, k: int, sm_count: int = 170) -> LinearPlan:
    """The plan for one call; ``cc`` is e.g. 120 for sm_120 (an RTX 5090 has 170 SMs)."""
    for row in _rows(cc, route):
        if row.max_t is None or t <= row.max_t:
            if row.plan == _W4A16_SMALL and cc // 10 in GLUON_GEMV_ARCHS and gluon_enabled():
                return gluon_gemv_plan(t, n, k, sm_count, cc // 10)
            if row.plan in (_W4A16_SMALL, _W4A16_BIG):
                return w4a16_plan(t, n, k, sm_count, cc // 10, small=row.plan == _W4A16_SMALL)
            if row.plan == _W4A16_DEQUANT_MM:
                return _p("w4a16_dequant_mm", chunk_n=dequant_mm_chunk_n(t, n, k, sm_count))
            return row.plan
    raise AssertionError("every route's last row admits any T")


def gluon_gemv_plan(t: int, n: int, k: int, sm_count: int, cc_major: int = 12) -> LinearPlan:
    """The Gluon gemv kernel and tile (``kernels.gluon_gemv.gemv_config``, issue 7's tile rule)."""
    if cc_major == 9 and t == 2:
        # Measured on the H200 (docs/benchmarks.md): the CUDA-core tile at T = 2 took 1.1-2.3x the tensor-core
        # tile's time at T = 4 on all four Qwen3-32B shapes, and the block_t = 8 tile costs the same for T = 2..8.
        t = 3
    kind, tile = gluon_gemv.gemv_config(max(t, 1), n, k, sm_count)
    return _p(f"gluon_gemv_{kind}", **vars(tile))


def gemv_split_k(n: int, k: int, block_n: int, block_k: int, sm_count: int, t: int = 1) -> int:
    """Number of K splits so that the decode kernel has about two programs per SM.

    Depends only on shapes, so the grid and the workspace are fixed for a CUDA graph.
    """
    programs = triton.cdiv(n, block_n) * triton.cdiv(max(t, 1), GEMV_BLOCK_T)
    if programs >= 2 * sm_count:
        return 1
    # Keep at least 4 K tiles per split so the load pipeline has a steady state.
    max_split = max(1, k // (4 * block_k))
    split = min(triton.cdiv(2 * sm_count, programs), max_split)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return triton.cdiv(k, k_split)  # no empty splits


def w4a16_plan(t: int, n: int, k: int, sm_count: int, cc_major: int, *, small: bool) -> LinearPlan:
    """Tile of the W4A16 kernels for ``x [t, k] @ W [n, k]^T``."""
    if small and t <= GEMV_MAX_T:
        # Decode: streaming the weight is everything; aim for >= 2 programs per SM.  Each program re-reads its
        # x tile (T x K) from L2, so prefer the widest row tile that still gives 2 programs per SM.
        if triton.cdiv(n, 128) >= 2 * sm_count:
            cfg = dict(W4A16_GEMV_CONFIGS[2])  # e.g. N = 51200, 57344: no split needed
        elif triton.cdiv(n, 64) * 2 >= sm_count:
            cfg = dict(W4A16_GEMV_CONFIGS[1])  # medium N: 64-row tiles, split-K makes up the rest
        else:
            cfg = dict(W4A16_GEMV_CONFIGS[0])  # small N: 32-row tiles so split-K stays short
        cfg["split_k"] = gemv_split_k(n, k, cfg["block_n"], cfg["block_k"], sm_count, t)
        return _p("w4a16_gemv", **cfg)
    if triton.cdiv(t, 128) * triton.cdiv(n, 128) < sm_count:
        # Mid-size batches: 128x128 tiles would leave SMs idle; 64x64 tiles fill the machine.
        return _p("w4a16_gemm", **W4A16_GEMM_CONFIGS[0])
    if cc_major == 9:
        # Hopper: wgmma with the decoded weight in registers (see W4A16_GEMM_CONFIGS_SM90).
        return _p("w4a16_gemm", **W4A16_GEMM_CONFIGS_SM90[0])
    # sm_120 (and others): mma.sync 128x128x128, the tile with every load pipelined and no spills.
    return _p("w4a16_gemm", **W4A16_GEMM_CONFIGS[1])


# cuBLAS's large bf16 tiles are about 128 x 128 outputs; the dequant + cuBLAS chunks are sized in those units.
CUBLAS_TILE = 128
# Full waves of cuBLAS tiles each chunk's GEMM should have (see dequant_mm_chunk_n).  Measured on the H200
# (docs/benchmarks.md, sweep_dequant_mm): 4 waves beat 2 at T = 8192 on all eight Qwen3-32B / Llama-3.3-70B
# linears (0.95-1.05x vs 0.86-0.97x cuBLAS on the dequantized weight) and tie at T = 2048.
DEQUANT_MM_MIN_WAVES = 4
# Upper bound on the scratch: a transient allocation per call that vLLM's memory profiling counts against the KV
# cache.  It binds at small T on wide K (e.g. K = 8192 above 8192 rows), where the waves rule asks for big chunks.
DEQUANT_MM_MAX_SCRATCH_BYTES = 128 << 20


def dequant_mm_chunk_n(t: int, n: int, k: int, sm_count: int) -> int:
    """Weight rows per chunk of ``w4a16_dequant_mm`` for ``x [t, k] @ W [n, k]^T``.

    Each chunk is one cuBLAS GEMM ``[t, chunk] = x @ scratch^T``.  It must fill the GPU on its own: with fewer than
    ~4 waves of 128 x 128 output tiles (``t/128 * chunk/128 >= 4 * sm_count``) the last partial wave and the GEMM's
    ramp-up/down are a large share of each chunk, and there is one such tail per chunk.  Beyond that, smaller is
    better: the scratch (``chunk * k`` 16-bit values) is written by the dequant kernel and read right after by the
    GEMM, and a scratch that fits in L2 (50 MB on the H200, 96-128 MB on sm_120 parts) is read from there rather
    than DRAM.  Multiples of 128 keep every chunk but the last on whole cuBLAS tiles; never more than N (rounded
    up to 128) nor a scratch above ``DEQUANT_MM_MAX_SCRATCH_BYTES``.  K does not enter the rule: it scales the scratch and each chunk's GEMM alike.  Depends only on
    shapes, so the scratch size is fixed for a CUDA graph.
    """
    tiles_m = triton.cdiv(max(t, 1), CUBLAS_TILE)
    tiles_n = triton.cdiv(DEQUANT_MM_MIN_WAVES * sm_count, tiles_m)
    cap = max(1, DEQUANT_MM_MAX_SCRATCH_BYTES // (2 * max(k, 1) * CUBLAS_TILE))
    return min(tiles_n, cap, triton.cdiv(max(n, 1), CUBLAS_TILE)) * CUBLAS_TILE


def small_t_threshold(cc: int, route: str) -> int:
    """Largest T that goes to the W4A16 decode (gemv) kernels on this route (0 if none)."""
    return max((r.max_t for r in _rows(cc, route) if r.plan == _W4A16_SMALL and r.max_t is not None), default=0)


def dequant_mm_min_t(cc: int, route: str) -> int | None:
    """Smallest T that goes to dequant + cuBLAS on this route (None if it never does)."""
    rows = _rows(cc, route)
    for prev, row in zip([None, *rows], rows):
        if row.plan == _W4A16_DEQUANT_MM:
            return 0 if prev is None else prev.max_t + 1
    return None


def all_linear_plans() -> list[LinearPlan]:
    """Every plan the table can return, for tests: W4A16 tiles without their shape-dependent ``split_k``, and
    ``w4a16_dequant_mm`` without its shape-dependent ``chunk_n`` (its dequant kernel has one tile)."""
    seen: dict[LinearPlan, None] = {}
    for family in TABLE.values():
        for rows in family.values():
            for row in rows:
                if row.plan not in (_W4A16_SMALL, _W4A16_BIG):
                    seen.setdefault(row.plan)
    for cfg in W4A16_GEMV_CONFIGS:
        seen.setdefault(_p("w4a16_gemv", **cfg))
    for kind, tile in gluon_gemv.all_gemv_tiles():
        seen.setdefault(_p(f"gluon_gemv_{kind}", **vars(tile)))
    for cfg in W4A16_GEMM_CONFIGS + W4A16_GEMM_CONFIGS_SM90:
        seen.setdefault(_p("w4a16_gemm", **cfg))
    return list(seen)
