"""Which kernel and tile serve an NVFP4 linear: ``(GPU, route, T, N, K) → LinearPlan``.

A *route* is what the user names (``--linear-backend nvfp4_sm120_<route>``); it fixes the prefill GEMM.  Small
batches go to a W4A16 kernel on the same weight whatever the route: at decode sizes the GEMM is bound by reading
the weight, and a W4A16 kernel reads the same bytes without quantizing the activation first.

One name per choice.  A route (:class:`Route`) is the only name a user or the glue passes; everything else about
it derives from :data:`ROUTE_PREFILL`:

    route              --linear-backend (backend_name)  prefill plan kind   activations (LinearKernel.w4a4)
    triton             nvfp4_sm120_triton               w4a4_triton         quantized (W4A4 checkpoints)
    cublas             nvfp4_sm120_cublas               w4a4_cublas         quantized
    b12x               nvfp4_sm120_b12x                 w4a4_b12x           quantized
    w4a16              nvfp4_sm120_w4a16                w4a16_dequant_mm    16-bit (any NVFP4 checkpoint)
    flashinfer_w4a16   nvfp4_sm120_flashinfer_w4a16     fi_w4a16            16-bit

``nvfp4_sm120`` (:data:`AUTO_BACKEND`) names our best route for the GPU (``dispatch.vendor.auto_routes``) and,
as ``--moe-backend``, our MoE experts, whose plans name their kernels by ``dispatch.moe.MoeKernel`` and
``dispatch.moe.Impl``.  A plan's kind (:class:`LinearKernel`) names the launcher that runs it
(``dispatch/registry.py``).

The table is data: one list of rows per (architecture family, route), first row whose ``max_t`` admits T wins;
a row carries its tile, or its kernel's tile rule (:data:`_TILE_RULES`) picks one from the shape and the GPU.
Every tile a kernel can run with is listed here (the kernels' launchers take their tile as an argument) and
compile-checked for sm_120 (no spills, smem ≤ 99 KB): the W4A4 tiles in ``tests/dispatch/test_linear_dispatch.py``,
the others in the kernels' tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import triton

from ..kernels.gluon_compat import gluon_enabled
from ..kernels.gluon_gemv import MMA_BLOCK_M, FmaTile, MmaTile
from ..kernels.gluon_gemv_stream import K_BLOCK, STREAM_TILES, StreamTile
from ..kernels.w4a16_linear import GEMV_BLOCK_T
from .configs import measured_linear_plan
from .gemv_stream_plan import STREAM_MAX_T, stream_plan, wave_ctas
from .hw import Capability, Family
from .policy import current_policy


class Route(StrEnum):
    """A linear route: ``--linear-backend nvfp4_sm120_<route>``."""

    TRITON = "triton"
    CUBLAS = "cublas"
    B12X = "b12x"
    W4A16 = "w4a16"
    FLASHINFER_W4A16 = "flashinfer_w4a16"


class LinearKernel(StrEnum):
    """A linear plan's kind; ``dispatch.registry.LINEAR_KERNELS`` has its launcher."""

    W4A4_TRITON = "w4a4_triton"  # our activation quant + kernels/w4a4_gemm.py (tl.dot_scaled)
    W4A4_CUBLAS = "w4a4_cublas"  # our activation quant + torch._scaled_mm (kernels/fp4_routes.py)
    W4A4_B12X = "w4a4_b12x"  # FlashInfer mm_fp4(backend="b12x") (kernels/fp4_routes.py)
    W4A16_GEMV = "w4a16_gemv"  # kernels/w4a16_linear.py, split-K decode kernel
    W4A16_GEMM = "w4a16_gemm"  # kernels/w4a16_linear.py, prefill GEMM
    W4A16_DEQUANT_MM = "w4a16_dequant_mm"  # kernels/w4a16_dequant.py: dequantize row chunks + cuBLAS
    GLUON_GEMV_FMA = "gluon_gemv_fma"  # kernels/gluon_gemv.py, CUDA cores
    GLUON_GEMV_MMA = "gluon_gemv_mma"  # kernels/gluon_gemv.py, tensor cores
    GLUON_GEMV_STREAM = "gluon_gemv_stream"  # kernels/gluon_gemv_stream.py, tensor cores, stream-K grid
    FI_W4A16 = "fi_w4a16"  # FlashInfer mm_bf16_fp4 on its prepared weight (kernels/fp4_routes.py)

    @property
    def w4a4(self) -> bool:
        """The kernel quantizes the activations (it needs the layer's static input scale)."""
        return self in (LinearKernel.W4A4_TRITON, LinearKernel.W4A4_CUBLAS, LinearKernel.W4A4_B12X)


AUTO_BACKEND = "nvfp4_sm120"
# The prefill GEMM of each route: the one fact the route's other names and properties derive from.
ROUTE_PREFILL: dict[Route, LinearKernel] = {
    Route.TRITON: LinearKernel.W4A4_TRITON,
    Route.CUBLAS: LinearKernel.W4A4_CUBLAS,
    Route.B12X: LinearKernel.W4A4_B12X,
    Route.W4A16: LinearKernel.W4A16_DEQUANT_MM,
    Route.FLASHINFER_W4A16: LinearKernel.FI_W4A16,
}
ROUTES: tuple[Route, ...] = tuple(Route)
W4A4_ROUTES: tuple[Route, ...] = tuple(r for r in Route if ROUTE_PREFILL[r].w4a4)


def backend_name(route: Route | str) -> str:
    """The ``--linear-backend`` name of ``route``."""
    return f"{AUTO_BACKEND}_{route}"


@dataclass(frozen=True)
class LinearPlan:
    kernel: LinearKernel
    params: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict[str, object]:
        return dict(self.params)

    @property
    def is_w4a4(self) -> bool:
        return LinearKernel(self.kernel).w4a4


@dataclass(frozen=True)
class Row:
    max_t: int | None  # None: any T
    plan: LinearPlan  # without params: the tile comes from the kernel's tile rule
    why: str = field(default="", compare=False)


def _p(kernel: LinearKernel, **params) -> LinearPlan:
    return LinearPlan(kernel, tuple(sorted(params.items())))


# W4A4 tiles of kernels/w4a4_gemm.py.  128x128x128 needs 8 warps (4 warps spill 16 B on sm_120);
# 64x128 keeps more CTAs in flight for mid-sized T.
_W4A4_BIG = _p(LinearKernel.W4A4_TRITON, block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)
_W4A4_MID = _p(LinearKernel.W4A4_TRITON, block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)
# W4A16 rows name the kernel; its tile rule picks the tile (and, at decode sizes, the Gluon gemv where it serves).
_W4A16_SMALL = _p(LinearKernel.W4A16_GEMV)
_W4A16_BIG = _p(LinearKernel.W4A16_GEMM)
# Prefill on a W4A16 route: dequantize row chunks to a 16-bit scratch + cuBLAS; chunk_n from dequant_mm_chunk_n.
_W4A16_DEQUANT_MM = _p(LinearKernel.W4A16_DEQUANT_MM)

# Smallest T that the w4a16 route sends to dequant + cuBLAS, per architecture family.  Below it the Triton GEMM
# decodes the weight once per 128-row tile of x, which is cheap for few tiles; above it that repeated decode
# limits the GEMM, while decoding once into a scratch costs a fixed ~2.5 bytes per weight.  H200 (docs/
# benchmarks.md): at T = 128 the Triton GEMM is faster on 5 of 8 Qwen3-32B / Llama-3.3-70B linears, at T = 192
# dequant + cuBLAS on all 8 (1.0-2.2x), at 2048 / 8192 it reaches 0.80-0.86x / 0.90-1.00x cuBLAS bf16.  sm_120:
# unmeasured; kept higher because there the in-register decode costs relatively less (mma.sync peak ~1/5 of the
# H200's wgmma) and the scratch's DRAM traffic relatively more (1.8 TB/s).
DEQUANT_MM_MIN_T_SM120 = 256
DEQUANT_MM_MIN_T_PORTABLE = 160


# ---- tiles of the W4A16 kernels (kernels/w4a16_linear.py, kernels/gluon_gemv.py) ---------------------------------

# Every (tile, warps, stages) the Triton W4A16 kernels run with; w4a16_plan picks from these and the compile tests
# check each for sm_120 (no local memory, shared memory within 99 KB).  Registers (sm_120 / sm_90, Triton 3.8,
# bf16) are noted because several tiles sit near the 255 limit: a larger tile spills.
W4A16_GEMV_CONFIGS = (
    dict(block_n=32, block_k=256, num_warps=4, num_stages=4),  # 159 / 158 regs: small N, many programs
    dict(block_n=64, block_k=256, num_warps=4, num_stages=4),  # 158 / 230 regs (sm_90: wgmma, A in registers)
    dict(block_n=128, block_k=256, num_warps=8, num_stages=3),  # 157 / 211 regs: large N, fewest x re-reads
)
W4A16_GEMM_CONFIGS = (
    # Mid-size batches (few 128-row tiles): small tiles fill the machine.  196 / 133 regs.
    dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3, swap_ab=False),
    # sm_120 prefill: mma.sync, every load pipelined (cp.async), 85 KB smem.  192 / 170 regs.
    dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3, swap_ab=False),
)
# Hopper only (the H200 the proofs run on): the decoded weight is wgmma's register A operand, so it skips the
# shared-memory round trip and the MMAs overlap the next tile's decode (warp_group_dot_wait pendings=1).
# 214 regs on sm_90; on sm_120 the same tile spills (255 regs + 368 B stack), hence a separate list.
W4A16_GEMM_CONFIGS_SM90 = (
    dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4, swap_ab=True),
)
# The batch size up to which the Triton decode kernel serves a W4A16 plan (the GEMM above it).
W4A16_GEMV_MAX_T = 16


def w4a16_configs(family: Family = Family.SM120) -> list[tuple[str, dict]]:
    """Every (kernel, config) pair valid on ``family``: ``("gemv", {...})`` / ``("gemm", {...})``.

    sm_120 (the default) gets the tiles that compile there without spills within 99 KB of shared memory; sm_90
    adds the Hopper-only GEMM tile.
    """
    gemm = W4A16_GEMM_CONFIGS + (W4A16_GEMM_CONFIGS_SM90 if family is Family.SM90 else ())
    return [("gemv", dict(c)) for c in W4A16_GEMV_CONFIGS] + [("gemm", dict(c)) for c in gemm]


# Every tile gluon_gemv_tile can return (the tests compile and run each one).
FMA_TILES = (FmaTile(1, 1, 4), FmaTile(2, 1, 4), FmaTile(1, 2, 4), FmaTile(2, 2, 4))
MMA_TILES = tuple(MmaTile(bt, w) for bt in (8, 16, 32) for w in (4, 8))
# The largest T a Gluon gemv tile covers (the mma tile's N); from T = 33 on the GEMM serves.
GLUON_GEMV_MAX_T = 32


def all_gemv_tiles() -> list[tuple[str, FmaTile | MmaTile]]:
    return [("fma", t) for t in FMA_TILES] + [("mma", t) for t in MMA_TILES]


def gluon_gemv_tile(t: int, n: int, k: int, sm_count: int) -> tuple[str, FmaTile | MmaTile] | None:
    """``("fma" | "mma", tile)`` of the Gluon gemv for a small-batch W4A16 linear, or ``None`` when T is too large.

    First guesses from the bandwidth arithmetic, to be tuned on sm_120 (nothing here was measured on one):
    - T <= 2: CUDA cores.  One row per warp keeps 4 warps x 16 B per lane in flight per step; with fewer rows than
      ~16 per SM (small N) the same work in 2-row warps halves the number of CTAs that each reload x.
    - T <= 32: tensor cores, the smallest mma N that covers T (8/16/32; each token block is a separate CTA row
      of the grid, so T = 33+ goes to the GEMM).  8 warps (8 x 1 KB of codes per step) when 16-row CTAs would give
      fewer than 4 CTAs per SM, else 4.
    """
    if t > GLUON_GEMV_MAX_T or n <= 0 or k <= 0:
        return None
    if t <= 2:
        rows_per_warp = 2 if n >= 64 * sm_count else 1
        return "fma", FmaTile(block_t=max(t, 1), rows_per_warp=rows_per_warp, num_warps=4)
    block_t = 8 if t <= 8 else 16 if t <= 16 else 32
    warps = 8 if triton.cdiv(n, MMA_BLOCK_M) < 4 * sm_count else 4
    return "mma", MmaTile(block_t=block_t, num_warps=warps)


# ---- tile of the activation quantizer (kernels/act_quant.py), for the W4A4 routes and the W4A4 MoE input ---------

def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def act_quant_config(t: int, k: int, swizzled: bool = False) -> dict:
    """The activation quantizer's tile for ``[t, k]``: ``block_t``, ``block_k``, ``num_warps``.

    Large T: 8 x 1024 elements (16 KB of bf16) per program, 4 warps → 64 elements (eight 16-byte loads) in flight
    per thread.  Compiled for sm_90, the larger tiles of ``bench sweep_act_quant`` (16 x 1024, 8 x 2048, 2 warps)
    save under 0.2 of the 14.5 instructions per element at about twice the registers (96 → 184): kept, until
    that sweep is measured.  Small T: 256-wide K-chunks, so T = 1 with K = 5120 still gives 20 programs.  With
    the swizzled layout the grid also covers the padding rows up to 128 (they only write zero scales), hence
    block_t 8 there.
    """
    big = t >= 64
    block_k = max(16, min(_next_pow2(k), 1024 if big else 256))
    block_t = 8 if (big or swizzled) else 1
    num_warps = max(1, min(4, block_t * block_k // 256))  # 8 elements (16 bytes) per thread and row-chunk
    return {"block_t": block_t, "block_k": block_k, "num_warps": num_warps}


def _w4a16_rows(dequant_mm_min_t: int) -> list[Row]:
    return [
        Row(W4A16_GEMV_MAX_T, _W4A16_SMALL, "decode sizes"),
        Row(dequant_mm_min_t - 1, _W4A16_BIG, "mid-size batches: few row tiles, decoding per tile is cheap"),
        Row(None, _W4A16_DEQUANT_MM, "prefill: decode the weight once per call, cuBLAS does the GEMM"),
    ]


_SM120: dict[Route, list[Row]] = {
    Route.TRITON: [
        Row(16, _W4A16_SMALL, "decode sizes: weight-read bound, skip the activation quant"),
        Row(64, _W4A4_MID, "few row tiles: narrower M keeps all SMs busy"),
        Row(None, _W4A4_BIG, "prefill: largest tile that fits without spills"),
    ],
    Route.CUBLAS: [
        Row(16, _W4A16_SMALL, "cuBLAS FP4 pays the activation quant at decode sizes"),
        Row(None, _p(LinearKernel.W4A4_CUBLAS), "prefill: cuBLAS block-scaled FP4 GEMM"),
    ],
    Route.B12X: [
        Row(8, _W4A16_SMALL, "b12x is tuned down to small M; below 8 the W4A16 read wins"),
        Row(None, _p(LinearKernel.W4A4_B12X), "prefill: FlashInfer b12x"),
    ],
    Route.W4A16: _w4a16_rows(DEQUANT_MM_MIN_T_SM120),  # no activation scales (W4A16 checkpoint)
    Route.FLASHINFER_W4A16: [
        Row(None, _p(LinearKernel.FI_W4A16), "FlashInfer mm_bf16_fp4 on its repacked weight (named only)"),
    ],
}

# Hopper and older: only the portable kernels.  The W4A4 Triton kernel runs there with the FP4 MMA decomposed by
# Triton (>= 3.8) into an exact decode + wgmma: correct, not fast; it exists for the proofs and benchmarks.
_PORTABLE: dict[Route, list[Row]] = {
    Route.TRITON: _SM120[Route.TRITON],
    Route.W4A16: _w4a16_rows(DEQUANT_MM_MIN_T_PORTABLE),
}

TABLE: dict[Family, dict[Route, list[Row]]] = {
    Family.SM120: _SM120, Family.SM100: _PORTABLE, Family.SM90: _PORTABLE, Family.SM80: _PORTABLE,
}


def _rows(cap: Capability, route: Route | str) -> list[Row]:
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {[str(r) for r in ROUTES]}, got {route!r}")
    family = TABLE.get(cap.family)
    if family is None or route not in family:
        raise ValueError(f"route {str(route)!r} has no kernels for compute capability {cap.cc}")
    return family[route]


# Where the Gluon gemv serves the small-T rows (unless VLLM_NVFP4_SM120_DISABLE_GLUON=1).  sm_120: the target,
# with the native cvt e2m1 decode.  sm_90: measured on the H200 (docs/benchmarks.md, 2026-11-29) faster than the
# Triton split-K kernel in 27 of 28 (shape, T <= 32) rows, 1.04-2.75x, with the portable decode.
GLUON_GEMV_FAMILIES = (Family.SM120, Family.SM90)

# Within those, the streaming kernel (kernels/gluon_gemv_stream.py) serves T <= STREAM_MAX_T except where the
# per-row Gluon gemv was measured faster: on the H200 (device run 47, docs/benchmarks.md) the streaming kernel was
# faster or equal on the eight Qwen3-32B / Llama-3.3-70B linears at T = 2-8 (up to 1.8x, Llama down), and at T = 1
# and 9-16 on every layer of >= 37 MB of codes + scales (1.0-1.8x), but slower on the two smaller ones (Qwen3-32B qkv,
# 29.5 MB, and o, 23.6 MB) at T = 1 (19.9 / 18.9 us against the CUDA-core gemv's 15.7) and T = 16 (25.3 / 23.7
# against the tensor-core gemv's 22.0 / 22.6).  Its time is ~10-12 us plus the bytes at ~3.2 TB/s (the one-wave
# grid's prologue, few steps per CTA and the cross-CTA sum), so small layers keep the per-row gemv there (still so
# with the register-capped tiles of run 49: 17.7 / 16.2 us at T = 1, 22.8 against 21.9 on qkv at T = 16).  sm_120:
# no row measured; the streaming kernel everywhere, because the fixed part is about as long there while an RTX 5090
# reads even the 23.6 MB layer for ~13 us at 1.8 TB/s (the H200 crossover is ~7.5 us of reading).
STREAM_SMALL_LAYER_BYTES: dict[Family, int] = {Family.SM90: 32 << 20}


def uses_stream(cap: Capability, t: int, n: int, k: int) -> bool:
    """Whether a T <= STREAM_MAX_T call on a Gluon GPU runs the streaming kernel (the rule above)."""
    small = n * k * 9 // 16 < STREAM_SMALL_LAYER_BYTES.get(cap.family, 0)  # codes + scales: 0.5625 B per weight
    return t <= STREAM_MAX_T and not (small and (t <= 1 or t > 8))


def gluon_gemv_plan(cap: Capability, t: int, n: int, k: int) -> LinearPlan:
    """The Gluon gemv kernel and tile (:func:`gluon_gemv_tile`)."""
    if cap.family is Family.SM90 and t == 2:
        # Measured on the H200 (docs/benchmarks.md): the CUDA-core tile at T = 2 took 1.1-2.3x the tensor-core
        # tile's time at T = 4 on all four Qwen3-32B shapes, and the block_t = 8 tile costs the same for T = 2..8.
        t = 3
    kind, tile = gluon_gemv_tile(max(t, 1), n, k, cap.sm_count)
    return _p(LinearKernel(f"gluon_gemv_{kind}"), **vars(tile))


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


def w4a16_plan(cap: Capability, t: int, n: int, k: int, *, small: bool) -> LinearPlan:
    """Tile of the Triton W4A16 kernels for ``x [t, k] @ W [n, k]^T``."""
    sm_count = cap.sm_count
    if small and t <= W4A16_GEMV_MAX_T:
        # Decode: streaming the weight is everything; aim for >= 2 programs per SM.  Each program re-reads its
        # x tile (T x K) from L2, so prefer the widest row tile that still gives 2 programs per SM.
        if triton.cdiv(n, 128) >= 2 * sm_count:
            cfg = dict(W4A16_GEMV_CONFIGS[2])  # e.g. N = 51200, 57344: no split needed
        elif triton.cdiv(n, 64) * 2 >= sm_count:
            cfg = dict(W4A16_GEMV_CONFIGS[1])  # medium N: 64-row tiles, split-K makes up the rest
        else:
            cfg = dict(W4A16_GEMV_CONFIGS[0])  # small N: 32-row tiles so split-K stays short
        cfg["split_k"] = gemv_split_k(n, k, cfg["block_n"], cfg["block_k"], sm_count, t)
        return _p(LinearKernel.W4A16_GEMV, **cfg)
    if triton.cdiv(t, 128) * triton.cdiv(n, 128) < sm_count:
        # Mid-size batches: 128x128 tiles would leave SMs idle; 64x64 tiles fill the machine.
        return _p(LinearKernel.W4A16_GEMM, **W4A16_GEMM_CONFIGS[0])
    if cap.family is Family.SM90:
        # Hopper: wgmma with the decoded weight in registers (see W4A16_GEMM_CONFIGS_SM90).
        return _p(LinearKernel.W4A16_GEMM, **W4A16_GEMM_CONFIGS_SM90[0])
    # sm_120 (and others): mma.sync 128x128x128, the tile with every load pipelined and no spills.
    return _p(LinearKernel.W4A16_GEMM, **W4A16_GEMM_CONFIGS[1])


def gemv_stream_linear_plan(cap: Capability, t: int, n: int, k: int) -> LinearPlan:
    """The streaming decode kernel with :func:`.gemv_stream_plan.stream_plan`'s tile and one-wave grid."""
    plan = stream_plan(t, n, k, cap.sm_count, cap.major)
    return _p(LinearKernel.GLUON_GEMV_STREAM, **plan.tile.params(), ctas=plan.ctas)


def stream_wave_ctas(cap: Capability, tile: dict, t: int) -> int:
    """The streaming kernel's derived ``ctas`` for ``tile`` (its fields as a dict): one full wave at T."""
    return wave_ctas(StreamTile(**{key: v for key, v in tile.items() if key in _STREAM_TILE_FIELDS}),
                     t, cap.sm_count, cap.major)


_STREAM_TILE_FIELDS = frozenset(StreamTile.__dataclass_fields__)


def _w4a16_decode(cap: Capability, t: int, n: int, k: int) -> LinearPlan:
    if cap.family in GLUON_GEMV_FAMILIES and gluon_enabled():
        if uses_stream(cap, t, n, k):
            return gemv_stream_linear_plan(cap, t, n, k)
        return gluon_gemv_plan(cap, t, n, k)
    return w4a16_plan(cap, t, n, k, small=True)


# How a row without a tile gets one, per kernel: from the shape and the GPU (SM count, family).
_TILE_RULES: dict[LinearKernel, Callable[[Capability, int, int, int], LinearPlan]] = {
    LinearKernel.W4A16_GEMV: _w4a16_decode,
    LinearKernel.W4A16_GEMM: lambda cap, t, n, k: w4a16_plan(cap, t, n, k, small=False),
    LinearKernel.W4A16_DEQUANT_MM: lambda cap, t, n, k: _p(LinearKernel.W4A16_DEQUANT_MM,
                                                           chunk_n=dequant_mm_chunk_n(t, n, k, cap.sm_count)),
}


def select_linear(cap: Capability, route: Route | str, t: int, n: int, k: int) -> LinearPlan:
    """The plan for one call of ``x [t, k] @ W [n, k]^T`` on ``cap``'s GPU: a measured config's row where one covers
    this GPU, shape and T (``dispatch/configs.py``), else the built-in table's (:func:`table_linear`).

    The process's numerics policy (``dispatch/policy.py``) narrows that: ``decode = w4a4`` keeps a W4A4 route on
    its W4A4 rows at every T, batch-invariant mode runs :func:`batch_invariant_linear` at every T."""
    rows = _rows(cap, route)
    policy = current_policy()
    if policy.batch_invariant:
        return batch_invariant_linear(cap, route)
    if policy.one_numerics and ROUTE_PREFILL[Route(route)].w4a4:
        rows = [r for r in rows if r.plan.is_w4a4]
        measured = measured_linear_plan(cap, route, t, n, k)
        return measured if measured is not None and measured.is_w4a4 else _table_plan(rows, cap, t, n, k)
    return k_tail_stream(measured_linear_plan(cap, route, t, n, k) or _table_plan(rows, cap, t, n, k), cap, t, k)


def k_tail_stream(plan: LinearPlan, cap: Capability, t: int, k: int) -> LinearPlan:
    """``plan``, except a register-capped streaming tile where K is not a multiple of 128: the uncapped 32-row tile
    of its token width.

    The kernel's K-tail variant (the last block's loads masked) needs more registers than the even-K one, and under
    the listed caps some tiles then keep 8-24 bytes per thread on the stack on sm_90 or sm_120 (the 32 x 8 tile
    capped at 128 on sm_90, the 96-register tiles on sm_120).  The uncapped 32-row tiles compile without a stack
    there (168 registers, 3 CTAs per SM; compile tests), at one CTA per SM fewer than the capped tile.  Unmeasured:
    no layer of the benchmarked models has such a K."""
    if plan.kernel is not LinearKernel.GLUON_GEMV_STREAM or k % K_BLOCK == 0:
        return plan
    params = dict(plan.params)
    if params.get("max_regs") is None:
        return plan
    tile = StreamTile(32, params["block_t"])
    return _p(LinearKernel.GLUON_GEMV_STREAM, **tile.params(), ctas=wave_ctas(tile, t, cap.sm_count, cap.major))


# Batch-invariant mode: one plan per (route, family) at every T, each without split-K and without a library that
# picks its algorithm by M, so every output element is the same K-ordered fp32 sum whatever T is.
#   W4A4 routes: the Triton W4A4 GEMM's prefill tile, also for the cuBLAS and b12x routes (cuBLAS and FlashInfer
#     choose their kernels by M; our GEMM runs on their layers' row-major codes and linear scales, which they keep);
#   w4a16: the Triton W4A16 GEMM's prefill tile (the decode kernels split K by shape, dequant + cuBLAS is cuBLAS);
#   flashinfer_w4a16: mm_bf16_fp4, its only plan (whether FlashInfer's choice depends on M is not known).
_BATCH_INVARIANT_W4A16 = {Family.SM90: _p(LinearKernel.W4A16_GEMM, **W4A16_GEMM_CONFIGS_SM90[0])}
_BATCH_INVARIANT_W4A16_OTHER = _p(LinearKernel.W4A16_GEMM, **W4A16_GEMM_CONFIGS[1])


def batch_invariant_linear(cap: Capability, route: Route | str) -> LinearPlan:
    """The one plan a route runs at every T in batch-invariant mode (see above)."""
    rows = _rows(cap, route)
    route = Route(route)
    if ROUTE_PREFILL[route].w4a4:
        return _W4A4_BIG
    if route is Route.W4A16:
        return _BATCH_INVARIANT_W4A16.get(cap.family, _BATCH_INVARIANT_W4A16_OTHER)
    return rows[-1].plan


def table_linear(cap: Capability, route: Route | str, t: int, n: int, k: int) -> LinearPlan:
    """The built-in table's plan (the documented default; what ``tune`` measures against)."""
    return _table_plan(_rows(cap, route), cap, t, n, k)


def _table_plan(rows: list[Row], cap: Capability, t: int, n: int, k: int) -> LinearPlan:
    for row in rows:
        if row.max_t is None or t <= row.max_t:
            rule = None if row.plan.params else _TILE_RULES.get(row.plan.kernel)
            return row.plan if rule is None else rule(cap, t, n, k)
    raise AssertionError("every route's last row admits any T")


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
    up to 128) nor a scratch above ``DEQUANT_MM_MAX_SCRATCH_BYTES``.  K does not enter the rule: it scales the
    scratch and each chunk's GEMM alike.  Depends only on shapes, so the scratch size is fixed for a CUDA graph.
    """
    tiles_m = triton.cdiv(max(t, 1), CUBLAS_TILE)
    tiles_n = triton.cdiv(DEQUANT_MM_MIN_WAVES * sm_count, tiles_m)
    cap = max(1, DEQUANT_MM_MAX_SCRATCH_BYTES // (2 * max(k, 1) * CUBLAS_TILE))
    return min(tiles_n, cap, triton.cdiv(max(n, 1), CUBLAS_TILE)) * CUBLAS_TILE


def small_t_threshold(cap: Capability, route: Route | str) -> int:
    """Largest T that goes to the W4A16 decode (gemv) kernels on this route (0 if none)."""
    return max((r.max_t for r in _rows(cap, route) if r.plan == _W4A16_SMALL and r.max_t is not None), default=0)


def dequant_mm_min_t(cap: Capability, route: Route | str) -> int | None:
    """Smallest T that goes to dequant + cuBLAS on this route (None if it never does)."""
    rows = _rows(cap, route)
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
        seen.setdefault(_p(LinearKernel.W4A16_GEMV, **cfg))
    for kind, tile in all_gemv_tiles():
        seen.setdefault(_p(LinearKernel(f"gluon_gemv_{kind}"), **vars(tile)))
    for tile in STREAM_TILES:
        seen.setdefault(_p(LinearKernel.GLUON_GEMV_STREAM, **tile.params()))
    for cfg in W4A16_GEMM_CONFIGS + W4A16_GEMM_CONFIGS_SM90:
        seen.setdefault(_p(LinearKernel.W4A16_GEMM, **cfg))
    return list(seen)
