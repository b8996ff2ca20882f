"""Which MoE kernels, tiles and switches run: ``(GPU, tokens per expert, shapes) → MoePlan``.

Everything the kernels leave open is decided here; ``dispatch/moe_flow.py`` only executes a plan, with the
launchers ``dispatch.registry.MOE_KERNELS`` names for its ``(kernel, impl)``.

* **Kernel** (:class:`MoeKernel`): W4A4 (FP4 x FP4, activations quantized with the checkpoint's static input
  scales) from ``W4A4_MIN_TOKENS_PER_EXPERT`` tokens per expert when the layer has those scales; below that, and
  for W4A16 checkpoints, W4A16 (bf16/fp16 activations, weights decoded in registers): at a few rows per expert
  the layer is bound by reading the weights, and W4A16 reads the same bytes without quantizing anything.
* **Tokens per expert** ``m = T * top_k / global_E`` is the *average*, known from shapes alone (no host sync
  under CUDA graphs).  Skewed routing still runs correctly, only on a tile chosen for the average.
* **Tiers** by ``m``: BLOCK_M 16 (decode-sized, weights streamed), 32, 64, 128.  Both GEMMs of a layer share
  BLOCK_M (one alignment); BLOCK_N, BLOCK_K, warps and stages are per GEMM.
* **Switches**: ``fast_decode`` (inline-PTX e2m1 decode, any CUDA GPU), ``use_tma`` (TMA weight loads on sm_90
  and sm_120 when that GEMM's K % 256 == 0, in the kernels that have a TMA path: the Triton W4A16 GEMMs and both
  Gluon ones), ``decode`` (W4A4 without the native FP4 MMA: GPUs before sm_90 and the interpreter; sm_90 runs
  ``dot_scaled`` through Triton's exact emulation), ``stream_weights``.
* **Implementation** (:class:`Impl`): on sm_120 the BLOCK_M 64 / 128 tiers run the warp-specialized Gluon GEMMs
  (``kernels/gluon_moe_w4a16.py``, ``kernels/gluon_moe_w4a4.py``; BLOCK_M 64 persistent, and there the W4A4 down
  GEMM below I = 1024 with separate epilogue warps) unless ``VLLM_NVFP4_SM120_DISABLE_GLUON=1``; everything else
  is Triton.
* **Decode** (:data:`Impl.DECODE`, ``kernels/moe_decode.py``): small calls (T up to :data:`DECODE_MAX_TOKENS` and
  fewer than ``W4A4_MIN_TOKENS_PER_EXPERT`` routes per expert, on sm_90 and sm_120) skip the align pass: the
  routing tensors go straight into an align-free gate_up kernel and a down kernel with the top-k sum fused.  Weight
  only (W4A16 numerics) for W4A16 and W4A4 checkpoints alike, as the tiers below 4 routes per expert.  Tiles per
  T in :data:`_DECODE_ROWS`, by shape in the rules beside it (the token-major and pointer-load downs, the wide
  gate_up from H = 7168); BLOCK_M is 0 (no row blocks).

Tiles are compile-checked for sm_120 (no local memory, shared memory <= 99 KB) by ``tests/kernels/test_moe_compile.py``
over :func:`all_moe_plans` (the decode tiles by ``tests/kernels/test_moe_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ..kernels.gluon_compat import gluon_enabled
from ..kernels.gluon_gemv_stream import K_BLOCK
from ..kernels.gluon_moe_decode import MoeStreamTile
from ..kernels.moe_decode import MAX_ROUTES, DecodeTile, tma_ok
from ..kernels.moe_decode_fused import check_fused_tiles
from .configs import measured_moe_plan
from .hw import Capability, Family
from .policy import current_policy, substitute


class MoeKernel(StrEnum):
    """What the experts compute with: 16-bit activations, or activations quantized with the static input scales."""

    W4A16 = "w4a16"
    W4A4 = "w4a4"


class Impl(StrEnum):
    """Which implementation of the kernel runs."""

    TRITON = "triton"  # kernels/moe_w4a16.py, kernels/moe_w4a4.py
    GLUON = "gluon"  # kernels/gluon_moe_w4a16.py, kernels/gluon_moe_w4a4.py (warp-specialized)
    DECODE = "decode"  # kernels/moe_decode.py (align-free, weight-only; MoeKernel.W4A16 only)


class DecodeDown(StrEnum):
    """Which down kernel a decode plan runs (``kernels/moe_decode.py``)."""

    EXPERT = "expert"  # expert-major: each w2 block read once; fp32 atomics, or per-route rows when deterministic
    TOKEN = "token"  # token-major: slot-order fp32 sum, bit-identical run to run in either mode
    # gate_up and down work items in one launch (kernels/moe_decode_fused.py): the expert-major down's products,
    # summed in slot order (the deterministic expert-major bits, in either mode)
    FUSED = "fused"


W4A4_MIN_TOKENS_PER_EXPERT = 4
# A TMA box of packed codes is K/2 bytes wide; the dispatch uses it when K % 256 == 0 (whole 128-wide K tiles,
# 16-byte aligned rows), the case of every real checkpoint shape.
TMA_K_MULTIPLE = 256


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    use_tma: bool = False  # the kernels with a TMA path (not the Triton W4A4 GEMMs)
    persistent: bool = False  # Gluon only
    epilogue_warps: int = 0  # Gluon W4A4 down GEMM only (persistent)

    def kwargs(self, kernel: MoeKernel, impl: Impl) -> dict:
        kw = dict(block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps,
                  num_stages=self.num_stages, group_m=self.group_m)
        if kernel is MoeKernel.W4A16 or impl is Impl.GLUON:
            kw["use_tma"] = self.use_tma
        if impl is Impl.GLUON:
            kw["persistent"] = self.persistent
            if self.epilogue_warps:
                kw["epilogue_warps"] = self.epilogue_warps
        return kw


@dataclass(frozen=True)
class MoePlan:
    kernel: MoeKernel
    block_m: int  # 0 for decode plans (no alignment)
    gate_up: GemmTile | DecodeTile  # DecodeTile for Impl.DECODE
    down: GemmTile | DecodeTile
    fast_decode: bool = False  # W4A16: inline-PTX e2m1 decode
    decode: bool = False  # W4A4: exact self-decode + fp16 MMA instead of dot_scaled
    stream_weights: bool = False  # W4A16: weights evict-first
    impl: Impl = Impl.TRITON
    tier: str = ""
    # Whether each GEMM's weight codes (gate_up, down) can be read by TMA on this GPU and shape; the kernels with a
    # TMA path take it in their tile's use_tma (the Triton W4A4 GEMMs have none).
    tma: tuple[bool, bool] = (False, False)
    decode_down: DecodeDown | None = None  # Impl.DECODE: which down kernel
    # Impl.DECODE, expert-major: the streaming Gluon down that runs instead of ``down`` (fp32 atomics, so not in
    # deterministic mode, where ``down`` runs)
    stream_down: MoeStreamTile | None = None

    def gate_up_kwargs(self) -> dict:
        if self.impl == Impl.DECODE:
            return dict(tile=self.gate_up)
        return self._kwargs(self.gate_up)

    def down_kwargs(self) -> dict:
        if self.impl == Impl.DECODE:
            return dict(tile=self.down, by_expert=self.decode_down == DecodeDown.EXPERT)
        return self._kwargs(self.down)

    def _kwargs(self, tile: GemmTile) -> dict:
        kw = tile.kwargs(MoeKernel(self.kernel), Impl(self.impl))
        if self.kernel == MoeKernel.W4A16:
            kw.update(fast_decode=self.fast_decode, stream_weights=self.stream_weights)
        elif self.impl == Impl.GLUON:
            # None: the block-scaled MMA on sm_120, its exact emulation elsewhere (the H200 benchmarks).
            kw.update(decode=None)
        else:
            kw.update(decode=self.decode)
        return kw


# (max tokens per expert, block_m, gate_up tile, down tile).  gate_up tiles hold BLOCK_N gate *and* BLOCK_N up
# columns (two accumulators), so their BLOCK_N is half the down GEMM's for the same registers.
_W4A16_TIERS = {
    # sm_120: 99 KB of shared memory per block.
    Family.SM120: (
        (16, 16, GemmTile(64, 256, 4, 3), GemmTile(64, 256, 4, 3)),
        (48, 32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (96, 64, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 4, 3)),  # BLOCK_K 128 spills with two accumulators
        (None, 128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3)),
    ),
    # sm_90 / sm_100: 227 KB of shared memory, deeper pipelines.
    Family.SM90: (
        (16, 16, GemmTile(64, 256, 4, 4), GemmTile(64, 256, 4, 4)),
        (48, 32, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
        (96, 64, GemmTile(64, 128, 4, 4), GemmTile(128, 64, 4, 4)),
        (None, 128, GemmTile(64, 64, 8, 4), GemmTile(128, 64, 8, 4)),
    ),
    # Before sm_90 (and the interpreter): pointer loads only.
    Family.OTHER: (
        (16, 16, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (48, 32, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3)),
        (None, 64, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3)),
    ),
}
_W4A4_TIERS = {
    Family.SM120: (
        (16, 16, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (48, 32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (96, 64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        (None, 128, GemmTile(64, 128, 8, 2), GemmTile(128, 128, 8, 2)),
    ),
    Family.SM90: (
        (16, 16, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (48, 32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (96, 64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        (None, 128, GemmTile(64, 128, 8, 3), GemmTile(128, 128, 8, 3)),
    ),
    Family.OTHER: (
        (48, 16, GemmTile(64, 64, 4, 2), GemmTile(64, 64, 4, 2)),
        (None, 64, GemmTile(64, 64, 4, 2), GemmTile(64, 64, 4, 2)),
    ),
}


# sm_120 tiers served by the warp-specialized Gluon GEMMs: block_m → (gate_up tile, down tile).  BLOCK_M 64 runs
# persistently (the ring runs on across tiles; W4A16 with a third stage).  Every tile here is compile-checked for
# sm_120 in tests/kernels/test_gluon_moe*.py, which assert that these are the compiled ones.
_GLUON_SM120 = {
    # W4A16: BLOCK_K 64 (its only compiled value); 1 TMA loader + 4 decode + 4 / 8 MMA warps.
    MoeKernel.W4A16: {
        64: (GemmTile(64, 64, 4, 3, persistent=True), GemmTile(128, 64, 4, 3, persistent=True)),
        128: (GemmTile(64, 64, 8, 2), GemmTile(128, 64, 8, 2)),
    },
    # W4A4: BLOCK_K 128 (two 64-wide block-scaled MMA steps per slot); 1 loader + 4 / 8 MMA warps.
    MoeKernel.W4A4: {
        64: (GemmTile(64, 128, 4, 3, persistent=True), GemmTile(64, 128, 4, 3, persistent=True)),
        128: (GemmTile(64, 128, 8, 3), GemmTile(64, 128, 8, 3)),
    },
}
# Below this I the W4A4 down GEMM's K loop is a few 128-wide steps, so its epilogue (routing weight, fp32 atomics
# of a whole tile) is a large share of each tile: the persistent (BLOCK_M 64) down GEMM then gets a separate
# epilogue partition that drains one tile while the mma warps compute the next.  Not at BLOCK_M 128: 8 mma + 1 + 4
# warps make 16 with at most 128 registers each on average, and the mma warps spill (compiled for sm_120).
GLUON_DOWN_EPILOGUE_MAX_I = 1024
GLUON_EPILOGUE_WARPS = 4


# ---- decode: the align-free kernels (kernels/moe_decode.py) -------------------------------------------------------
# The sweep candidates of benchmarks/moe_decode_sweep.py that won on the H200 (docs/benchmarks.md, "MoE decode
# path"; device runs 17 and 22-25: every candidate exact against moe_ref; CUDA graphs, weights beyond L2, medians).
# Runs 22-24 found the narrow K step best (a third to a quarter of the shared memory of the run-17 tiles, so more
# programs share an SM; more stages, split K and one-warp programs were slower at every point); run 25 the shift
# decode with 32 weight rows per warp from T = 4 (its activation permutation is shared by more rows); device run 31
# four warps over K in each T = 1 program (k_warps: 4x the decode warps of the 384 programs at 8 routes).  None
# prefetches the down rows (``prefetch_down``): 1.01-1.26x slower on every shape at T = 1-16 (H100, device run 57).
DECODE_GATE_UP_TILES = {
    "gu-n16k256-kw4-st3-shift": DecodeTile(16, 256, 16, num_warps=4, num_stages=3, use_dot=True, k_warps=4,
                                           shift_decode=True),
    "gu-n16k128-w2-st3": DecodeTile(16, 128, 16, num_warps=2, num_stages=3, use_dot=True),
    "gu-n32k128-w2-st3-shift": DecodeTile(32, 128, 16, num_warps=2, num_stages=3, use_dot=True, shift_decode=True),
    "gu-n32k128-w1-st3-shift": DecodeTile(32, 128, 16, num_warps=1, num_stages=3, use_dot=True, shift_decode=True),
}
DECODE_DOWN_TILES = {
    "exp-n32k256-w2-tma-st2": DecodeTile(32, 256, 16, num_warps=2, num_stages=2, use_dot=True, use_tma=True),
    "exp-n64k256-w2-tma-st2-shift": DecodeTile(64, 256, 16, num_warps=2, num_stages=2, use_dot=True, use_tma=True,
                                               shift_decode=True),
    "tok-n32k128-w1-st3-shift": DecodeTile(32, 128, 16, num_warps=1, num_stages=3, use_dot=True, shift_decode=True),
    "exp-n64k256-w2-st2-shift": DecodeTile(64, 256, 16, num_warps=2, num_stages=2, use_dot=True, shift_decode=True),
}
# The largest T the table gives the decode plan.  With the run-17 tiles it was slower than the tiers at T = 64 on
# two shapes (Qwen3-30B-A3B 0.86x, Qwen3-Next-80B 0.96x, device run 20); with the tiles below the layer through the
# op is 1.27-1.40x faster than the tiers at T = 64 on the four shapes (bench moe_decode, device run 26), so the
# plan serves up to T = 64 where fewer than 4 routes per expert allow it (DeepSeek-V3, Qwen3-Next-80B there).
DECODE_MAX_TOKENS = 64
# Above this T the decode plan serves only below DECODE_LATE_MAX_ROUTES_PER_EXPERT routes per expert.  With the
# run-17 tiles, T = 32 at 2 routes per expert was 0.98x the tiers (Qwen3-30B-A3B); with the tiles below the sum of
# the two kernels at T = 32 is 1.14-1.26x faster than the layer on the run-24 tiles, itself faster than the tiers
# there (run 24), so the limit is the plan's own (fewer than 4 routes per expert).
DECODE_WIDE_MAX_TOKENS = 16
DECODE_LATE_MAX_ROUTES_PER_EXPERT = W4A4_MIN_TOKENS_PER_EXPERT
# The token-major down kernel from this T on where I <= DECODE_TOKEN_DOWN_MAX_I (measured: Qwen3-Next-80B, I = 512:
# the token-major tile best at T = 8-32 by 1.2-1.8x in runs 23-25; at T = 4 the expert-major one; beside the
# streaming gate_up at T = 6 1.04x the TMA expert-major down in the layer in H200 runs 69 and 71 (67.0 against 69.6 /
# 69.7 us) and ahead of it in H100 run 68, at T = 7 level (74.1 against 75.1, run 71), at T = 5 behind (63.2 against
# 61.1)).  Likely why: its down GEMM is two K steps per route and with 512 experts few routes share one, so the
# expert-major dedupe saves little against its atomics and tile counting.
DECODE_TOKEN_DOWN_MIN_T = 6
DECODE_TOKEN_DOWN_MAX_I = 512
# ... and at these T up to this I (Qwen3-30B-A3B, I = 768): at T = 16 the layer with the table's gate_up is 1.06x
# faster with the token-major down than with the TMA expert-major one on an H100 (runs 87 / 88: 133.9 / 133.6 against
# 142.3 / 143.2 us, the best of nine pairs both times) and on the H200 (run 71: 6 %); at T = 12 it is behind on both
# (run 87: 128.0 against 124.0 us), and at T = 5-7 (run 71), so T = 16 only (T > 16 not measured).
DECODE_TOKEN_DOWN_MID_T = (16, 16)
DECODE_TOKEN_DOWN_MID_MAX_I = 768
DECODE_TOKEN_DOWN_TILE = "tok-n32k128-w1-st3-shift"
# The expert-major down by pointer loads where I > DECODE_TMA_DOWN_MAX_I, at every decode T.  H200 run 35: the kernel
# alone within 2 % of the rows' TMA tiles or faster at T = 1, 2, 4, 16 on Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3
# (e.g. 9.7 / 12.5 / 24.3 / 53.0 µs against 9.9 / 13.7 / 24.9 / 52.2 on Qwen3-30B-A3B), and its ready launch costs the
# host ~31 µs less per call (62 against 93 µs: the TMA tiles build and encode two descriptors per call).  At I = 512
# (two K steps per route) TMA was 6-38 % faster at T = 2-16 (Qwen3-Next-80B), so the rows' TMA tiles stay there.
DECODE_TMA_DOWN_MAX_I = 512
DECODE_POINTER_DOWN_TILE = "exp-n64k256-w2-st2-shift"
# ... except at these T up to this I (Qwen3-30B-A3B, I = 768), where the rows' TMA tile stays.  H200 run 71, the
# layer with the table's gate_up: 1.07 / 1.08 / 1.08 / 1.06 / 1.07 / 1.10x the pointer tile at T = 5 / 6 / 7 / 8 / 12
# / 16 (61.9 / 66.5 / 76.0 / 81.8 / 117.1 / 136.2 against 66.2 / 71.5 / 82.1 / 86.7 / 125.7 / 149.3 us); run 69 the
# same at T = 6 / 8 (1.08 / 1.06x; alone 1.20 / 1.15x), H100 run 68 the best down beside every gate_up at T = 6; at
# T = 4 the pointer tile won (53.9 against 55.5 us, run 69).  (The token-major down was ahead of both at T = 8 and 16
# by 2 and 6 %, behind at T = 5-7 and 12: T = 16 is its row since H100 run 87, above, so this window ends at 15.)
# Decode T run in CUDA graphs, so the TMA launch's descriptor encoding costs no host time there.  T > 16 not measured.
DECODE_TMA_DOWN_MID_T = (5, 15)
DECODE_TMA_DOWN_MID_MAX_I = 768
# The gate_up of the widest layers at small T: one warp over 64 stacked rows (gate and up of 32 columns), each
# activation fragment shared by 64 weight rows over a long K loop.  H200, DeepSeek-V3 (H = 7168; run 43: 65.6 / 110.4
# / 223.4 / 402.8 us against the rows' tiles' 72.5 / 130.0 / 242.0 / 415.7 at T = 1 / 2 / 4 / 8; the layer side by
# side 1.02-1.08x faster, run 45); at H = 4096 (Qwen3-235B-A22B) it won only T = 8 (176.5 against 186.9) and lost
# 7-12 % at T = 1-4, at H = 2048 1-70 %, so it serves from this H, up to the largest T measured.  Both families (the
# sm_90 measurement until an sm_120 run; the tile is compile-checked for sm_120).  Where Gluon runs, the streaming
# gate_up below takes these rows (1.10-1.15x this tile, H100 run 63).
DECODE_WIDE_GATE_UP_MIN_H = 7168
DECODE_WIDE_GATE_UP_MAX_T = 8
DECODE_WIDE_GATE_UP_TILE = "gu-n32k128-w1-st3-shift"

def _until_sm120(rows: tuple) -> tuple:
    """sm_90 rows ``(..., why)`` as the sm_120 family's until an sm_120 run measures them (every tile they name is
    compile-checked for sm_120)."""
    return tuple(row[:-1] + (row[-1] + "; the sm_90 measurement until an sm_120 run",) for row in rows)


# The streaming Gluon gate_up (kernels/gluon_moe_decode.py: the linear streaming kernel's decode step, 25.8 SASS
# instructions per code word on sm_90 against the Triton loop's 31.6, over a stream-K list of the touched experts' row
# tiles; T <= its block_t).  Side by side with the rows' Triton tiles on an H100 (device runs 63-68, CUDA graphs,
# weights beyond L2; docs/benchmarks.md "The streaming gate_up"), it wins where the gate_up streams long K rows, and
# at H = 2048 from T = 3:
DECODE_STREAM_GATE_UP_TILES = {
    "gus-m32t8": MoeStreamTile(32, 8, ctas_per_sm=3),
    # 64 rows over two row warps, so two warps over K: each warp streams twice the steps of a row tile's run, which
    # is what the short K rows of H = 2048 (16 blocks of 128) lack.
    "gus-m64t8-rw2": MoeStreamTile(64, 8, num_warps=4, row_warps=2, ctas_per_sm=3),
}
# (min H, min T, max T, tile, why): the first row with H >= min H and min T <= T <= max T serves the gate_up (the
# down and the rest of the plan as the rows below).  Gluon only (``VLLM_NVFP4_SM120_DISABLE_GLUON`` turns it off).
_H100_STREAM_ROWS = (
    (7168, 1, 8, "gus-m32t8",
     "H100 run 63: DeepSeek-V3 gate_up 65.5 / 114.2 / 219.2 / 390.7 us at T = 1 / 2 / 4 / 8 against the best Triton "
     "tile's 71.9 / 128.7 / 252.8 / 449.4 (1.10-1.15x); run 65: the layer through the op 1.12-1.18x the old rows' "
     "pair at T = 1, 2, 4, 6, 8"),
    (4096, 2, 8, "gus-m32t8",
     "H100 run 63: Qwen3-235B-A22B gate_up 56.3 / 98.2 / 166.9 us at T = 2 / 4 / 8 against 62.0 / 114.7 / 196.7 "
     "(1.10-1.18x); run 65: the layer 1.14-1.18x at T = 2, 4, 6, 8; T = 1 a tie (55.4 against 55.1 us), so the "
     "Triton row keeps it"),
    (2048, 3, 8, "gus-m64t8-rw2",
     "H100 runs 67 and 68: at H = 2048 the layer with this tile against the Triton rows' pair 1.17 / 1.07 / 1.10x at "
     "T = 4 / 6 / 8 on Qwen3-30B-A3B and 1.18 / 1.05x at T = 4 / 6 on Qwen3-Next-80B (run 68; run 65 had the 32 x 8 "
     "tile's pair 1.10-1.12x at T = 4), and the gate_up alone 1.02-1.08x the 32 x 8 tile at T = 4-8 (run 68; "
     "1.02-1.07x at T = 8, run 67); H100 run 83 at T = 3, with the streaming down: 44.3 us against the Triton row's "
     "pair's 59.9 on Qwen3-30B-A3B (1.35x), 43.8 against 42.3 on Qwen3-Next-80B (0.97x); run 84 at T = 5 / 7 "
     "faster than the Triton row's tile with every down on both layers (1.03-1.22x); T = 1-2 lose (1.08-1.17x, run "
     "65; run 83 at T = 2 1.00-1.06x); H < 2048 unmeasured"),
)
_DECODE_STREAM_ROWS = {
    Family.SM90: _H100_STREAM_ROWS,
    # Compile-checked for sm_120 (native cvt, no local memory, 159 / 161 registers: 3 CTAs per SM as on sm_90).
    Family.SM120: _until_sm120(_H100_STREAM_ROWS),
}


# The streaming Gluon down with the cast by the last CTA (kernels/gluon_moe_decode.py, ``late_cast``): each run adds
# its products straight into the token's fp32 sums and the grid's last CTA casts them; at <= 128 registers 4 CTAs
# per SM (no stack on sm_90 or sm_120 where I is a multiple of 128, compile tests).  64 rows over two row warps, so
# two warps over K, as the gate_up's tile at H = 2048.  It has no deterministic mode: there the row's Triton down
# runs.
DECODE_STREAM_DOWN_TILES = {
    "dns-m64t8-rw2-lc-c4": MoeStreamTile(64, 8, num_warps=4, row_warps=2, max_regs=128, ctas_per_sm=4,
                                         late_cast=True),
}
# (min H, min T, max T, tile, why): the first row with H >= min H and min T <= T <= max T runs the streaming down
# where the down is expert-major (the token-major rule at I <= 512 from T = 6 keeps its rows).  Gluon only.
_H100_STREAM_DOWN_ROWS = (
    (7168, 1, 8, "dns-m64t8-rw2-lc-c4",
     "H100 run 74: DeepSeek-V3, the layer with the streaming gate_up 100.8 / 311.5 / 591.0 us at T = 1 / 4 / 8 "
     "against the row's pointer-load down's 117.5 / 346.4 / 658.1 (1.17 / 1.11 / 1.11x; the TMA one's 110.8 / "
     "331.0 / 623.8)"),
    (4096, 2, 8, "dns-m64t8-rw2-lc-c4",
     "H100 runs 74 and 84: Qwen3-235B-A22B, the layer with the streaming gate_up against the row's pointer-load "
     "down 1.05 / 1.07x at T = 2 / 3 (run 84: 88.3 / 121.8 against 93.1 / 130.8 us), 1.10 / 1.12x at T = 4 / 8 "
     "(run 74: 147.2 / 241.6 against 161.2 / 271.0); T = 1 a tie (run 84: 55.1 against 54.9), so the row's down "
     "keeps it"),
    (2048, 3, 8, "dns-m64t8-rw2-lc-c4",
     "H100 runs 73-75: the layer against the rows' downs 1.07 / 1.02 / 1.11x at T = 4 / 6 / 8 on Qwen3-30B-A3B "
     "(run 75: 53.1 / 70.0 / 79.4 against 56.9 / 71.2 / 87.9 us; run 73 1.05 / 1.11x at T = 4 / 8), 1.08x at T = 4 "
     "on Qwen3-Next-80B (51.3 against 55.3; run 73 1.09x); runs 83-84 beside the streaming gate_up: 1.10 / 1.06 / "
     "1.06x at T = 3 / 5 / 7 on Qwen3-30B-A3B against the row's down (44.3 / 61.2 / 73.5 against 48.9 / 65.1 / 78.1 "
     "us; the TMA down 1.02x faster at T = 3), 1.02 / 1.08x at T = 3 / 5 on Qwen3-Next-80B (43.8 / 59.2 against "
     "44.5 / 63.8); T = 2 splits (Qwen3-30B-A3B 1.05x slower, Qwen3-Next-80B 1.07x faster, run 83) and T = 1 loses"),
)
_DECODE_STREAM_DOWN_ROWS = {
    Family.SM90: _H100_STREAM_DOWN_ROWS,
    # Compile-checked for sm_120 (native cvt, no local memory, 126 registers: 4 CTAs per SM as on sm_90).
    Family.SM120: _until_sm120(_H100_STREAM_DOWN_ROWS),
}


def _gluon_row(rows: dict, cap: Capability, num_tokens: int, hidden: int):
    """The first of ``rows[cap.family]`` ``(min H, min T, max T, tile, why)`` that covers the call; None without
    Gluon."""
    if not gluon_enabled():
        return None
    return next((r for r in rows.get(cap.family, ()) if hidden >= r[0] and r[1] <= num_tokens <= r[2]), None)


# (max T, gate_up tile, expert-major down tile, why); with ``deterministic`` the down tile's per-route rows are
# summed in slot order; the token-major and pointer-load rules above override the down tile.
_H200_ROWS = (
    (1, "gu-n16k256-kw4-st3-shift", "exp-n32k256-w2-tma-st2",
     "H200 run 31: gate_up 12.0 / 11.9 / 72.1 us against the row below's 13.9 / 14.0 / 74.3 on Qwen3-30B-A3B, "
     "Qwen3-Next-80B, DeepSeek-V3 (3 % slower on Qwen3-235B-A22B: 35.8 against 34.7); slower from T = 2 (the slices "
     "share fewer rows per activation load); the down tile as below (warps over K did not help it)"),
    (2, "gu-n16k128-w2-st3", "exp-n32k256-w2-tma-st2",
     "H200 runs 23-25: fastest or within 3 % at T = 1-2 on the four shapes (the shift decode's 32-row tiles lose "
     "at T = 1: too few programs)"),
    (DECODE_MAX_TOKENS, "gu-n32k128-w2-st3-shift", "exp-n64k256-w2-tma-st2-shift",
     "H200 run 25: fastest at T = 4, 16, 32 on the four shapes (gate_up 1.04-1.19x, down 1.1-1.3x the T <= 2 "
     "tiles); T = 3, 5-15 and 33-64 between measured points, and the layer through the op at T = 2-64 (run 26)"),
)
_DECODE_ROWS = {
    Family.SM90: _H200_ROWS,
    # No sm_120 measurement yet: the sm_90 one (every tile compile-checked for sm_120: no local memory, <= 99 KB).
    Family.SM120: _until_sm120(_H200_ROWS),
}
DECODE_FAMILIES = tuple(_DECODE_ROWS)

# The whole layer in one launch (kernels/moe_decode_fused.py, DecodeDown.FUSED): the gate_up and down tiles as the
# work items of one grid, so the down items read their weights while the gate_up items run, and one launch's ramp
# and tail instead of two.  Both tiles by pointer loads with one num_warps (and one register cap: the kernel's
# registers are the larger item's).  The pairs, named as in benchmarks/moe_decode_sweep.py's FUSED_PAIRS:
DECODE_FUSED_PAIRS = {
    "t1": (DECODE_GATE_UP_TILES["gu-n16k256-kw4-st3-shift"],
           DecodeTile(32, 256, 16, num_warps=4, num_stages=2, use_dot=True, k_warps=4, shift_decode=True)),
    "t2": (DECODE_GATE_UP_TILES["gu-n16k128-w2-st3"], DECODE_DOWN_TILES[DECODE_POINTER_DOWN_TILE]),
    "t4": (replace(DECODE_GATE_UP_TILES["gu-n32k128-w2-st3-shift"], max_regs=248),
           replace(DECODE_DOWN_TILES[DECODE_POINTER_DOWN_TILE], max_regs=248)),
    "wide": (DECODE_GATE_UP_TILES[DECODE_WIDE_GATE_UP_TILE],
             DecodeTile(32, 128, 16, num_warps=1, num_stages=3, use_dot=True, shift_decode=True)),
}
# (max T, max H, pair, why): the first row with T <= max T and H <= max H serves the call with that pair in one
# launch; the two-launch rows above serve the rest.  Empty on sm_90 by measurement: on an H100 (device run 55) the
# best fused pair was 1.01-1.52x slower than the best two-launch pair on each of the four model shapes at every
# T in 1-16 (docs/benchmarks.md, "The whole decode layer in one launch").
_H200_FUSED_ROWS: tuple[tuple[int, int, str, str], ...] = ()
_DECODE_FUSED_ROWS = {Family.SM90: _H200_FUSED_ROWS, Family.SM120: _H200_FUSED_ROWS}


def _fused_row(cap: Capability, num_tokens: int, hidden: int):
    return next((r for r in _DECODE_FUSED_ROWS.get(cap.family, ()) if num_tokens <= r[0] and hidden <= r[1]), None)


def decode_tier_plan(cap: Capability, num_tokens: int, *, hidden: int, intermediate: int) -> MoePlan | None:
    """The decode plan's tiles for ``num_tokens`` on ``cap`` (the last row's beyond :data:`DECODE_MAX_TOKENS`, for
    ``tune`` and the benchmarks), TMA where the bank's K allows it; None where the decode kernels have no rows
    (before sm_90, sm_100, the interpreter)."""
    rows = _DECODE_ROWS.get(cap.family)
    if rows is None:
        return None
    fused = _fused_row(cap, num_tokens, hidden)
    if fused is not None:
        return fused_decode_plan(cap, *DECODE_FUSED_PAIRS[fused[2]], hidden=hidden, intermediate=intermediate,
                                 tier=f"{cap.family}/decode/fused-{fused[2]}")
    i, (_, name, down_name, _) = next(((i, r) for i, r in enumerate(rows) if num_tokens <= r[0]),
                                      (len(rows) - 1, rows[-1]))
    token = (num_tokens >= DECODE_TOKEN_DOWN_MIN_T and intermediate <= DECODE_TOKEN_DOWN_MAX_I) or (
        DECODE_TOKEN_DOWN_MID_T[0] <= num_tokens <= DECODE_TOKEN_DOWN_MID_T[1]
        and intermediate <= DECODE_TOKEN_DOWN_MID_MAX_I)
    kind = DecodeDown.TOKEN if token else DecodeDown.EXPERT
    wide = hidden >= DECODE_WIDE_GATE_UP_MIN_H and num_tokens <= DECODE_WIDE_GATE_UP_MAX_T
    gate_up = DECODE_GATE_UP_TILES[DECODE_WIDE_GATE_UP_TILE if wide else name]
    if token:
        down_name = DECODE_TOKEN_DOWN_TILE
    elif intermediate > DECODE_TMA_DOWN_MAX_I and not (
            DECODE_TMA_DOWN_MID_T[0] <= num_tokens <= DECODE_TMA_DOWN_MID_T[1]
            and intermediate <= DECODE_TMA_DOWN_MID_MAX_I):
        down_name = DECODE_POINTER_DOWN_TILE
    down = DECODE_DOWN_TILES[down_name]
    tma = tma_ok(hidden), tma_ok(intermediate)
    stream = _gluon_row(_DECODE_STREAM_ROWS, cap, num_tokens, hidden)
    if stream is not None:
        gate_up, tma = DECODE_STREAM_GATE_UP_TILES[stream[3]], (False, tma[1])
    else:
        gate_up = replace(gate_up, use_tma=gate_up.use_tma and tma[0])
    down = replace(down, use_tma=down.use_tma and tma[1])
    variant = "/stream" if stream is not None else "/wide" if wide else ""
    # (I not a multiple of 128: the down's K-tail variant keeps 240 / 128 bytes per thread on the stack under its cap
    # on sm_90 / sm_120, so the row's Triton down serves.)
    stream_down = None if token or intermediate % K_BLOCK else _gluon_row(_DECODE_STREAM_DOWN_ROWS, cap, num_tokens,
                                                                          hidden)
    if stream_down is not None:
        variant += "/stream-down"
    return MoePlan(kernel=MoeKernel.W4A16, block_m=0, gate_up=gate_up, down=down, fast_decode=cap.cc is not None,
                   impl=Impl.DECODE, tier=f"{cap.family}/decode/{i}/{kind}{variant}", tma=tma, decode_down=kind,
                   stream_down=None if stream_down is None else DECODE_STREAM_DOWN_TILES[stream_down[3]])


def fused_decode_plan(cap: Capability, gate_up: DecodeTile, down: DecodeTile, *, hidden: int, intermediate: int,
                      tier: str = "") -> MoePlan:
    """The decode plan that runs ``gate_up`` and ``down`` as the work items of one launch
    (``kernels/moe_decode_fused.py``: pointer loads, one ``num_warps``); what the fused rows pick, and what the
    benchmarks and tests time side by side with the two-launch plan."""
    check_fused_tiles(gate_up, down)
    return MoePlan(kernel=MoeKernel.W4A16, block_m=0, gate_up=gate_up, down=down, fast_decode=cap.cc is not None,
                   impl=Impl.DECODE, tier=tier or f"{cap.family}/decode/fused", tma=(False, False),
                   decode_down=DecodeDown.FUSED)


def decode_plan(cap: Capability, *, num_tokens: int, top_k: int, global_experts: int, hidden: int,
                intermediate: int) -> MoePlan | None:
    """The table's decode plan for this call, or None (the tiers serve): T <= :data:`DECODE_MAX_TOKENS` (above
    :data:`DECODE_WIDE_MAX_TOKENS` only below :data:`DECODE_LATE_MAX_ROUTES_PER_EXPERT` routes per expert), fewer
    than ``W4A4_MIN_TOKENS_PER_EXPERT`` routes per expert (where the tiers run weight-only too, so a W4A4
    checkpoint's numerics do not change with the path), every route in one program's id vector (``MAX_ROUTES``),
    and ``H % 256 == 0`` as on every measured shape (every real checkpoint; other H are correct but
    unmeasured)."""
    if not 1 <= num_tokens <= DECODE_MAX_TOKENS or num_tokens * top_k > MAX_ROUTES:
        return None
    m = tokens_per_expert(num_tokens, top_k, global_experts)
    if m >= W4A4_MIN_TOKENS_PER_EXPERT or not tma_ok(hidden):
        return None
    if num_tokens > DECODE_WIDE_MAX_TOKENS and m >= DECODE_LATE_MAX_ROUTES_PER_EXPERT:
        return None
    return decode_tier_plan(cap, num_tokens, hidden=hidden, intermediate=intermediate)


def tier_family(cap: Capability) -> Family:
    """Which tier tables serve ``cap``: sm_12x its own (99 KB of shared memory), sm_90 and newer the sm_90 ones
    (TMA, 227 KB), older GPUs and the interpreter the pointer-load ones (:data:`Family.OTHER`)."""
    if cap.family is Family.SM120:
        return Family.SM120
    return Family.SM90 if cap.major is not None and cap.major >= 9 else Family.OTHER


def _tier(table, m: float):
    for i, (max_m, block_m, gate_up, down) in enumerate(table):
        if max_m is None or m <= max_m:
            return i, block_m, gate_up, down
    raise AssertionError("tier tables end with an open row")


def tokens_per_expert(num_tokens: int, top_k: int, global_experts: int) -> float:
    return num_tokens * top_k / max(global_experts, 1)


def select_moe_plan(
    cap: Capability,
    *,
    num_tokens: int,
    top_k: int,
    global_experts: int,
    hidden: int,
    intermediate: int,
    w4a4: bool,
) -> MoePlan:
    """The plan for one MoE layer call.  ``w4a4``: the layer has static activation scales (W4A4 checkpoint).

    A measured config's row where one covers this GPU, layer shape and T (``dispatch/configs.py``), else the
    built-in tiers' (:func:`table_moe_plan`)."""
    shape = dict(num_tokens=num_tokens, top_k=top_k, global_experts=global_experts, hidden=hidden,
                 intermediate=intermediate, w4a4=w4a4)
    policy = current_policy()
    if policy.batch_invariant:
        plan = batch_invariant_moe_plan(cap, hidden=hidden, intermediate=intermediate, w4a4=w4a4)
    else:
        one = policy.one_numerics and w4a4
        measured = measured_moe_plan(cap, **shape)
        if measured is not None and one and measured.kernel != MoeKernel.W4A4:
            measured = None
        plan = measured or table_moe_plan(cap, **shape, one_numerics=one)
    # The numerics guard's fallback where this plan failed on this GPU at this shape (dispatch/guard.py).
    return substitute(moe_guard_key(plan, hidden, intermediate), plan)


def moe_guard_key(plan: MoePlan, hidden: int, intermediate: int) -> tuple:
    """What the numerics guard checks once per process: a plan at a layer shape."""
    return ("moe", plan, hidden, intermediate)


def batch_invariant_moe_plan(cap: Capability, *, hidden: int, intermediate: int, w4a4: bool) -> MoePlan:
    """The one plan of batch-invariant mode at every T: the layer's numerics (W4A4 where it has static input
    scales) on the largest Triton tier (one BLOCK_M, BLOCK_K and reduction order per GEMM whatever the batch; the
    Gluon tiers differ by BLOCK_M, and decode pays for the 128-row tile in padding, not in weight reads)."""
    fam = tier_family(cap)
    kernel = MoeKernel.W4A4 if w4a4 else MoeKernel.W4A16
    tiers = _tiers(kernel, fam)
    return _plan(cap, fam, kernel, (len(tiers) - 1, *tiers[-1][1:]), (_tma(fam, hidden), _tma(fam, intermediate)))


def table_moe_plan(cap: Capability, *, num_tokens: int, top_k: int, global_experts: int, hidden: int,
                   intermediate: int, w4a4: bool, one_numerics: bool = False) -> MoePlan:
    """The built-in tables' plan (the documented default; what ``tune`` measures against): the decode plan where
    :func:`decode_plan` gives one, else the tiers'.  ``one_numerics``: W4A4 at every T where the layer has static
    input scales (``VLLM_NVFP4_SM120_DECODE=w4a4``), so the weight-only decode plan is not taken there."""
    if not (one_numerics and w4a4):
        decode = decode_plan(cap, num_tokens=num_tokens, top_k=top_k, global_experts=global_experts, hidden=hidden,
                             intermediate=intermediate)
        if decode is not None:
            return decode
    return tiers_moe_plan(cap, num_tokens=num_tokens, top_k=top_k, global_experts=global_experts, hidden=hidden,
                          intermediate=intermediate, w4a4=w4a4, one_numerics=one_numerics)


def tiers_moe_plan(cap: Capability, *, num_tokens: int, top_k: int, global_experts: int, hidden: int,
                   intermediate: int, w4a4: bool, one_numerics: bool = False) -> MoePlan:
    """The tiers' plan (align + BLOCK_M GEMMs), decode rows aside: what the benchmarks time the decode plan against."""
    fam = tier_family(cap)
    m = tokens_per_expert(num_tokens, top_k, global_experts)
    kernel = (MoeKernel.W4A4 if w4a4 and (one_numerics or m >= W4A4_MIN_TOKENS_PER_EXPERT)
              else MoeKernel.W4A16)
    tma = _tma(fam, hidden), _tma(fam, intermediate)
    plan = _plan(cap, fam, kernel, _tier(_tiers(kernel, fam), m), tma)
    if fam is Family.SM120 and gluon_enabled():
        return as_gluon(plan, intermediate) or plan
    return plan


def _tma(fam: Family, k: int) -> bool:
    return fam is not Family.OTHER and k % TMA_K_MULTIPLE == 0


def _tiers(kernel: MoeKernel, fam: Family):
    return (_W4A4_TIERS if kernel is MoeKernel.W4A4 else _W4A16_TIERS)[fam]


def _plan(cap: Capability, fam: Family, kernel: MoeKernel, tier, tma: tuple[bool, bool]) -> MoePlan:
    """The Triton plan of one tier row; the Triton W4A16 GEMMs read the weight codes by TMA where ``tma`` says so."""
    i, block_m, gate_up, down = tier
    if kernel is MoeKernel.W4A16:
        gate_up, down = replace(gate_up, use_tma=tma[0]), replace(down, use_tma=tma[1])
    return MoePlan(
        kernel=kernel, block_m=block_m, gate_up=gate_up, down=down,
        fast_decode=cap.cc is not None, decode=fam is Family.OTHER,
        stream_weights=kernel is MoeKernel.W4A16 and block_m == 16, tier=f"{fam}/{kernel}/{i}", tma=tma,
    )


def as_gluon(plan: MoePlan, intermediate: int) -> MoePlan | None:
    """``plan`` on the Gluon GEMMs with their sm_120 tiles, keeping BLOCK_M and the TMA choices; ``None`` when
    Gluon has no tile for it (BLOCK_M 16 / 32).  The benchmarks also use it on the H200."""
    tiles = _GLUON_SM120[plan.kernel]
    if plan.block_m not in tiles:
        return None
    gate_up, down = tiles[plan.block_m]
    if plan.kernel == MoeKernel.W4A4 and down.persistent and intermediate < GLUON_DOWN_EPILOGUE_MAX_I:
        down = replace(down, epilogue_warps=GLUON_EPILOGUE_WARPS)
    return replace(
        plan, gate_up=replace(gate_up, use_tma=plan.tma[0]), down=replace(down, use_tma=plan.tma[1]),
        impl=Impl.GLUON, tier=plan.tier + "/gluon",
    )


def all_moe_plans(cap: Capability) -> list[MoePlan]:
    """Every plan :func:`select_moe_plan` can return for this GPU (for the compile checks and tests)."""
    fam = tier_family(cap)
    plans = []
    tma_choices = [(a, b) for a in (False, True) for b in (False, True)] if fam is not Family.OTHER else [(False,) * 2]
    for kernel in MoeKernel:
        for i, tier in enumerate(_tiers(kernel, fam)):
            for tma in tma_choices:
                plan = _plan(cap, fam, kernel, (i, *tier[1:]), tma)
                if plan not in plans:
                    plans.append(plan)
                if fam is Family.SM120:  # both sides of the epilogue-warps rule
                    for inter in (GLUON_DOWN_EPILOGUE_MAX_I // 2, GLUON_DOWN_EPILOGUE_MAX_I):
                        gluon = as_gluon(plan, inter)
                        if gluon is not None and gluon not in plans:
                            plans.append(gluon)
    # Decode: every T, on both sides of each I and H rule (the down kernel and its TMA, the gate_up rows).
    for tt in range(1, DECODE_MAX_TOKENS + 1) if cap.family in _DECODE_ROWS else ():
        for inter in (4096, 4096 + 16, DECODE_TMA_DOWN_MID_MAX_I, DECODE_TOKEN_DOWN_MAX_I,
                      DECODE_TOKEN_DOWN_MAX_I - 16):
            for hidden in (2048, 4096, 4096 + 16, DECODE_WIDE_GATE_UP_MIN_H):
                plan = decode_tier_plan(cap, tt, hidden=hidden, intermediate=inter)
                if plan not in plans:
                    plans.append(plan)
    for max_t, max_h, _, _ in _DECODE_FUSED_ROWS.get(cap.family, ()):  # the fused rows' plans
        plan = decode_tier_plan(cap, max_t, hidden=max_h, intermediate=4096)
        if plan not in plans:
            plans.append(plan)
    return plans


def tier_plan(cap: Capability, kernel: MoeKernel, block_m: int, *, hidden: int, intermediate: int,
              impl: Impl = Impl.TRITON, num_tokens: int = 1) -> MoePlan | None:
    """The plan of ``kernel``'s tier with this BLOCK_M on ``cap`` (on the Gluon GEMMs for ``impl`` gluon), with the
    TMA choices of the shape; None when the tier tables have no such tier or Gluon no tile for it.  ``impl``
    decode: the decode plan's tiles at ``num_tokens`` (``kernel`` w4a16, ``block_m`` 0 only).  What a measured
    config's row names, and what ``tune`` times."""
    if impl is Impl.DECODE:
        if kernel is not MoeKernel.W4A16 or block_m != 0:
            return None
        return decode_tier_plan(cap, num_tokens, hidden=hidden, intermediate=intermediate)
    fam = tier_family(cap)
    for i, tier in enumerate(_tiers(kernel, fam)):
        if tier[1] == block_m:
            plan = _plan(cap, fam, kernel, (i, *tier[1:]), (_tma(fam, hidden), _tma(fam, intermediate)))
            return plan if impl is Impl.TRITON else as_gluon(plan, intermediate)
    return None
