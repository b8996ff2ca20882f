"""Which per-rank shards of an NVFP4 layer can be served at all: the check the glue runs at load, on every rank.

Tensor parallelism splits a row-parallel linear's K (o_proj, down_proj) and a MoE layer's intermediate size I
(the down GEMM's K) across the ranks.  NVFP4 keeps one e4m3 scale per 16 consecutive weights along K, so a rank's
share must be whole 16-blocks: with ``K / TP % 16 != 0`` the checkpoint's block scales cannot be split between the
ranks (vLLM's compressed-tensors and FusedMoE layers round the per-rank scale columns down and load the wrong
scales; ModelOpt refuses with a message that names neither the layer nor the TP size).  No NVFP4 kernel, ours or
vLLM's, can serve such a shard, so the answer is a refusal at load, never a fallback to another kernel.

Every rank has the same per-rank shape (vLLM splits evenly), so every rank reaches the same verdict from the same
numbers: no rank can end up on a different kernel.
"""

from __future__ import annotations

NVFP4_BLOCK = 16  # weights per e4m3 block scale along K


def _tp_sizes_that_fit(full: int, limit: int = 8) -> list[int]:
    return [tp for tp in range(1, limit + 1) if full % tp == 0 and (full // tp) % NVFP4_BLOCK == 0]


def shard_refusal(layer: str, dim: str, full: int, per_rank: int, tp_size: int) -> str | None:
    """Why the rank's shard ``per_rank`` of the layer's ``dim`` (``full`` over ``tp_size`` ranks) cannot be served,
    as one line naming the layer, the TP size and both sizes; ``None`` when it can."""
    if per_rank % NVFP4_BLOCK == 0:
        return None
    fits = _tp_sizes_that_fit(full)
    hint = (f"tensor-parallel sizes that give whole blocks: {', '.join(map(str, fits))}" if fits
            else f"{dim} = {full} is not a multiple of {NVFP4_BLOCK} at any tensor-parallel size")
    return (f"NVFP4 layer {layer}: {dim} = {full} split over tensor-parallel size {tp_size} is {per_rank} per rank, "
            f"not a multiple of {NVFP4_BLOCK} (one e4m3 block scale per {NVFP4_BLOCK} weights along {dim}); no NVFP4 "
            f"kernel can serve this shard ({hint})")
