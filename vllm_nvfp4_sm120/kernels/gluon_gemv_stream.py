"""Streaming W4A16 decode kernel (Gluon, tensor cores): ``out[T, N] = (x[T, K] @ W^T) * w_dec_rows[N] (+ bias)``.

Same operands and conventions as :mod:`.gluon_gemv` (checkpoint codes ``[N, K/2]`` uint8, element 2i in the low
nibble; linear e4m3 block scales ``[N, K/16]``; bf16/fp16 activations with any row stride; per-row decode global
``w_dec_rows [N]`` fp32; output in x's dtype).  What is different is how the weight is streamed, for a decode
that runs at the read-bandwidth limit rather than at the decode's instruction limit:

Bytes in flight
    The K loop is a runtime loop (one compile per tile, not per K) that loads step i + 1 before it decodes step i
    (two register buffers, the loop unrolled by two so no buffer is copied; the run's last step is peeled out
    of the loop, which keeps the loop body branch-free).  In a step every warp takes one 128-k block of its
    ``BLOCK_M / ROW_WARPS`` rows: each lane holds 16 code bytes (one 16-byte load) per row, 2 scale bytes per
    row and 32 activations per token, so ``2 * BLOCK_M / ROW_WARPS`` code bytes per lane are in flight while
    the previous step decodes.

Stream-K grid
    The work of a token tile is the list of (row tile, 128-k block) pairs, row tile by row tile; the grid has a
    fixed number of CTAs (``ctas``, chosen by the caller: as many as fit on the GPU at once) and CTA ``p`` takes
    the contiguous range ``[p * total // ctas, (p + 1) * total // ctas)``: every CTA streams the same number of
    blocks (+-1), there is no ragged last wave, and each range is one or a few long contiguous runs along K.
    In a run, warp ``kw * ROW_WARPS + rw`` takes rows ``rw`` of the tile and blocks ``kw, kw + KW, ...``
    (``KW = WARPS / ROW_WARPS``; the row warps of one ``kw`` read the same activations, the second read an L1
    hit).  A row tile whose blocks were shared by several CTAs is finished by the last of them to arrive: each
    writes its fp32 partial to a workspace slot, raises the tile's counter (release/acquire at GPU scope), and the
    CTA that brings the count to the number of contributors adds the partials **in CTA order** (deterministic,
    whichever arrives last), applies the epilogue and resets the counter to 0 for the next call (CUDA-graph
    replays included).  One launch per call; tiles owned by one CTA skip the workspace.

Decode (``DECODE`` constexpr), fused with the scale: one inline-asm call per 32-bit code word (8 elements) that
returns the four MMA operand registers, each a bf16/fp16 pair already multiplied by the pair ``(s, s)`` of the
word's block scale (one ``fma.rn.{bf16,f16}x2`` per pair; exact, e2m1 x e4m3 has at most 6 significant bits).
    DECODE_SHIFT (portable, sm_80+; what the H200 runs): the 3 magnitude bits of a code are its e2m1 exponent and
    mantissa, so placed at the low end of a 16-bit float's exponent / top of its mantissa they *are* the value
    times a power of two (e2m1's subnormals 0 and 0.5 land on the 16-bit format's subnormals).  One mask, one
    integer multiply (which copies the nibble to the magnitude and the sign positions at once) and one mask per
    pair instead of the lop3/prmt table.  The pair is (element j, element j + 4) of the word, and the power of two
    (2^-126 for bf16, 2^-14 for fp16) is taken out by the scale (2^119 / 2^7) and the epilogue (2^7).
    DECODE_CVT (sm_100a/sm_120a): the native ``cvt.rn.{bf16,f16}x2.e2m1x2``, pairs = the two nibbles of a byte;
    the scale pairs from ``cvt.rn.{bf16,f16}x2.e4m3x2``, two scale bytes per convert (:data:`SCALE_PAIRS_E4M3_ASM`).
    DECODE_PORTABLE: the exact lop3/prmt table of :mod:`.gluon_gemv`, pairs = the nibbles of a byte.
    DECODE_COPY (a timing probe, never a result): no decode, each of the four pairs is the code word itself (the
    scale multiply, the loads, the MMAs and the cross-CTA sums stay); the output is meaningless.  Beside the plan on
    the same layer it measures what the decode's instructions cost, i.e. whether the loop waits on its issue or on
    its bytes.  Only the benchmarks pass it: it is not in :data:`DECODE_NAMES`, so no table or config can name it.
    DECODE_RAW (the same kind of probe, one step further): no decode and no scale arithmetic either; the pairs are
    the word three times and the word plus its raw scale byte once (one integer add, which keeps the scale loads),
    so what is left is the loads, the MMAs, the loop and the cross-CTA sums.

k permutation (as in gemv_mma): the MMA's k index is a relabelling of memory k within each 128-k block chosen so
that one 16-byte load per row and lane, and the lane's 32 contiguous activations, land in the mma_v2 operand
fragments; the same relabelling on both operands leaves the dot product unchanged, and every layout change is
asserted trivial at compile time.  With DECODE_SHIFT the pair order inside a word differs from memory order,
so the activations are repacked (one ``prmt`` per activation register, shared by the warp's rows).
:func:`operand_k_of_memory_k` is the relabelling in Python; the CPU tests model it.

The precision contract is the one of the other kernels: products exact, fp32 accumulation, one rounding to the
output dtype; with DECODE_SHIFT the MMA sums ``w * x * 2^-7`` (a power of two, restored in the epilogue), so only
products below 2^-119 in magnitude would differ (they underflow fp32 inside the MMA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .common import register_cap_option
from .gluon_compat import HAS_GLUON, ampere, gl, gluon, require_gluon
from .fp4_decode import SHIFT_BF16_BODY, SHIFT_EXP, SHIFT_F16_BODY, SHIFT_SCALE  # noqa: F401 (re-exported)
from .gluon_common import DECODE_CVT, DECODE_PORTABLE, E2M1_ASM, default_decode
from .launch import StreamCounters  # noqa: F401 (the ready launch's counters; re-exported)

DECODE_SHIFT = 2
DECODE_NAMES = {DECODE_CVT: "cvt", DECODE_PORTABLE: "portable", DECODE_SHIFT: "shift"}
DECODE_COPY = 3  # the timing probes above: launchers take them, DECODE_NAMES (what plans and configs may name) does not
DECODE_RAW = 4
PROBE_DECODE_NAMES = {DECODE_COPY: "copy", DECODE_RAW: "raw"}

# ---------------------------------------------------------------------------------------------------------------
# Decode + scale: one 32-bit code word in ($4) and the scale pair (s, s) in ($5) -> four pairs ($0..$3).
# ---------------------------------------------------------------------------------------------------------------
# The shift decode (bodies, power of two): kernels/fp4_decode.py, shared with the Triton MoE decode kernels.


def _with_scale(body: str, fmt: str) -> str:
    """Wrap a decode body writing d0..d3 (pairs) into the asm that multiplies each by the scale pair $5.

    The addend is -0.0: fma(a, s, -0) is the exact product, including the sign of a zero product."""
    return (
        "{ .reg .b32 q, z, d<4>; mov.b32 z, 0x80008000; " + body
        + "".join(f"fma.rn.{fmt}x2 ${i}, d{i}, $5, z; " for i in range(4)) + "}"
    )


def _writing_d(asm: str) -> str:
    """gluon_gemv's decode asm (outputs $0..$3) rewritten to write the scratch registers d0..d3."""
    for i in range(4):
        asm = asm.replace(f"${i}", f"d{i}")
    return asm + " "


def _copy_asm(fmt: str) -> str:
    """The probe: the word times the scale pair, four times, each product added to the one before (equal
    multiplies would be merged into one, and the probe would drop 3 of the 4 scale multiplies with the decode)."""
    return ("{ .reg .b32 z; mov.b32 z, 0x80008000; " + f"fma.rn.{fmt}x2 $0, $4, $5, z; "
            + "".join(f"fma.rn.{fmt}x2 ${i}, $4, $5, ${i - 1}; " for i in range(1, 4)) + "}")


SCALED_E2M1_ASM = {
    ("shift", "bf16"): _with_scale(SHIFT_BF16_BODY, "bf16"),
    ("shift", "f16"): _with_scale(SHIFT_F16_BODY, "f16"),
    **{(kind, fmt): _with_scale(_writing_d(E2M1_ASM[(kind, fmt)]), fmt)
       for kind in ("portable", "cvt") for fmt in ("bf16", "f16")},
}
SCALED_E2M1_CONSTRAINTS = "=r,=r,=r,=r,r,r"
# The timing probes' asm (not decodes: apart from SCALED_E2M1_ASM, whose entries the tests check bit for bit).
COPY_PROBE_ASM = {fmt: _copy_asm(fmt) for fmt in ("bf16", "f16")}
RAW_PROBE_ASM = "mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; add.u32 $3, $4, $5;"
# The scale pair: one fp32 scale -> (s, s) as two 16-bit floats in one register (exact: e4m3 fits both).
SCALE_PAIR_ASM = {"bf16": "cvt.rn.bf16x2.f32 $0, $1, $1;", "f16": "cvt.rn.f16x2.f32 $0, $1, $1;"}
# With DECODE_CVT (sm_100+ / sm_120, PTX ISA >= 9.2): a lane's two scale bytes of a row (packed in $2) -> their two
# pairs by one e4m3 convert instead of the e4m3 -> fp32 -> pair chain per scale; each pair is a copy of one half of
# the converted register, which ptxas folds into the multiply that reads it (an .H0_H0 / .H1_H1 operand).
SCALE_PAIRS_E4M3_ASM = {
    fmt: ("{ .reg .b16 s<2>, l<2>; .reg .b32 q; mov.b32 {s0, s1}, $2; "
          f"cvt.rn.{fmt}x2.e4m3x2 q, s0; mov.b32 {{l0, l1}}, q; mov.b32 $0, {{l0, l0}}; mov.b32 $1, {{l1, l1}}; }}")
    for fmt in ("bf16", "f16")
}

if HAS_GLUON:
    _C = gl.constexpr(SCALED_E2M1_CONSTRAINTS)
    _ASM_SHIFT_BF16 = gl.constexpr(SCALED_E2M1_ASM[("shift", "bf16")])
    _ASM_SHIFT_F16 = gl.constexpr(SCALED_E2M1_ASM[("shift", "f16")])
    _ASM_PORTABLE_BF16 = gl.constexpr(SCALED_E2M1_ASM[("portable", "bf16")])
    _ASM_PORTABLE_F16 = gl.constexpr(SCALED_E2M1_ASM[("portable", "f16")])
    _ASM_CVT_BF16 = gl.constexpr(SCALED_E2M1_ASM[("cvt", "bf16")])
    _ASM_CVT_F16 = gl.constexpr(SCALED_E2M1_ASM[("cvt", "f16")])
    _ASM_COPY_BF16 = gl.constexpr(COPY_PROBE_ASM["bf16"])
    _ASM_COPY_F16 = gl.constexpr(COPY_PROBE_ASM["f16"])
    _ASM_RAW = gl.constexpr(RAW_PROBE_ASM)
    _ASM_PAIR_BF16 = gl.constexpr(SCALE_PAIR_ASM["bf16"])
    _ASM_PAIR_F16 = gl.constexpr(SCALE_PAIR_ASM["f16"])
    _ASM_E4M3_PAIRS_BF16 = gl.constexpr(SCALE_PAIRS_E4M3_ASM["bf16"])
    _ASM_E4M3_PAIRS_F16 = gl.constexpr(SCALE_PAIRS_E4M3_ASM["f16"])
    _SCALE_SHIFT_BF16 = gl.constexpr(SHIFT_SCALE["bf16"])
    _SCALE_SHIFT_F16 = gl.constexpr(SHIFT_SCALE["f16"])
    _EPILOGUE_SHIFT = gl.constexpr(2.0 ** SHIFT_EXP)


# ---------------------------------------------------------------------------------------------------------------
# The k relabelling (Python model of what the kernel's reshapes/permutes do; tested on CPU)
# ---------------------------------------------------------------------------------------------------------------
K_BLOCK = 128  # k per warp and step: 4 lanes x 32 elements (16 code bytes, one 16-byte load)


def operand_k_of_memory_k(m: int, decode: int) -> int:
    """MMA operand index k' (within a 128-k block) that holds memory element ``m`` of that block.

    Lane ``4g + t`` loads memory [32t, 32t + 32) of its rows: words c = 0..3 of 8 elements each.  The mma_v2
    operand layout (k_width = 8) gives that lane the operand indices 32c + 8t + jj (jj = 0..7), in pairs
    (jj, jj + 1) per 32-bit register.  A decode pair is (2b, 2b + 1) for the byte decodes and (j, j + 4) for the
    shift decode, so jj = element-in-word for the former and 2 * (e % 4) + e // 4 for the latter.
    """
    t, c, e = m // 32, (m // 8) % 4, m % 8
    jj = 2 * (e % 4) + e // 4 if decode == DECODE_SHIFT else e
    return 32 * c + 8 * t + jj


# The kernel's reshapes of a step ([warps, rows or tokens, ...] tensors), shared with the CPU model of the tests:
# - the four decode outputs joined as [.., group, word, half, j bit 0, j bit 1] -> (group, word, j, half);
PAIR_ORDER = (0, 1, 2, 3, 6, 5, 4)
# - a block [.., 4 lanes t, 4 words c, 8 slots] -> operand order (c, t, slot);
BLOCK_ORDER = (0, 1, 3, 2, 4)
# - shift-decode activations [.., t, c, e // 4, e % 4] -> (c, t, e % 4, e // 4): slot 2 (e % 4) + e // 4.
X_SHIFT_ORDER = (0, 1, 3, 2, 5, 4)
if HAS_GLUON:
    _PAIR_ORDER = gl.constexpr(PAIR_ORDER)
    _BLOCK_ORDER = gl.constexpr(BLOCK_ORDER)
    _X_SHIFT_ORDER = gl.constexpr(X_SHIFT_ORDER)


# ---------------------------------------------------------------------------------------------------------------
# Tiles and the workspace
# ---------------------------------------------------------------------------------------------------------------
def check_stream_step(tile) -> None:
    """The fields that shape the streaming step (this kernel's :class:`StreamTile` and the MoE kernels'
    ``MoeStreamTile``, which run the same step): a ValueError naming the tile's class where they do not fit."""
    name = type(tile).__name__
    if tile.block_t not in (8, 16) or tile.num_warps not in (2, 4, 8) or tile.row_warps not in (1, 2, 4):
        raise ValueError(f"{name}: unsupported {tile}")
    if tile.num_warps % tile.row_warps or tile.block_m not in tuple(r * tile.row_warps for r in (16, 32, 64)):
        raise ValueError(f"{name}: {tile}: needs 16, 32 or 64 rows per row warp and row_warps | num_warps")
    if tile.prefetch not in (1, 2) or (tile.prefetch == 2 and tile.overlap_runs):
        raise ValueError(f"{name}: {tile}: prefetch is 1 or 2, and 2 only without overlapped runs")
    register_cap_option(name, tile.max_regs)


@dataclass(frozen=True)
class StreamTile:
    block_m: int  # weight rows per CTA: 16, 32 or 64 per row warp
    block_t: int  # tokens per CTA: 8 or 16 (the mma N); more tokens run more token tiles over the weight
    num_warps: int = 4
    row_warps: int = 1  # warps splitting the rows; the other num_warps / row_warps interleave the 128-k blocks
    # Registers per thread the compiler may use (the launch option ``maxnreg``; None: its own choice).  Registers
    # decide how many CTAs an SM holds at once, i.e. the warps that hide each other's stalls and the bytes in
    # flight; a cap is only worth it where the kernel still fits without spilling (the compile tests check).
    max_regs: int | None = None
    # Each run's first step loaded before the previous run's last step and its reduction: a CTA whose range crosses
    # a row tile keeps loads in flight across the boundary instead of waiting for the shared tile's count.
    overlap_runs: bool = False
    # Steps a warp has loaded ahead of the one it decodes: 1 (two register buffers) or 2 (three; runs not overlapped).
    prefetch: int = 1

    def __post_init__(self):
        check_stream_step(self)

    @property
    def k_warps(self) -> int:
        return self.num_warps // self.row_warps

    def params(self) -> dict:
        """The tile as plan parameters (``StreamTile(**params)`` rebuilds it): its fields, ``max_regs`` and
        ``overlap_runs`` only where set, so the other tiles keep the names and config rows they always had."""
        out = dict(vars(self))
        if out["max_regs"] is None:
            del out["max_regs"]
        if not out["overlap_runs"]:
            del out["overlap_runs"]
        if out["prefetch"] == 1:
            del out["prefetch"]
        return out

    @property
    def constexprs(self) -> dict:
        """The kernel's compile-time arguments this tile sets."""
        return dict(BLOCK_M=self.block_m, BLOCK_T=self.block_t, WARPS=self.num_warps, ROW_WARPS=self.row_warps,
                    OVERLAP_RUNS=self.overlap_runs, PREFETCH=self.prefetch)

    @property
    def launch_options(self) -> dict:
        """Triton launch options besides the constexprs: ``num_warps`` and, where set, ``maxnreg``."""
        return {"num_warps": self.num_warps, **register_cap_option("StreamTile", self.max_regs)}


# Every tile the dispatch may pick (the tests compile and run each one).
STREAM_TILES = (
    StreamTile(64, 8), StreamTile(32, 8), StreamTile(128, 8, 4, 2),
    StreamTile(64, 16), StreamTile(128, 16, 4, 2), StreamTile(32, 16),
    # More CTAs per SM (fewer registers, fewer rows per warp): 4 or 5 of 4 warps at T <= 8 instead of 3, 3 at
    # T = 9-16 instead of 2 (sm_90).  Each fits its cap without spilling on sm_90 and sm_120 (compile tests).
    # (16 rows per warp at 16 tokens would also fit 3 CTAs, but at ~34 instructions per code word on sm_90
    # instead of 28.6: each activation register serves half as many weight rows.)
    StreamTile(32, 8, max_regs=128), StreamTile(16, 8, max_regs=96), StreamTile(32, 8, 4, 2, max_regs=96),
    StreamTile(64, 8, 4, 4, max_regs=96), StreamTile(32, 16, max_regs=168),
    # The built-in plan's tiles with the runs overlapped, within the same caps (compile tests).
    StreamTile(32, 8, max_regs=128, overlap_runs=True), StreamTile(32, 16, max_regs=168, overlap_runs=True),
    StreamTile(16, 8, max_regs=96, overlap_runs=True),
)
# Two steps loaded ahead (three register buffers), within caps that compile without spilling on sm_90 and sm_120
# (compile tests): twice the code bytes in flight per warp, at 3 / 4 / 2 CTAs per SM.  The one-step loop's stall
# samples put its waits at the first decode instruction of each word, i.e. on codes that arrive late.  On an H100
# they gave the one-step tile's bits and were not faster than the plan on 22 of 32 decode rows (up to 1.27x slower at
# T = 16, 1.01-1.08x faster on the other 10): the waits are not for want of loads in flight per warp.  So they are
# sweep candidates only, not in STREAM_TILES (neither the dispatch nor `tune` picks them).
DEEP_PREFETCH_TILES = (
    StreamTile(32, 8, max_regs=168, prefetch=2), StreamTile(16, 8, max_regs=128, prefetch=2),
    StreamTile(32, 16, max_regs=200, prefetch=2),
)


@dataclass(frozen=True)
class StreamGrid:
    """The stream-K decomposition of one call: what the kernel and its workspace are sized from."""

    tiles_m: int  # row tiles
    tiles_t: int  # token tiles
    blocks_per_row: int  # 128-k blocks per row (NB)
    ctas: int  # CTAs per token tile
    slots_per_cta: int  # most row tiles one CTA's range can touch

    @property
    def total_blocks(self) -> int:
        return self.tiles_m * self.blocks_per_row

    @property
    def counters_numel(self) -> int:
        return self.tiles_t * self.tiles_m

    def partials_numel(self, tile: StreamTile) -> int:
        return self.tiles_t * self.ctas * self.slots_per_cta * tile.block_m * tile.block_t


def stream_grid(t: int, n: int, k: int, tile: StreamTile, ctas: int) -> StreamGrid:
    """Clamp ``ctas`` to the number of blocks (every CTA gets at least one) and size the partial slots."""
    tiles_m = triton.cdiv(n, tile.block_m)
    nb = triton.cdiv(k, K_BLOCK)
    total = tiles_m * nb
    ctas = max(1, min(int(ctas), total))
    if total * ctas >= 2**31:
        raise ValueError(f"gemv_stream: {total} blocks x {ctas} CTAs overflows the kernel's 32-bit range arithmetic")
    longest = triton.cdiv(total, ctas)
    # A range of L blocks starting anywhere touches at most cdiv(L - 1, NB) + 1 row tiles.
    slots = triton.cdiv(longest - 1, nb) + 1
    return StreamGrid(tiles_m, triton.cdiv(max(t, 1), tile.block_t), nb, ctas, slots)


@dataclass
class StreamWorkspace:
    """fp32 partial sums and the per-tile arrival counters of the stream-K reduction.

    The counters must be zero before the first call; the kernel leaves them zero, so one workspace serves every
    later call (and CUDA-graph replay) whose grid fits.  Not shareable by launches that may run concurrently."""

    partials: torch.Tensor  # fp32, >= tiles_t * ctas * slots_per_cta * block_m * block_t
    counters: torch.Tensor  # int32, >= tiles_t * tiles_m

    @classmethod
    def for_grid(cls, grid: StreamGrid, tile: StreamTile, device) -> StreamWorkspace:
        return cls(torch.empty(grid.partials_numel(tile), dtype=torch.float32, device=device),
                   torch.zeros(grid.counters_numel, dtype=torch.int32, device=device))

    def check(self, grid: StreamGrid, tile: StreamTile, device) -> None:
        from ..format.checks import check_tensor

        check_tensor("workspace.partials", self.partials, dtype=torch.float32, device=device)
        check_tensor("workspace.counters", self.counters, dtype=torch.int32, device=device)
        need_p, need_c = grid.partials_numel(tile), grid.counters_numel
        if self.partials.numel() < need_p or not self.partials.is_contiguous():
            raise ValueError(f"workspace.partials: expected a contiguous fp32 tensor of >= {need_p} elements, "
                             f"got shape {list(self.partials.shape)}")
        if self.counters.numel() < need_c or not self.counters.is_contiguous():
            raise ValueError(f"workspace.counters: expected a contiguous int32 tensor of >= {need_c} elements, "
                             f"got shape {list(self.counters.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------
# For the compile harness: argument types as the launcher passes them (bf16 activations).
STREAM_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wdec_ptr": "*fp32", "bias_ptr": "*bf16",
    "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
    "T": "i32", "N": "i32", "K": "i32", "stride_xt": "i32", "stride_ww": "i32", "stride_wsn": "i32",
    "stride_ot": "i32", "total_blocks": "i32", "slots_per_cta": "i32",
    "HAS_BIAS": "constexpr", "DECODE": "constexpr", "EVEN_K": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_T": "constexpr", "WARPS": "constexpr", "ROW_WARPS": "constexpr",
    "OVERLAP_RUNS": "constexpr", "PREFETCH": "constexpr",
}
# What the JIT marks divisible by 16 on checkpoint shapes (K % 256 == 0: every row stride is; the code row
# stride is in 32-bit words, K / 8).
STREAM_DIVISIBLE = [k for k, v in STREAM_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_xt", "stride_ww", "stride_wsn", "stride_ot",
]

if HAS_GLUON:

    @gluon.jit
    def _scaled_pairs(words, s_pair, DECODE: gl.constexpr, F16: gl.constexpr):
        """int32 code words -> four int32 tensors of the same shape: the scaled operand pairs j = 0..3."""
        if DECODE == 2:
            if F16:
                o = gl.inline_asm_elementwise(_ASM_SHIFT_F16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
            else:
                o = gl.inline_asm_elementwise(_ASM_SHIFT_BF16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
        elif DECODE == 1:
            if F16:
                o = gl.inline_asm_elementwise(_ASM_PORTABLE_F16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
            else:
                o = gl.inline_asm_elementwise(_ASM_PORTABLE_BF16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
        elif DECODE == 3:  # DECODE_COPY, a timing probe
            if F16:
                o = gl.inline_asm_elementwise(_ASM_COPY_F16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
            else:
                o = gl.inline_asm_elementwise(_ASM_COPY_BF16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
        elif DECODE == 4:  # DECODE_RAW, a timing probe (s_pair: the raw scale bytes)
            o = gl.inline_asm_elementwise(_ASM_RAW, _C, [words, s_pair], [gl.int32] * 4, True, 1)
        else:
            if F16:
                o = gl.inline_asm_elementwise(_ASM_CVT_F16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
            else:
                o = gl.inline_asm_elementwise(_ASM_CVT_BF16, _C, [words, s_pair], [gl.int32] * 4, True, 1)
        return o

    @gluon.jit
    def _halves(p, DT: gl.constexpr):
        """int32 pairs -> [..., 2] of DT: (low half, high half); the MMA packs them back into the same register."""
        lo = p.to(gl.int16).to(DT, bitcast=True)
        hi = (p >> 16).to(gl.int16).to(DT, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _step_mma(words, sc, x, acc, DECODE: gl.constexpr, WARPS: gl.constexpr, BMW: gl.constexpr,
                  BLOCK_T: gl.constexpr, W4: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
        """One step: every warp's 128-k block of its BMW rows, decoded, scaled and multiplied into acc."""
        DT: gl.constexpr = x.dtype
        F16: gl.constexpr = DT == gl.float16
        # Codes [W, BMW, 16 words] seen as [W, BMW, 8 scale groups, 2 words] to pair each word with its scale.
        w4 = gl.convert_layout(words.reshape([WARPS, BMW, 8, 2]), W4, assert_trivial=True)
        if DECODE == 4:  # DECODE_RAW: the scale bytes as they are (a probe; no scale arithmetic)
            sp = sc.to(gl.int32)
        elif DECODE == 0:  # DECODE_CVT: the scale bytes converted two at a time
            if F16:
                sp = gl.inline_asm_elementwise(_ASM_E4M3_PAIRS_F16, "=r,=r,r", [sc], gl.int32, True, 2)
            else:
                sp = gl.inline_asm_elementwise(_ASM_E4M3_PAIRS_BF16, "=r,=r,r", [sc], gl.int32, True, 2)
        else:
            s = sc.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            if DECODE == 2:
                if F16:
                    s = s * _SCALE_SHIFT_F16
                else:
                    s = s * _SCALE_SHIFT_BF16
            if F16:
                sp = gl.inline_asm_elementwise(_ASM_PAIR_F16, "=r,r", [s], gl.int32, True, 1)
            else:
                sp = gl.inline_asm_elementwise(_ASM_PAIR_BF16, "=r,r", [s], gl.int32, True, 1)
        sp, w4 = gl.broadcast(sp[:, :, :, None], w4)
        o0, o1, o2, o3 = _scaled_pairs(w4, sp, DECODE, F16)
        # [W, BMW, group, word, half, j bit 0, j bit 1] -> (group, word, j, half): the pairs in operand order
        e = gl.join(gl.join(_halves(o0, DT), _halves(o1, DT)), gl.join(_halves(o2, DT), _halves(o3, DT)))
        e = e.permute(_PAIR_ORDER)
        # Within the block: memory word c of lane t -> operand k' = 32c + 8t + (pair slot)
        w = e.reshape([WARPS, BMW, 4, 4, 8]).permute(_BLOCK_ORDER).reshape([WARPS, BMW, 128])
        a = gl.convert_layout(w, A_OP, assert_trivial=True)
        if DECODE == 2:  # pairs (j, j + 4): the activations' element e of a word goes to slot 2 (e % 4) + e // 4
            xv = x.reshape([WARPS, BLOCK_T, 4, 4, 2, 4]).permute(_X_SHIFT_ORDER).reshape([WARPS, BLOCK_T, 128])
        else:
            xv = x.reshape([WARPS, BLOCK_T, 4, 4, 8]).permute(_BLOCK_ORDER).reshape([WARPS, BLOCK_T, 128])
        b = gl.convert_layout(xv.permute(0, 2, 1), B_OP, assert_trivial=True)
        return ampere.mma_v2(a, b, acc)

    @gluon.jit
    def _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb, k_w, k_s, k_x, K, EVEN_K: gl.constexpr):
        """The loads of one step.  ``kb`` is each warp's block index, a [W, 1, 1] tensor in each load layout;
        the offsets are 32-bit and relative to per-tile (weights) and per-token-tile (activations) bases, which
        keeps one register per row instead of a 64-bit pointer."""
        if EVEN_K:
            words = gl.load(w_base + (w_offs + kb[0] * 16))
            sc = gl.load(s_base + (s_offs + kb[1] * 8))
            x = gl.load(x_base + (x_offs + kb[2] * 128), eviction_policy="evict_last")
        else:  # the last block of a row ends past K: zero codes and activations there add nothing
            words = gl.load(w_base + (w_offs + kb[0] * 16), mask=kb[0] * 128 + k_w < K, other=0)
            sc = gl.load(s_base + (s_offs + kb[1] * 8), mask=kb[1] * 128 + k_s < K, other=0)
            x = gl.load(x_base + (x_offs + kb[2] * 128), mask=kb[2] * 128 + k_x < K, other=0.0,
                        eviction_policy="evict_last")
        return words, sc, x

    @gluon.jit
    def _step_blocks(kb_w, kb_s, kb_x, offset, kb_last):
        """Each warp's block of a step, clamped to the run, in the three load layouts."""
        return (gl.minimum(kb_w + offset, kb_last), gl.minimum(kb_s + offset, kb_last),
                gl.minimum(kb_x + offset, kb_last))

    @gluon.jit
    def _run_span(b, b_end, NB, KW: gl.constexpr):
        """The run that starts at block ``b`` of a CTA's range ``[.., b_end)`` (a list of row tiles of NB 128-k
        blocks each): ``(tile, run_end, kb0, kb_last, last)``, its row tile, where it ends, its first and last block
        in the row and the index of its last step."""
        tile = b // NB
        run_end = gl.minimum(b_end, (tile + 1) * NB)
        return tile, run_end, b - tile * NB, run_end - tile * NB - 1, gl.cdiv(run_end - b, KW) - 1

    @gluon.jit
    def _run_product(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, last, w_c, w_s, w_x, k_c, k_s,
                     k_x, K, EVEN_K: gl.constexpr, DECODE: gl.constexpr, WARPS: gl.constexpr,
                     ROW_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, MMA: gl.constexpr,
                     W4: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, ACC_B: gl.constexpr,
                     O2: gl.constexpr, ROW_POINTERS: gl.constexpr = False, PREFETCH: gl.constexpr = 1):
        """One run: blocks ``kb0 .. kb_last`` of a row tile, ``last`` the index of its last step; returns the tile's
        fp32 products ``[BLOCK_M, BLOCK_T]`` in ``O2``, summed over the K warps.

        Step i: warp (kw, rw) takes block kb0 + i * KW + kw.  Only the run's last step can cover fewer than KW
        blocks; there the surplus warps' blocks are clamped to the run's last block (an L1/L2 re-read, never a DRAM
        byte outside the run) and their codes zeroed.  Prefetches past the run are clamped too.

        ``ROW_POINTERS``: the bases and 32-bit offsets become 64-bit pointers once per run, so a load's address is
        one ``IMAD.WIDE`` of its block offset instead of a 32-bit add, a 64-bit widening and a 64-bit add (~2
        instructions per code word fewer on sm_120, ~1.3 on sm_90), for one more register per pointer.

        ``PREFETCH``: how many steps ahead of the one it decodes a warp has loaded (1: two register buffers; 2:
        three, see :func:`_run_steps_deep`).

        The run in three parts, which a caller that loads the next run's first step early calls one by one:
        :func:`_run_bases`, :func:`_run_first` (the first step's loads), :func:`_run_steps` (every step but the
        last, which it returns loaded) and :func:`_run_last`."""
        w_base, w_offs, s_base, s_offs, x_base, x_offs = _run_bases(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                                                    ROW_POINTERS)
        words, sc, x = _run_first(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, w_c, w_s, w_x,
                                  k_c, k_s, k_x, K, EVEN_K, ROW_WARPS)
        if PREFETCH == 2:
            acc, words, sc, x = _run_steps_deep(words, sc, x, w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0,
                                                kb_last, last, w_c, w_s, w_x, k_c, k_s, k_x, K, EVEN_K, DECODE, WARPS,
                                                ROW_WARPS, BLOCK_M, BLOCK_T, MMA, W4, A_OP, B_OP)
        else:
            acc, words, sc, x = _run_steps(words, sc, x, w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0,
                                           kb_last, last, w_c, w_s, w_x, k_c, k_s, k_x, K, EVEN_K, DECODE, WARPS,
                                           ROW_WARPS, BLOCK_M, BLOCK_T, MMA, W4, A_OP, B_OP)
        return _run_last(words, sc, x, acc, DECODE, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, W4, A_OP, B_OP, ACC_B, O2)

    @gluon.jit
    def _run_bases(w_base, w_offs, s_base, s_offs, x_base, x_offs, ROW_POINTERS: gl.constexpr):
        """A run's load bases and offsets: as given, or (``ROW_POINTERS``) one 64-bit pointer per row and zero
        offsets."""
        if ROW_POINTERS:  # a 64-bit pointer per row, once per run: each load's address is one wide multiply-add
            w_base = w_base + w_offs
            w_offs = 0
            s_base = s_base + s_offs
            s_offs = 0
            x_base = x_base + x_offs
            x_offs = 0
        return w_base, w_offs, s_base, s_offs, x_base, x_offs

    @gluon.jit
    def _run_first(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, w_c, w_s, w_x, k_c, k_s, k_x, K,
                   EVEN_K: gl.constexpr, ROW_WARPS: gl.constexpr):
        """The loads of a run's first step (bases from :func:`_run_bases`)."""
        kb_w, kb_s, kb_x = kb0 + w_c // ROW_WARPS, kb0 + w_s // ROW_WARPS, kb0 + w_x // ROW_WARPS
        return _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs, _step_blocks(kb_w, kb_s, kb_x, 0, kb_last),
                          k_c * 8, k_s * 16, k_x, K, EVEN_K)

    @gluon.jit
    def _run_steps(words_a, sc_a, x_a, w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, last, w_c, w_s,
                   w_x, k_c, k_s, k_x, K, EVEN_K: gl.constexpr, DECODE: gl.constexpr, WARPS: gl.constexpr,
                   ROW_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, MMA: gl.constexpr,
                   W4: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
        """Steps ``0 .. last - 1`` of a run whose first step is loaded (``words_a, sc_a, x_a``): ``(acc, the last
        step's loads)``, the surplus warps' codes of the last step zeroed.  Each step loads the next before it
        decodes (two register buffers, the loop unrolled by two so no buffer is copied)."""
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        kb_w, kb_s, kb_x = kb0 + w_c // ROW_WARPS, kb0 + w_s // ROW_WARPS, kb0 + w_x // ROW_WARPS
        acc = gl.zeros([WARPS, BMW, BLOCK_T], gl.float32, MMA)
        for i in range(0, last - 1, 2):  # pairs of steps before the last: every warp has a block
            words_b, sc_b, x_b = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, (i + 1) * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_a, sc_a, x_a, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            words_a, sc_a, x_a = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, (i + 2) * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_b, sc_b, x_b, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
        # Buffer a now holds step `last` (last even) or step `last - 1` (last odd).
        if last % 2 == 1:
            words_b, sc_b, x_b = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, last * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_a, sc_a, x_a, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            words_a, sc_a, x_a = words_b, sc_b, x_b
        words_a = gl.where(kb_w + last * KW <= kb_last, words_a, 0)
        return acc, words_a, sc_a, x_a

    @gluon.jit
    def _run_steps_deep(words_a, sc_a, x_a, w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, last, w_c,
                        w_s, w_x, k_c, k_s, k_x, K, EVEN_K: gl.constexpr, DECODE: gl.constexpr, WARPS: gl.constexpr,
                        ROW_WARPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, MMA: gl.constexpr,
                        W4: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
        """:func:`_run_steps` with each step loaded two steps before it is decoded (three register buffers, the
        loop unrolled by three): twice the code bytes in flight per warp, for a third buffer of registers.  The
        stall samples of the one-step loop put its waits at the first decode instruction of each word, i.e. on
        codes that arrive late."""
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        kb_w, kb_s, kb_x = kb0 + w_c // ROW_WARPS, kb0 + w_s // ROW_WARPS, kb0 + w_x // ROW_WARPS
        acc = gl.zeros([WARPS, BMW, BLOCK_T], gl.float32, MMA)
        # Buffer a holds step 0; b takes step 1 (past a one-step run the blocks clamp to its last one: a re-read).
        words_b, sc_b, x_b = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                        _step_blocks(kb_w, kb_s, kb_x, KW, kb_last), k_c * 8, k_s * 16, k_x, K, EVEN_K)
        for i in range(0, last - 2, 3):  # steps i .. i + 2, all before the last: every warp has a block
            words_c, sc_c, x_c = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, (i + 2) * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_a, sc_a, x_a, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            words_a, sc_a, x_a = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, (i + 3) * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_b, sc_b, x_b, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            words_b, sc_b, x_b = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, (i + 4) * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_c, sc_c, x_c, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
        # The loop decoded steps 0 .. j - 1 (j = 3 * its trip count, last - 2 <= j <= last when last >= 2, else 0);
        # a holds step j and b step j + 1.  Steps j .. last - 1 remain before the last: 0, 1 or 2 of them.
        rem = last - 3 * gl.cdiv(gl.maximum(last - 2, 0), 3)
        if rem == 2:
            words_c, sc_c, x_c = _load_step(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                            _step_blocks(kb_w, kb_s, kb_x, last * KW, kb_last),
                                            k_c * 8, k_s * 16, k_x, K, EVEN_K)
            acc = _step_mma(words_a, sc_a, x_a, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            acc = _step_mma(words_b, sc_b, x_b, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            words_a, sc_a, x_a = words_c, sc_c, x_c
        elif rem == 1:
            acc = _step_mma(words_a, sc_a, x_a, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
            words_a, sc_a, x_a = words_b, sc_b, x_b
        words_a = gl.where(kb_w + last * KW <= kb_last, words_a, 0)
        return acc, words_a, sc_a, x_a

    @gluon.jit
    def _run_last(words, sc, x, acc, DECODE: gl.constexpr, WARPS: gl.constexpr, ROW_WARPS: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, W4: gl.constexpr, A_OP: gl.constexpr,
                  B_OP: gl.constexpr, ACC_B: gl.constexpr, O2: gl.constexpr):
        """A run's last step, then the sum over the K warps: ``[BLOCK_M, BLOCK_T]`` fp32 in ``O2``."""
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        acc = _step_mma(words, sc, x, acc, DECODE, WARPS, BMW, BLOCK_T, W4, A_OP, B_OP)
        # [WARPS, BMW, T] -> [KW, BLOCK_M, T]: the sum over the K warps (through shared memory)
        y = gl.sum(gl.convert_layout(acc, ACC_B).reshape([KW, BLOCK_M, BLOCK_T]), axis=0)
        return gl.convert_layout(y, O2)

    @gluon.jit
    def _reduce_tile(y, tile, pid, group, ctas, total_blocks, NB, first_tile, slots_per_cta, part_ptr, part_offs,
                     cnt, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, O2: gl.constexpr):
        """``(done, y)``: whether this CTA finishes row tile ``tile`` and, if so, its whole sum.  The CTAs whose
        ranges cover the tile are those holding its first and its last block; each but one-CTA tiles writes its
        partial to its slot (CTA ``pid`` of ``group``: ``(group * ctas + pid) * slots_per_cta + (tile -
        first_tile)``), raises ``cnt``, and the last to arrive adds all partials in CTA order and resets ``cnt``."""
        p_first = ((tile * NB + 1) * ctas - 1) // total_blocks
        p_last = ((tile + 1) * NB * ctas - 1) // total_blocks
        done = p_first == p_last
        if p_first != p_last:
            slot = (group * ctas + pid) * slots_per_cta + (tile - first_tile)
            gl.store(part_ptr + slot.to(gl.int64) * (BLOCK_M * BLOCK_T) + part_offs, y)
            gl.barrier()  # every thread's partial is written before the release below
            arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            done = arrived == p_last - p_first
            if done:  # the last contributor: add all partials in CTA order
                y = gl.zeros([BLOCK_M, BLOCK_T], gl.float32, O2)
                for p in range(p_first, p_last + 1):
                    p_first_tile = p * total_blocks // ctas // NB
                    p_slot = (group * ctas + p) * slots_per_cta + (tile - p_first_tile)
                    y += gl.load(part_ptr + p_slot.to(gl.int64) * (BLOCK_M * BLOCK_T) + part_offs,
                                 cache_modifier=".cg")
                gl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
        return done, y

    @gluon.jit
    def _lane_offsets(WARPS: gl.constexpr, BMW: gl.constexpr, ROW_WARPS: gl.constexpr, BLOCK_T: gl.constexpr,
                      X_K: gl.constexpr, CL: gl.constexpr, S3: gl.constexpr, XL: gl.constexpr):
        """A step's per-lane index tensors, each in the layout of its load (codes ``CL``, scales ``S3``, activations
        ``XL``): the warp (``w_*``, ``[W, 1, 1]``), the code word / scale byte / activation inside a 128-k block
        (``k_*``, ``[1, 1, n]``; ``X_K`` activations per block in ``XL``), the row inside the row tile (``row_c``,
        ``row_s``: warp w takes rows ``(w % ROW_WARPS) * BMW ..``) and the token inside the token tile (``n_x``,
        ``[1, BLOCK_T, 1]``).  Returns ``(w_c, k_c, row_c, w_s, k_s, row_s, w_x, n_x, k_x)``."""
        w_c = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))[:, None, None]
        m_c = gl.arange(0, BMW, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))[None, :, None]
        k_c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))[None, None, :]
        w_s = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, S3)))[:, None, None]
        m_s = gl.arange(0, BMW, layout=gl.SliceLayout(0, gl.SliceLayout(2, S3)))[None, :, None]
        k_s = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, S3)))[None, None, :]
        w_x = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))[:, None, None]
        n_x = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))[None, :, None]
        k_x = gl.arange(0, X_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))[None, None, :]
        return (w_c, k_c, (w_c % ROW_WARPS) * BMW + m_c, w_s, k_s, (w_s % ROW_WARPS) * BMW + m_s, w_x, n_x, k_x)

    @gluon.jit
    def _token_tile(x_ptr, pid_t, T, stride_xt, n_x, k_x, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr,
                    O2: gl.constexpr):
        """Token tile ``pid_t``: the activations' base and per-lane offsets (from :func:`_lane_offsets`' ``n_x`` and
        ``k_x``; tokens past T re-read token T - 1, an L1 hit, and their output columns are not stored), and its
        output tile in ``O2``: ``(x_base, x_offs, rows_o, toks_o, part_offs)``."""
        x_base = x_ptr + (pid_t * BLOCK_T).to(gl.int64) * stride_xt
        x_offs = (gl.minimum(pid_t * BLOCK_T + n_x, T - 1) - pid_t * BLOCK_T) * stride_xt + k_x
        rows_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O2))
        toks_o = pid_t * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, O2))
        return x_base, x_offs, rows_o, toks_o, _slot_offsets(rows_o, BLOCK_T, O2)

    @gluon.jit
    def _slot_offsets(rows_o, BLOCK_T: gl.constexpr, O2: gl.constexpr):
        """Each element's offset in a row-major ``[BLOCK_M, BLOCK_T]`` partial-sum slot (``rows_o``: the tile's rows,
        ``arange(BLOCK_M)`` in ``SliceLayout(1, O2)``)."""
        return rows_o[:, None] * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, O2))[None, :]

    @gluon.jit
    def _cta_blocks(pid, ctas, total_blocks, NB):
        """CTA ``pid``'s stream-K range ``[b_begin, b_end)`` of the ``total_blocks`` (row tile, 128-k block) pairs
        split over ``ctas`` CTAs, and the row tile it starts in: ``(b_begin, b_end, first_tile)``."""
        b_begin = pid * total_blocks // ctas
        b_end = (pid + 1) * total_blocks // ctas
        return b_begin, b_end, b_begin // NB

    @gluon.jit
    def _stream_kernel(
        x_ptr, w_ptr, ws_ptr, wdec_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
        T, N, K, stride_xt, stride_ww, stride_wsn, stride_ot, total_blocks, slots_per_cta,
        HAS_BIAS: gl.constexpr, DECODE: gl.constexpr, EVEN_K: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, WARPS: gl.constexpr, ROW_WARPS: gl.constexpr,
        OVERLAP_RUNS: gl.constexpr, PREFETCH: gl.constexpr = 1,
    ):
        # Warp w = kw * ROW_WARPS + rw takes rows [rw * BMW, (rw + 1) * BMW) of the row tile and block kw of
        # each step (the ROW_WARPS warps of one kw read the same activations: the second read is an L1 hit).
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
        # Codes [W, BMW, 16 words]: lane 4g + t holds rows g + 8i, words [4t, 4t + 4) (one 16-byte load per row).
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        W4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        S3: gl.constexpr = gl.SliceLayout(3, W4)  # scales [W, BMW, 8]: 2 bytes per lane and row
        # Activations [W, BLOCK_T, 128]: lane 4g + t holds token g (+8) at k [32t, 32t + 32).
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        O2: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, WARPS], [0, 1])  # rows fastest: coalesced
        ACC_B: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 16, 2], [WARPS, 1, 1], [1, 2, 0])
        NB = gl.cdiv(K, 128)

        pid = gl.program_id(0)
        pid_t = gl.program_id(1)
        ctas = gl.num_programs(0)
        tiles_m = gl.cdiv(N, BLOCK_M)

        # ---- per-lane offsets: rows inside the row tile, words / scales / activations inside a block
        w_c, k_c, row_c, w_s, k_s, row_s, w_x, n_x, k_x = _lane_offsets(WARPS, BMW, ROW_WARPS, BLOCK_T, 128, CL, S3,
                                                                         XL)
        x_base, x_offs, rows_o, toks_o, part_offs = _token_tile(x_ptr, pid_t, T, stride_xt, n_x, k_x, BLOCK_M, BLOCK_T,
                                                                O2)

        # ---- this CTA's range of (row tile, block) pairs: runs of consecutive blocks, one per row tile
        # (total_blocks * ctas < 2^31: stream_grid checks it, so the range arithmetic stays 32-bit)
        b_begin, b_end, first_tile = _cta_blocks(pid, ctas, total_blocks, NB)
        if not OVERLAP_RUNS:
            b = b_begin
            while b < b_end:
                tile, run_end, kb0, kb_last, last = _run_span(b, b_end, NB, KW)
                w_base, w_offs, s_base, s_offs = _row_tile(tile, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, N, stride_ww,
                                                           stride_wsn, BLOCK_M)
                y = _run_product(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, last, w_c, w_s, w_x,
                                 k_c, k_s, k_x, K, EVEN_K, DECODE, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, MMA, W4, A_OP,
                                 B_OP, ACC_B, O2, False, PREFETCH)
                _end_tile(y, tile, pid, pid_t, ctas, total_blocks, NB, first_tile, slots_per_cta, part_ptr, part_offs,
                          cnt_ptr + pid_t * tiles_m + tile, rows_o, toks_o, wdec_ptr, bias_ptr, out_ptr, stride_ot, T,
                          N, HAS_BIAS, DECODE, BLOCK_M, BLOCK_T, O2)
                b = run_end
        elif b_begin < b_end:
            # The same runs, each run's first step loaded before the previous run's last step and its reduction
            # (the MoE kernel's overlapped runs; the run after the CTA's last loads that run's last block again).
            words, sc, xv = _first_step_at(b_begin, b_end, NB, w_ptr, ws_ptr, row_c, row_s, w_c, w_s, w_x, k_c, k_s,
                                           k_x, x_base, x_offs, N, K, stride_ww, stride_wsn, EVEN_K, BLOCK_M,
                                           ROW_WARPS, KW)
            b = b_begin
            while b < b_end:
                tile, run_end, kb0, kb_last, last = _run_span(b, b_end, NB, KW)
                w_base, w_offs, s_base, s_offs = _row_tile(tile, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, N, stride_ww,
                                                           stride_wsn, BLOCK_M)
                acc, words, sc, xv = _run_steps(words, sc, xv, w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0,
                                                kb_last, last, w_c, w_s, w_x, k_c, k_s, k_x, K, EVEN_K, DECODE,
                                                WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, MMA, W4, A_OP, B_OP)
                n_words, n_sc, n_xv = _first_step_at(gl.minimum(run_end, b_end - 1), b_end, NB, w_ptr, ws_ptr, row_c,
                                                     row_s, w_c, w_s, w_x, k_c, k_s, k_x, x_base, x_offs, N, K,
                                                     stride_ww, stride_wsn, EVEN_K, BLOCK_M, ROW_WARPS, KW)
                y = _run_last(words, sc, xv, acc, DECODE, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, W4, A_OP, B_OP, ACC_B,
                              O2)
                _end_tile(y, tile, pid, pid_t, ctas, total_blocks, NB, first_tile, slots_per_cta, part_ptr, part_offs,
                          cnt_ptr + pid_t * tiles_m + tile, rows_o, toks_o, wdec_ptr, bias_ptr, out_ptr, stride_ot, T,
                          N, HAS_BIAS, DECODE, BLOCK_M, BLOCK_T, O2)
                words, sc, xv = n_words, n_sc, n_xv
                b = run_end

    @gluon.jit
    def _first_step_at(b, b_end, NB, w_ptr, ws_ptr, row_c, row_s, w_c, w_s, w_x, k_c, k_s, k_x, x_base, x_offs, N, K,
                       stride_ww, stride_wsn, EVEN_K: gl.constexpr, BLOCK_M: gl.constexpr, ROW_WARPS: gl.constexpr,
                       KW: gl.constexpr):
        """The loads of the first step of the run that starts at block ``b``."""
        tile, run_end, kb0, kb_last, last = _run_span(b, b_end, NB, KW)
        w_base, w_offs, s_base, s_offs = _row_tile(tile, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, N, stride_ww,
                                                   stride_wsn, BLOCK_M)
        return _run_first(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, w_c, w_s, w_x, k_c, k_s, k_x,
                          K, EVEN_K, ROW_WARPS)

    @gluon.jit
    def _row_tile(tile, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, N, stride_ww, stride_wsn, BLOCK_M: gl.constexpr):
        """Row tile ``tile``'s code and scale bases and per-lane offsets.  Rows past N re-read row N - 1 (no masks
        on the weight stream); only the store is masked."""
        row0 = tile * BLOCK_M
        return (w_ptr + row0.to(gl.int64) * stride_ww, (gl.minimum(row0 + row_c, N - 1) - row0) * stride_ww + k_c,
                ws_ptr + row0.to(gl.int64) * stride_wsn, (gl.minimum(row0 + row_s, N - 1) - row0) * stride_wsn + k_s)

    @gluon.jit
    def _end_tile(y, tile, pid, pid_t, ctas, total_blocks, NB, first_tile, slots_per_cta, part_ptr, part_offs, cnt,
                  rows_o, toks_o, wdec_ptr, bias_ptr, out_ptr, stride_ot, T, N, HAS_BIAS: gl.constexpr,
                  DECODE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, O2: gl.constexpr):
        """A run's products into the shared tile's sum; the CTA that completes it applies the epilogue."""
        rows = tile * BLOCK_M + rows_o
        row_ok = rows < N
        done, y = _reduce_tile(y, tile, pid, pid_t, ctas, total_blocks, NB, first_tile, slots_per_cta, part_ptr,
                               part_offs, cnt, BLOCK_M, BLOCK_T, O2)
        if done:
            if DECODE == 2:
                y = y * _EPILOGUE_SHIFT
            y = y * gl.load(wdec_ptr + rows, mask=row_ok, other=0.0)[:, None]
            if HAS_BIAS:
                y += gl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)[:, None]
            out_ptrs = out_ptr + toks_o[None, :].to(gl.int64) * stride_ot + rows[:, None]
            gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (toks_o[None, :] < T))


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------
def gemv_stream(x, w_codes, w_scales, w_dec_rows, *, tile: StreamTile, ctas: int, bias=None,
                decode: int | None = None, workspace: StreamWorkspace | None = None, out=None):
    """``(x @ W^T) * w_dec_rows (+ bias)`` with the streaming tensor-core kernel; any T (in tiles of block_t).

    ``ctas``: CTAs per token tile (the caller picks a multiple of the SM count; clamped to the number of
    128-k blocks).  ``workspace``: a :class:`StreamWorkspace` for this grid (``StreamWorkspace.for_grid``), kept
    by the caller across calls; without one, a fresh zeroed one is allocated (a memset per call).
    """
    from ..format.checks import check_tensor
    from .common import check_linear_inputs, trivial_linear_output

    require_gluon("gemv_stream")
    t, n, k, w_scales, out = check_linear_inputs("gemv_stream", x, w_codes, w_scales, w_dec_rows, bias, out)
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype)
    if w_codes.stride(0) % 4:
        raise ValueError(f"w_codes: the row stride ({w_codes.stride(0)} bytes) must be a multiple of 4 (read as words)")
    if (done := trivial_linear_output(out, k, w_dec_rows, bias)) is not None:
        return done
    decode = default_stream_decode(x.device, x.dtype) if decode is None else decode
    check_stream_decode(decode)
    grid = stream_grid(t, n, k, tile, ctas)
    if workspace is None:
        workspace = StreamWorkspace.for_grid(grid, tile, x.device)
    workspace.check(grid, tile, x.device)
    _stream_kernel[(grid.ctas, grid.tiles_t)](
        x, w_codes.view(torch.int32), w_scales.view(torch.uint8), w_dec_rows, bias if bias is not None else out, out,
        workspace.partials, workspace.counters,
        t, n, k, x.stride(0), w_codes.stride(0) // 4, w_scales.stride(0), out.stride(0),
        grid.total_blocks, grid.slots_per_cta,
        HAS_BIAS=bias is not None, DECODE=decode, EVEN_K=k % K_BLOCK == 0,
        **tile.constexprs, **tile.launch_options,
    )
    return out


def prepare_gemv_stream(t: int, n: int, k: int, device, dtype, *, tile: StreamTile, ctas: int, has_bias: bool,
                        decode: int | None = None):
    """A ready launch of :func:`gemv_stream` for ``x [t, k]`` of ``dtype`` on ``device`` and an ``[n, k]`` weight:
    grid, workspace sizes and compile-time arguments fixed here, once.  The returned
    ``run(x, w_codes, w_scales_u8, w_dec_rows, bias, out) -> out`` checks nothing: its inputs are those
    :func:`gemv_stream` accepts, with ``t, n, k > 0`` (the callers' trivial cases are theirs).  The partial sums
    are a fresh buffer per call (every slot read is written first in the same launch); the counters are
    :class:`StreamCounters`."""
    from .launch import ReadyKernel

    decode = default_stream_decode(torch.device(device), dtype) if decode is None else decode
    check_stream_decode(decode)
    grid = stream_grid(t, n, k, tile, ctas)
    partials = grid.partials_numel(tile)
    counters = StreamCounters(grid.counters_numel, device)
    launch = ReadyKernel(
        _stream_kernel, (grid.ctas, grid.tiles_t), total_blocks=grid.total_blocks, slots_per_cta=grid.slots_per_cta,
        HAS_BIAS=has_bias, DECODE=decode, EVEN_K=k % K_BLOCK == 0, **tile.constexprs, **tile.launch_options)

    def run(x, w_codes, w_scales_u8, w_dec_rows, bias, out):
        part = torch.empty(partials, dtype=torch.float32, device=device)
        launch(x, w_codes.view(torch.int32), w_scales_u8, w_dec_rows, out if bias is None else bias, out, part,
               counters.get(), t, n, k, x.stride(0), w_codes.stride(0) // 4, w_scales_u8.stride(0), out.stride(0))
        return out

    run.counters = counters  # for tests and diagnostics
    return run


def check_stream_decode(decode: int) -> None:
    """A launcher's ``decode``: a real decode (:data:`DECODE_NAMES`) or a timing probe (:data:`PROBE_DECODE_NAMES`)."""
    if decode not in DECODE_NAMES and decode not in PROBE_DECODE_NAMES:
        raise ValueError(f"decode: expected one of {sorted(DECODE_NAMES | PROBE_DECODE_NAMES)}, got {decode}")


def default_stream_decode(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """The native cvt where gluon_gemv would use it (sm_100+ with a PTX ISA that has it), else the shift decode."""
    return DECODE_CVT if default_decode(device, dtype) == DECODE_CVT else DECODE_SHIFT
