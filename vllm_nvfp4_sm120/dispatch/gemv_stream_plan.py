"""Tile and grid of the streaming W4A16 decode kernel (``kernels.gluon_gemv_stream``) for a (T, N, K, GPU).

The arithmetic below picks the built-in tile and grid; the H200 measured them (docs/benchmarks.md, "Linear decode
with the streaming kernel in the table" and "More CTAs per SM"): the one-wave grid beats half and twice its size on
every shape timed, and the tile with the most CTAs per SM that keeps 32 rows per warp (a register cap: 4 CTAs at
T <= 8, 3 at T = 9-16) is the best or within 3 % of it on every Qwen3-32B / Llama-3.3-70B layer: warps to hide each
other's stalls and bytes in flight were what the 3-CTA tiles lacked.  Fewer rows per warp (16) fit 5 CTAs but
re-read each activation for half as many weight rows, and lose on the large layers.  sm_120: unmeasured (the same
caps compile there without spills).

- Rows per CTA: every CTA re-reads the activations of its K range from L2: ``2 * T * K`` bytes per
  ``0.5625 * block_m * K`` weight bytes, i.e. ``3.6 * T / block_m`` of the weight traffic (0.9x / 1.8x at 32 rows
  and T = 8 / 16: L2 hits, which the measurement says cost less than the missing occupancy).
- T = 9-16: one 16-token pass reads the weight once; two 8-token passes read it twice (the sweep times both).
- Grid: stream-K over (row tile, 128-k block) pairs with exactly as many CTAs per SM as fit at once (registers
  decide), so every CTA is resident and streams the same number of blocks (+-1): one wave, no ragged tail.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels.gluon_gemv_stream import StreamTile

REGISTERS_PER_SM = 65536
STREAM_MAX_T = 16

# Registers per thread of every tile, as Triton 3.8 compiles it (bf16; sm_90: shift decode, sm_120: cvt).
# tests/dispatch/test_gemv_stream_plan.py recompiles the tiles and checks the CTAs per SM these imply.
TILE_REGISTERS = {
    9: {StreamTile(64, 8): 154, StreamTile(32, 8): 140, StreamTile(128, 8, 4, 2): 154,
        StreamTile(64, 16): 218, StreamTile(128, 16, 4, 2): 218, StreamTile(32, 16): 182,
        StreamTile(32, 8, max_regs=128): 117, StreamTile(16, 8, max_regs=96): 92,
        StreamTile(32, 8, 4, 2, max_regs=96): 91, StreamTile(64, 8, 4, 4, max_regs=96): 85,
        StreamTile(32, 16, max_regs=168): 163, StreamTile(32, 8, max_regs=128, overlap_runs=True): 116,
        StreamTile(32, 16, max_regs=168, overlap_runs=True): 164,
        StreamTile(16, 8, max_regs=96, overlap_runs=True): 96},
    12: {StreamTile(64, 8): 152, StreamTile(32, 8): 138, StreamTile(128, 8, 4, 2): 152,
         StreamTile(64, 16): 191, StreamTile(128, 16, 4, 2): 192, StreamTile(32, 16): 153,
         StreamTile(32, 8, max_regs=128): 111, StreamTile(16, 8, max_regs=96): 91,
         StreamTile(32, 8, 4, 2, max_regs=96): 93, StreamTile(64, 8, 4, 4, max_regs=96): 83,
         StreamTile(32, 16, max_regs=168): 154, StreamTile(32, 8, max_regs=128, overlap_runs=True): 111,
         StreamTile(32, 16, max_regs=168, overlap_runs=True): 154,
         StreamTile(16, 8, max_regs=96, overlap_runs=True): 93},
}


def ctas_per_sm(registers: int, num_warps: int) -> int:
    """CTAs of ``num_warps`` warps that fit in one SM's register file (allocated per warp in units of 8 per
    thread); shared memory (<= 5 KB per CTA) and the warp limit (48 on sm_120) never bind for these tiles."""
    per_cta = num_warps * 32 * -(-registers // 8) * 8
    return max(1, REGISTERS_PER_SM // per_cta)


@dataclass(frozen=True)
class StreamPlan:
    tile: StreamTile
    ctas: int  # CTAs per token tile (the launcher's ``ctas``)
    why: str


def stream_plan(t: int, n: int, k: int, sm_count: int, cc_major: int = 12) -> StreamPlan:
    """The tile and grid for ``x [t, k] @ W [n, k]^T`` with T <= STREAM_MAX_T (more tokens: more token tiles)."""
    if t <= 8:
        tile, why = (StreamTile(32, 8, max_regs=128),
                     "T <= 8: one 8-token tile, 32 rows capped at 128 registers: 4 CTAs per SM (H200: best or within "
                     "3 % of the best tile on all 24 rows timed, 1.03-1.18x the 128-row tile)")
    else:
        tile, why = (StreamTile(32, 16, max_regs=168),
                     "T 9-16: one 16-token pass over the weight, 32 rows capped at 168 registers: 3 CTAs per SM on "
                     "sm_90 (H200: best on 7 of 8 layers, 1.03-1.16x the 128-row tile; 0.98x on one)")
    return StreamPlan(tile, wave_ctas(tile, t, sm_count, cc_major), why)


def wave_ctas(tile: StreamTile, t: int, sm_count: int, cc_major: int = 12) -> int:
    """CTAs per token tile such that all token tiles together are one full wave (every CTA resident)."""
    regs = TILE_REGISTERS[9 if cc_major == 9 else 12][tile]
    tiles_t = -(-max(t, 1) // tile.block_t)
    return max(1, ctas_per_sm(regs, tile.num_warps) * sm_count // tiles_t)
