"""Which MoE kernels, tiles and switches run: ``(GPU capability, tokens per expert, shapes) → MoePlan``.

Everything the kernels leave open is decided here; ``dispatch/moe_flow.py`` only executes a plan.

* **Kernel**: W4A4 (FP4 x FP4, activations quantized with the checkpoint's static input scales) from
  ``W4A4_MIN_TOKENS_PER_EXPERT`` tokens per expert when the layer has those scales; below that, and for W4A16
  checkpoints, W4A16 (bf16/fp16 activations, weights decoded in registers): at a few rows per expert the layer
  is bound by reading the weights, and W4A16 reads the same bytes without quantizing anything.
* **Tokens per expert** ``m = T * top_k / global_E`` is the *average*, known from shapes alone (no host sync
  under CUDA graphs).  Skewed routing still runs correctly, only on a tile chosen for the average.
* **Tiers** by ``m``: BLOCK_M 16 (decode-sized, weights streamed), 32, 64, 128.  Both GEMMs of a layer share
  BLOCK_M (one alignment); BLOCK_N, BLOCK_K, warps and stages are per GEMM.
* **Switches**: ``fast_decode`` (inline-PTX e2m1 decode, any CUDA GPU), ``use_tma`` (TMA weight loads on sm_90
  and sm_120 when that GEMM's K % 256 == 0), ``decode`` (W4A4 without the native FP4 MMA: GPUs before sm_90
  and the interpreter; sm_90 runs ``dot_scaled`` through Triton's exact emulation), ``stream_weights``.
* **Backend**: on sm_120 the BLOCK_M 64 / 128 tiers run the warp-specialized Gluon GEMMs
  (``kernels/gluon_moe_w4a16.py``, ``kernels/gluon_moe_w4a4.py``; BLOCK_M 64 persistent, and there the W4A4 down
  GEMM below I = 1024 with separate epilogue warps) unless ``VLLM_NVFP4_SM120_DISABLE_GLUON=1``; everything else
  is Triton.

Tiles are compile-checked for sm_120 (no local memory, shared memory <= 99 KB) by ``tests/kernels/test_moe_compile.py``
over :func:`all_moe_plans`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..kernels.gluon_compat import gluon_enabled

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
    use_tma: bool = False  # W4A16 only
    persistent: bool = False  # Gluon only
    epilogue_warps: int = 0  # Gluon W4A4 down GEMM only (persistent)

    def kwargs(self, kernel: str, backend: str) -> dict:
        kw = dict(block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps,
                  num_stages=self.num_stages, group_m=self.group_m)
        if kernel == "w4a16":
            kw["use_tma"] = self.use_tma
        if backend == "gluon":
            kw["persistent"] = self.persistent
            if self.epilogue_warps:
                kw["epilogue_warps"] = self.epilogue_warps
        return kw


@dataclass(frozen=True)
class MoePlan:
    kernel: str  # "w4a16" | "w4a4"
    block_m: int
    gate_up: GemmTile
    down: GemmTile
    fast_decode: bool = False  # W4A16: inline-PTX e2m1 decode
    decode: bool = False  # W4A4: exact self-decode + fp16 MMA instead of dot_scaled
    stream_weights: bool = False  # W4A16: weights evict-first
    backend: str = "triton"
    tier: str = ""

    def gate_up_kwargs(self) -> dict:
        return self._kwargs(self.gate_up)

    def down_kwargs(self) -> dict:
        return self._kwargs(self.down)

    def _kwargs(self, tile: GemmTile) -> dict:
        kw = tile.kwargs(self.kernel, self.backend)
        if self.kernel == "w4a16":
            kw.update(fast_decode=self.fast_decode, stream_weights=self.stream_weights)
        elif self.backend == "gluon":
            # None: the block-scaled MMA on sm_120, its exact emulation elsewhere (the H200 benchmarks).
            kw.update(decode=None)
        else:
            kw.update(decode=self.decode)
        return kw


# (max tokens per expert, block_m, gate_up tile, down tile).  gate_up tiles hold BLOCK_N gate *and* BLOCK_N up
# columns (two accumulators), so their BLOCK_N is half the down GEMM's for the same registers.
_W4A16_TIERS = {
    # sm_120: 99 KB of shared memory per block.
    "sm120": (
        (16, 16, GemmTile(64, 256, 4, 3), GemmTile(64, 256, 4, 3)),
        (48, 32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (96, 64, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 4, 3)),  # BLOCK_K 128 spills with two accumulators
        (None, 128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3)),
    ),
    # sm_90 / sm_100: 227 KB of shared memory, deeper pipelines.
    "sm90": (
        (16, 16, GemmTile(64, 256, 4, 4), GemmTile(64, 256, 4, 4)),
        (48, 32, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
        (96, 64, GemmTile(64, 128, 4, 4), GemmTile(128, 64, 4, 4)),
        (None, 128, GemmTile(64, 64, 8, 4), GemmTile(128, 64, 8, 4)),
    ),
    # Before sm_90 (and the interpreter): pointer loads only.
    "other": (
        (16, 16, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (48, 32, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3)),
        (None, 64, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3)),
    ),
}
_W4A4_TIERS = {
    "sm120": (
        (16, 16, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (48, 32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (96, 64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        (None, 128, GemmTile(64, 128, 8, 2), GemmTile(128, 128, 8, 2)),
    ),
    "sm90": (
        (16, 16, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (48, 32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3)),
        (96, 64, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3)),
        (None, 128, GemmTile(64, 128, 8, 3), GemmTile(128, 128, 8, 3)),
    ),
    "other": (
        (48, 16, GemmTile(64, 64, 4, 2), GemmTile(64, 64, 4, 2)),
        (None, 64, GemmTile(64, 64, 4, 2), GemmTile(64, 64, 4, 2)),
    ),
}


# sm_120 tiers served by the warp-specialized Gluon GEMMs: block_m → (gate_up tile, down tile).  BLOCK_M 64 runs
# persistently (the ring runs on across tiles; W4A16 with a third stage).  Every tile here is compile-checked for
# sm_120 in tests/kernels/test_gluon_moe*.py, which assert that these are the compiled ones.
_GLUON_SM120 = {
    # W4A16: BLOCK_K 64 (its only compiled value); 1 TMA loader + 4 decode + 4 / 8 MMA warps.
    "w4a16": {
        64: (GemmTile(64, 64, 4, 3, persistent=True), GemmTile(128, 64, 4, 3, persistent=True)),
        128: (GemmTile(64, 64, 8, 2), GemmTile(128, 64, 8, 2)),
    },
    # W4A4: BLOCK_K 128 (two 64-wide block-scaled MMA steps per slot); 1 loader + 4 / 8 MMA warps.
    "w4a4": {
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


def arch_family(capability: tuple[int, int] | None) -> str:
    """``None`` (CPU / interpreter) and GPUs before sm_90 → ``"other"``; sm_12x → ``"sm120"``; sm_90/10x → ``"sm90"``."""
    if capability is None or capability[0] < 9:
        return "other"
    return "sm120" if capability[0] == 12 else "sm90"


def _tier(table, m: float):
    for i, (max_m, block_m, gate_up, down) in enumerate(table):
        if max_m is None or m <= max_m:
            return i, block_m, gate_up, down
    raise AssertionError("tier tables end with an open row")


def tokens_per_expert(num_tokens: int, top_k: int, global_experts: int) -> float:
    return num_tokens * top_k / max(global_experts, 1)


def select_moe_plan(
    capability: tuple[int, int] | None,
    *,
    num_tokens: int,
    top_k: int,
    global_experts: int,
    hidden: int,
    intermediate: int,
    w4a4: bool,
) -> MoePlan:
    """The plan for one MoE layer call.  ``w4a4``: the layer has static activation scales (W4A4 checkpoint)."""
    fam = arch_family(capability)
    gpu = capability is not None
    m = tokens_per_expert(num_tokens, top_k, global_experts)
    kernel = "w4a4" if w4a4 and m >= W4A4_MIN_TOKENS_PER_EXPERT else "w4a16"
    table = (_W4A4_TIERS if kernel == "w4a4" else _W4A16_TIERS)[fam]
    i, block_m, gate_up, down = _tier(table, m)
    if kernel == "w4a16" and fam != "other":
        gate_up = replace(gate_up, use_tma=hidden % TMA_K_MULTIPLE == 0)
        down = replace(down, use_tma=intermediate % TMA_K_MULTIPLE == 0)
    plan = MoePlan(
        kernel=kernel, block_m=block_m, gate_up=gate_up, down=down,
        fast_decode=gpu, decode=fam == "other", stream_weights=kernel == "w4a16" and block_m == 16,
        tier=f"{fam}/{kernel}/{i}",
    )
    if fam == "sm120" and gluon_enabled():
        return as_gluon(plan, intermediate) or plan
    return plan


def as_gluon(plan: MoePlan, intermediate: int) -> MoePlan | None:
    """``plan`` on the Gluon GEMMs with their sm_120 tiles, keeping BLOCK_M and the TMA choices; ``None`` when
    Gluon has no tile for it (BLOCK_M 16 / 32).  The benchmarks also use it on the H200."""
    tiles = _GLUON_SM120[plan.kernel]
    if plan.block_m not in tiles:
        return None
    gate_up, down = tiles[plan.block_m]
    if plan.kernel == "w4a4" and down.persistent and intermediate < GLUON_DOWN_EPILOGUE_MAX_I:
        down = replace(down, epilogue_warps=GLUON_EPILOGUE_WARPS)
    return replace(
        plan, gate_up=replace(gate_up, use_tma=plan.gate_up.use_tma), down=replace(down, use_tma=plan.down.use_tma),
        backend="gluon", tier=plan.tier + "/gluon",
    )


def all_moe_plans(capability: tuple[int, int] | None) -> list[MoePlan]:
    """Every plan :func:`select_moe_plan` can return for this GPU (for the compile checks and tests)."""
    fam = arch_family(capability)
    gpu = capability is not None
    plans = []
    for kernel, tables in (("w4a16", _W4A16_TIERS), ("w4a4", _W4A4_TIERS)):
        for i, (_, block_m, gate_up, down) in enumerate(tables[fam]):
            tma_choices = [(False, False)]
            if kernel == "w4a16" and fam != "other":
                tma_choices = [(a, b) for a in (False, True) for b in (False, True)]
            for tma_gu, tma_dn in tma_choices:
                plan = MoePlan(
                    kernel=kernel, block_m=block_m,
                    gate_up=replace(gate_up, use_tma=tma_gu), down=replace(down, use_tma=tma_dn),
                    fast_decode=gpu, decode=fam == "other",
                    stream_weights=kernel == "w4a16" and block_m == 16, tier=f"{fam}/{kernel}/{i}",
                )
                plans.append(plan)
                if fam == "sm120":  # both sides of the epilogue-warps rule
                    for inter in (GLUON_DOWN_EPILOGUE_MAX_I // 2, GLUON_DOWN_EPILOGUE_MAX_I):
                        gluon = as_gluon(plan, inter)
                        if gluon is not None and gluon not in plans:
                            plans.append(gluon)
    return plans
