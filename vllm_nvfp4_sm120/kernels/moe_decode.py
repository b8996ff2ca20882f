"""Align-free small-batch NVFP4 MoE (decode): the routing tensors go straight into the GEMM kernels.

At decode sizes the MoE layer is the read of the routed experts' weights.  The prefill structure (align/sort pass,
``BLOCK_M >= 16`` row blocks per expert) spends most of that time elsewhere, so these kernels take ``topk_ids``
``[T, top_k]`` (flattened: route ``r = token * top_k + slot``) and the optional ``expert_map`` directly.  Every
buffer is sized from shapes and nothing reads a device value on the host: CUDA-graph capturable.

Kernels (weight-only numerics, as ``format.moe_ref(..., a13_gs=None, a2_gs=None)``; W4A16 and W4A4 banks alike):

* ``_moe_decode_gate_up_kernel`` — expert-major with in-kernel dedupe.  Grid ``(rows, cdiv(I, BLOCK_N))`` where a
  *row* is a route slot (``rows = T * top_k``) or, when there are more slots than local experts, a local expert
  (``rows = E``): the smaller grid.  The program of slot ``s`` works only if ``s`` is the first slot routed to its
  expert ``e``; that program (or the program of expert ``e``) gathers every route of ``e`` (a running count over
  the match mask, ``BLOCK_T`` routes per chunk) and computes their gate and up columns ``j * BLOCK_N ..`` together: the
  gate rows and the up rows of those columns are one stacked ``[2 * BLOCK_N, K]`` weight tile, so each touched
  expert's w13 bytes are read from DRAM once per call however many tokens share it.  Epilogue
  ``act(gate * dec) * (up * dec)`` in fp32 → the intermediate ``[T * top_k, I]`` in ``x.dtype``, one row per
  route (rows of routes no local expert takes are left unwritten; nobody reads them).  Its programs can also zero
  the fp32 workspace the atomic down kernel adds into (they run first).  ``split_k`` tiles split each program's K
  loop over that many programs (more decode warps in flight at small T): each stores its fp32 partial sums in its
  own slice, and the last to arrive (an acq_rel count, zeroed by the launcher) sums the slices in split order and
  applies the epilogue, so the result is still bit-identical run to run.
* ``_moe_decode_down_token_kernel`` — token-major: grid ``(T, cdiv(H, BLOCK_N))``; one program loops over its
  token's ``top_k`` slots and K tiles in one flattened, pipelined loop, multiplies each partial product by
  ``w2_dec[e] * topk_weight`` and sums in fp32 in slot order, then stores ``x.dtype``.  No atomics, no zeroing,
  bit-identical across runs; re-reads the w2 rows of an expert shared by several tokens (from L2 when the
  tokens' programs run together).
* ``_moe_decode_down_expert_kernel`` — expert-major with the gate_up dedupe: each w2 block read once per call.
  Atomic mode: the routing-weighted rows are fp32-atomically added into a ``[T, H]`` workspace (zeroed by the
  gate_up kernel's programs) and counted per (token, H tile); the program whose add completes a tile (the last of
  the token's local experts) casts it into the output, so the layer is still two launches.  ``split_k`` tiles
  (atomic mode) split each program's K over that many programs, grid ``(rows, cdiv(H, BLOCK_N), split_k)``: the
  splits add into the same sums, and the count waits for ``split_k`` arrivals per local expert.  Deterministic mode:
  one fp32 row per route into ``[T * top_k, H]``, summed in slot order by ``_moe_decode_sum_kernel``.

Inner product (``USE_DOT`` constexpr): tensor cores with the weight rows on the MMA's M side and the routes of a
chunk on N (``tl.dot``, ``BLOCK_T >= 16``; M = ``16 * num_warps`` rows per program avoids Triton replicating the
weight operand across warps), or CUDA-core fp32 FMAs for one or two routes per chunk.  Either way every weight
element is decoded once per program and K tile, e2m1 x e4m3 products are exact in bf16/fp16, and sums are fp32:
exact up to summation order.

Decode (``FAST_DECODE`` constexpr): an inline-PTX lop3/prmt table (fp4_decode's, sm_80+) extended by the block
scale multiply on the packed pairs (``mul.rn.{bf16,f16}x2``, sm_90+), so one code byte becomes one 32-bit register
holding its two scaled 16-bit weights, the register an MMA operand pair is; without it, the pure-``tl`` decode of
fp4_decode (interpreter, any GPU).  The block scales become packed pairs by the hardware e4m3 convert.
Where the GPU converts e2m1 itself (sm_100+, sm_120: ``cvt.rn.{bf16,f16}x2.e2m1x2``, one instruction per code byte;
:data:`DECODE_CVT`), that convert replaces the table and the shift decode on every tile: 4 instructions per code word
before the scale multiply instead of the shift decode's 13 integer ones, in memory order (no relabelling).

Shift decode (``shift_decode`` tiles, tensor cores only): the 3 magnitude bits of a code placed at the low end of
a 16-bit float's exponent are its value times a power of two (fp4_decode's shift bodies: 13 integer instructions per
code word for bf16 instead of the table's 22, on the H200's half-rate integer pipe).  Register j of a word then
holds its elements j and j + 4, so the MMA's k order inside each 8 elements is relabelled and the activations are
permuted the same way in registers (their shared-memory tile stays in memory order); the power of two is taken out
by the scale pair (2^119 for bf16, 2^7 for fp16: exact) and the accumulator (2^7).  The word must be a memory
word, which holds only where the code rows are 16-byte aligned (:func:`shift_ok`; elsewhere the table decode runs).

Launch overlap (``pdl`` tiles of the down kernels, sm_90+): the gate_up kernel signals its dependents when it
starts; a down kernel launched as a programmatic dependent computes its routing and prefetches its weight rows into
L2 while the gate_up kernel finishes, and waits for it before reading the intermediate or writing anything.  At
T = 1 the two dependent launches and the first DRAM latency are a real part of the layer's time.

Routing ids out of range (``< 0`` or ``>= E``, or ``>= len(expert_map)`` with a map) cannot be checked on the device
without a host sync: the kernels treat them as another rank's expert (the route contributes nothing), exactly as
``-1`` in ``expert_map``.  :func:`.moe_decode_checks.check_topk_ids` is the synchronizing check (the launchers run
it on CPU tensors, and on the GPU when asked with ``check_ids=True``).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import triton
import triton.language as tl

from .common import register_cap_option
from .moe_decode_checks import MAX_ROUTES, _check_bank, check_down_inputs, check_gate_up_inputs
from .fp4_decode import SHIFT_BF16_BODY, SHIFT_EXP, SHIFT_F16_BODY, SHIFT_SCALE, dequant_rows_16bit
from .moe_common import gated_activation_f32, local_expert

# The kernels' ``FAST_DECODE`` constexpr: which e2m1 decode runs (the launchers pick it from the GPU; every kind gives
# the same bits).  A bool still works: False is the pure-``tl`` decode, True the inline-PTX table / shift decode.
DECODE_TL = 0  # pure ``tl`` arithmetic (the interpreter, GPUs before sm_90)
DECODE_PTX = 1  # the lop3/prmt table, or the shift decode on ``shift_decode`` tiles (sm_90+)
DECODE_CVT = 2  # the native ``cvt.rn.{bf16,f16}x2.e2m1x2`` (sm_100+ / sm_120 where the PTX ISA has it)
_PTX = tl.constexpr(DECODE_PTX)
_CVT = tl.constexpr(DECODE_CVT)

# That vector's width, in a few buckets (one compile each) rather than next_power_of_2(T * top_k) per batch size.
_ROUTE_BLOCKS = (64, 256, MAX_ROUTES)
# Vector width of the accumulator zeroing loop and of the sum kernel.
_ZERO_BLOCK = tl.constexpr(1024)
_SUM_BLOCK_H = 1024


@dataclass(frozen=True)
class DecodeTile:
    """One kernel's tile and switches; every field is explicit (the dispatch chooses, this layer only runs).

    ``block_n``: gate_up: intermediate columns per program (its weight tile holds the ``block_n`` gate rows and the
    ``block_n`` up rows of those columns); down: output rows (of H) per program.  ``block_k``: K per pipelined loop
    step.  ``block_t``: routes per chunk: the MMA's N (>= 16) with ``use_dot``, 1 or 2 on CUDA cores; the
    token-major down kernel has one route per step and pads it to ``block_t``.  ``use_tma``: weight codes and scales
    through TMA descriptors (sm_90+; the bank's K must be a multiple of 256 and ``block_k`` >= 256, see
    :func:`tma_ok`) instead of pointer loads.  ``evict_first``: pointer weight loads with the evict-first L2 policy
    (every weight byte is read once per call).  ``pdl`` (down kernels, GPU): launched as a programmatic dependent of
    the gate_up kernel (which signals at its start), a program computes its routing and prefetches its weight rows
    into L2 while the gate_up kernel finishes, then waits for it (``griddepcontrol.wait``) before touching anything it
    wrote or anything later kernels read.  ``split_k``: the K loop of each program split over ``split_k`` programs
    (more programs, hence more decode warps in flight, when T is small): gate_up, fp32 partial sums summed in split
    order by the last one; the expert-major down in atomic mode, each split's products added into the token's fp32
    sums like another expert's (the arrival count waits for every split).  ``k_warps`` (tensor cores): the K step
    split into that many slices, one warp each over all the program's rows (a batched ``tl.dot`` ``[k_warps, rows,
    block_k / k_warps]``), the slices' fp32 sums added after the K loop: ``k_warps`` times the warps per weight byte
    in flight without another program, partial sums in memory or an arrival count (``num_warps`` must equal it:
    Triton puts every warp of a batched MMA on the batch dimension).  ``prefetch_down`` (gate_up, GPU): each program
    first asks L2 for its share of its expert's down rows (codes and scales; the expert's rows split over the
    programs of its grid row), so the down kernel finds its weights in L2: the decode loop leaves DRAM bandwidth
    unused, and the down's reads could move into the gate_up kernel's time.  It needs the down bank at launch.  On an
    H100 every layer was slower with it (docs/benchmarks.md, device run 57): a sweep candidate, in no table row.
    """

    block_n: int
    block_k: int
    block_t: int
    num_warps: int
    num_stages: int
    use_dot: bool
    use_tma: bool = False
    evict_first: bool = False
    pdl: bool = False
    split_k: int = 1  # gate_up and the atomic expert-major down: K splits, each its own program
    shift_decode: bool = False  # the shift decode (tensor cores; see the module docstring)
    k_warps: int = 1  # warps over K within the program (tensor cores; see above)
    prefetch_down: bool = False  # gate_up: L2 prefetch of the expert's down rows (see above)
    # Registers per thread the compiler may use (the launch option ``maxnreg``; None: its own choice): more
    # programs per SM where registers, not the grid or shared memory, bound them (the compile tests check that a
    # capped tile does not spill).
    max_regs: int | None = None

    def __post_init__(self):
        register_cap_option("DecodeTile", self.max_regs)
        for name in ("block_n", "block_k", "block_t", "num_warps", "k_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"DecodeTile.{name}: expected a power of two, got {v}")
        if not 1 <= self.split_k <= 8:  # any count: the K tiles of a 3- or 6-step bank split evenly
            raise ValueError(f"DecodeTile.split_k: expected 1..8, got {self.split_k}")
        if self.block_k < 32:
            raise ValueError(f"DecodeTile.block_k: expected >= 32 (two 16-element scale groups), got {self.block_k}")
        if self.use_dot and self.block_t < 16:
            raise ValueError(f"DecodeTile.block_t: tl.dot needs N >= 16, got {self.block_t}")
        if self.use_tma and not 256 <= self.block_k <= 512:
            raise ValueError(f"DecodeTile.block_k: a TMA box of scales needs >= 16 bytes and of codes <= 256: "
                             f"256 <= block_k <= 512, got {self.block_k}")
        if self.num_stages < 1:
            raise ValueError(f"DecodeTile.num_stages: expected >= 1, got {self.num_stages}")
        if self.shift_decode and not self.use_dot:
            raise ValueError("DecodeTile.shift_decode: needs use_dot (the relabelled k order is the MMA's)")
        if self.k_warps > 1:
            if not self.use_dot:
                raise ValueError("DecodeTile.k_warps: needs use_dot (the slices are a batched MMA)")
            if self.num_warps != self.k_warps:
                raise ValueError(f"DecodeTile.k_warps: num_warps must equal k_warps (one warp per K slice), got "
                                 f"num_warps {self.num_warps}, k_warps {self.k_warps}")
            if self.block_k // self.k_warps < 32:
                raise ValueError(f"DecodeTile.k_warps: each K slice needs >= 32 elements (two scale groups), got "
                                 f"block_k {self.block_k} / k_warps {self.k_warps}")

    def check_rows(self, rows: int, kernel: str) -> None:
        """The weight rows of one program (gate_up: ``2 * block_n``): tl.dot needs M >= 16; the shift decode needs
        the mma_v2 operand layout, in which a thread's 4 consecutive code bytes are one memory word.  Triton makes
        a dot of a multiple of 64 rows over a multiple of 4 warps a wgmma on sm_90, whose register operand is laid
        out otherwise: wrong sums (H200 run 43: errors of the output's size), so such tiles are refused."""
        if self.use_dot and rows < 16:
            raise ValueError(f"tile: {kernel} with use_dot needs >= 16 weight rows per program, got {rows} "
                             f"(block_n {self.block_n})")
        if self.shift_decode and self.k_warps == 1 and self.num_warps % 4 == 0 and rows % 64 == 0:
            raise ValueError(f"tile: {kernel} with shift_decode needs mma_v2 operands; {rows} weight rows over "
                             f"{self.num_warps} warps become a wgmma on sm_90 (use fewer warps or the table decode)")

    def kernel_kwargs(self) -> dict:
        return dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, BLOCK_T=self.block_t, USE_DOT=self.use_dot,
                    USE_TMA=self.use_tma, EVICT_FIRST=self.evict_first, NUM_STAGES=self.num_stages,
                    SHIFT_DECODE=self.shift_decode, K_WARPS=self.k_warps)

    def launch_kwargs(self, pdl_ok: bool = False) -> dict:
        """``num_warps``, ``num_stages``, ``maxnreg`` where capped and, for a ``pdl`` tile where the device has it,
        ``launch_pdl``."""
        kw = dict(num_warps=self.num_warps, num_stages=self.num_stages,
                  **register_cap_option("DecodeTile", self.max_regs))
        if self.pdl and pdl_ok:
            kw["launch_pdl"] = True
        return kw


def tma_ok(k: int) -> bool:
    """Whether a bank with reduction size ``K`` can be read through TMA: the scale rows (K/16 bytes) must be a
    multiple of 16 bytes."""
    return k % 256 == 0


# ---------------------------------------------------------------------------------------------------------------
# Compile-harness signatures (bf16 activations, int32 ids; ``tma_signature`` for the descriptor variant).
# Divisible: pointers and what is a multiple of 16 on checkpoint shapes (H, I multiples of 256); the route, token
# and expert counts are not.
# ---------------------------------------------------------------------------------------------------------------
_TILE_CONSTEXPRS = {k: "constexpr" for k in ("BLOCK_N", "BLOCK_K", "BLOCK_T", "USE_DOT", "USE_TMA", "EVICT_FIRST",
                                             "NUM_STAGES", "SHIFT_DECODE", "K_WARPS")}
_BANK = {"w_ptr": "*u8", "w_sf_ptr": "*u8", "w_desc": "*u8", "s_desc": "*u8", "w_dec_ptr": "*fp32",
         "ids_ptr": "*i32", "map_ptr": "*i32"}
_DOWN_INTS = {k: "i32" for k in ("S", "H", "K", "E", "GLOBAL_E", "top_k", "stride_am", "stride_we", "stride_wn",
                                 "stride_wse", "stride_wsn", "stride_om")}
MOE_DECODE_GATE_UP_SIGNATURE = {
    "x_ptr": "*bf16", **_BANK, "out_ptr": "*bf16", "zero_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32",
    "w2_ptr": "*u8", "w2_sf_ptr": "*u8",
    **{k: "i32" for k in ("S", "I", "K", "E", "GLOBAL_E", "top_k", "zero_numel", "zero_chunk", "stride_xt",
                          "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om", "stride_w2e",
                          "stride_w2n", "stride_w2se", "stride_w2sn")},
    "ACTIVATION": "constexpr", "HAS_MAP": "constexpr", "BY_EXPERT": "constexpr", "ZERO": "constexpr",
    "S_BLOCK": "constexpr", "FAST_DECODE": "constexpr", "EVEN_K": "constexpr", "GDC": "constexpr",
    "SPLIT_K": "constexpr", **_TILE_CONSTEXPRS, "PREFETCH_DOWN": "constexpr", "PF_ROWS": "constexpr",
}
MOE_DECODE_DOWN_TOKEN_SIGNATURE = {
    "a_ptr": "*bf16", **_BANK, "tw_ptr": "*fp32", "out_ptr": "*bf16", **_DOWN_INTS,
    "HAS_MAP": "constexpr", "TOPK_BLOCK": "constexpr", "FAST_DECODE": "constexpr", "EVEN_K": "constexpr",
    "PDL": "constexpr", **_TILE_CONSTEXPRS,
}
MOE_DECODE_DOWN_EXPERT_SIGNATURE = {
    "a_ptr": "*bf16", **_BANK, "tw_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*bf16",
    **_DOWN_INTS,
    "HAS_MAP": "constexpr", "BY_EXPERT": "constexpr", "DETERMINISTIC": "constexpr", "S_BLOCK": "constexpr",
    "TOPK_BLOCK": "constexpr", "FAST_DECODE": "constexpr", "EVEN_K": "constexpr", "PDL": "constexpr",
    "SPLIT_K": "constexpr", **_TILE_CONSTEXPRS,
}
MOE_DECODE_SUM_SIGNATURE = {
    "src_ptr": "*fp32", "ids_ptr": "*i32", "map_ptr": "*i32", "dst_ptr": "*bf16",
    "H": "i32", "S": "i32", "E": "i32", "GLOBAL_E": "i32", "top_k": "i32", "stride_dst": "i32",
    "HAS_MAP": "constexpr", "BLOCK_H": "constexpr",
}
_DIV_INTS = ("I", "K", "H", "stride_xt", "stride_am", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
             "stride_om", "stride_dst")


def _divisible(signature: dict) -> list[str]:
    return [k for k, v in signature.items() if v.startswith("*")] + [k for k in _DIV_INTS if k in signature]


MOE_DECODE_GATE_UP_DIVISIBLE = _divisible(MOE_DECODE_GATE_UP_SIGNATURE)
MOE_DECODE_DOWN_TOKEN_DIVISIBLE = _divisible(MOE_DECODE_DOWN_TOKEN_SIGNATURE)
MOE_DECODE_DOWN_EXPERT_DIVISIBLE = _divisible(MOE_DECODE_DOWN_EXPERT_SIGNATURE)
MOE_DECODE_SUM_DIVISIBLE = _divisible(MOE_DECODE_SUM_SIGNATURE)


def tma_signature(signature: dict, divisible: list[str], parts: int, block_n: int, block_k: int):
    """``(signature, divisible)`` with ``w_desc`` / ``s_desc`` the 3-D descriptors the launcher passes for
    ``use_tma`` (boxes ``[parts, block_n, block_k/2]`` and ``[parts, block_n, block_k/16]``; parts = 2 for gate_up)."""
    sig = signature | {"w_desc": f"tensordesc<u8[{parts},{block_n},{block_k // 2}]>",
                       "s_desc": f"tensordesc<u8[{parts},{block_n},{block_k // 16}]>"}
    return sig, [d for d in divisible if d not in ("w_desc", "s_desc")]


# ---------------------------------------------------------------------------------------------------------------
# Decode: code bytes + e4m3 block scales → scaled 16-bit weights
# ---------------------------------------------------------------------------------------------------------------
# fp4_decode's bf16 / fp16 tables (4 code bytes in $4 → 4 pairs), then pair i times the block scale pair $5+i
# (both halves = byte i's scale).  The op is bytewise: which 4 bytes of a thread Triton packs into one instance
# depends on the layout (on sm_90's wgmma operand they are 4 bytes apart), so no two need share a scale.  A prmt
# takes one immediate: each table's first word is an operand ($9, $13, $17; see _thread_constant).  Triton passes
# one register per 32-bit element of an argument, so $10..$12, $14..$16, $18..$20 repeat them.
_SCALED_BF16X2_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 a<17>;\n"
    "and.b32 a0, $4, 0x88888888;\n"
    "shr.u32 a1, a0, 3;\n"
    "and.b32 a2, $4, 0x77777777;\n"
    "shr.u32 a3, a2, 16;\n"
    "shr.u32 a4, a0, 19;\n"
    "prmt.b32 a5, $9, 0xC0804000, a2;\n"  # low bytes of bf16(|v|): table C0800000 C0804000
    "prmt.b32 a6, $9, 0xC0804000, a3;\n"
    "prmt.b32 a7, $13, 0x40404040, a2;\n"  # high bytes: table 3F3F3F00 40404040
    "prmt.b32 a8, $13, 0x40404040, a3;\n"
    "prmt.b32 a9, $17, 0, a1;\n"  # sign bytes: 0x80 where set
    "prmt.b32 a10, $17, 0, a4;\n"
    "or.b32 a11, a7, a9;\n"
    "or.b32 a12, a8, a10;\n"
    "prmt.b32 a13, a5, a11, 0x5140;\n"
    "prmt.b32 a14, a5, a11, 0x7362;\n"
    "prmt.b32 a15, a6, a12, 0x5140;\n"
    "prmt.b32 a16, a6, a12, 0x7362;\n"
    "mul.rn.bf16x2 $0, a13, $5;\n"
    "mul.rn.bf16x2 $1, a14, $6;\n"
    "mul.rn.bf16x2 $2, a15, $7;\n"
    "mul.rn.bf16x2 $3, a16, $8;\n"
    "}"
)
_SCALED_F16X2_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 a<13>;\n"
    "and.b32 a0, $4, 0x88888888;\n"
    "shr.u32 a1, a0, 3;\n"
    "and.b32 a2, $4, 0x77777777;\n"
    "shr.u32 a3, a2, 16;\n"
    "shr.u32 a4, a0, 19;\n"
    "prmt.b32 a5, $9, 0x46444240, a2;\n"  # high bytes of fp16(|v|): table 3E3C3800 46444240
    "prmt.b32 a6, $9, 0x46444240, a3;\n"
    "prmt.b32 a7, $17, 0, a1;\n"
    "prmt.b32 a8, $17, 0, a4;\n"
    "or.b32 a5, a5, a7;\n"
    "or.b32 a6, a6, a8;\n"
    "prmt.b32 a9, a5, 0, 0x1404;\n"
    "prmt.b32 a10, a5, 0, 0x3424;\n"
    "prmt.b32 a11, a6, 0, 0x1404;\n"
    "prmt.b32 a12, a6, 0, 0x3424;\n"
    "mul.rn.f16x2 $0, a9, $5;\n"
    "mul.rn.f16x2 $1, a10, $6;\n"
    "mul.rn.f16x2 $2, a11, $7;\n"
    "mul.rn.f16x2 $3, a12, $8;\n"
    "}"
)
_SCALED_PAIRS_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 17))


# The native convert (sm_100+ / sm_120, PTX ISA >= 9.2): code byte i of the word in $4 → its two weights (the low
# nibble in the low half, as the table) times its block scale pair $5+i (:func:`_scale_pairs` with ``CVT``).
# Bytewise, as the table.  Per code word 4 converts and 4 pair multiplies, where the shift decode spends 13 integer
# instructions and 4 multiplies.
def _scaled_cvt_ptx(fmt: str) -> tl.constexpr:
    return tl.constexpr("{ .reg .b8 b<4>; .reg .b32 d<4>; mov.b32 {b0, b1, b2, b3}, $4; "
                        + "".join(f"cvt.rn.{fmt}x2.e2m1x2 d{i}, b{i}; " for i in range(4))
                        + "".join(f"mul.rn.{fmt}x2 ${i}, d{i}, ${5 + i}; " for i in range(4)) + "}")


SCALED_CVT_PTX = {"bf16": _scaled_cvt_ptx("bf16"), "f16": _scaled_cvt_ptx("f16")}
_SCALED_CVT_BF16_PTX = SCALED_CVT_PTX["bf16"]
_SCALED_CVT_F16_PTX = SCALED_CVT_PTX["f16"]
_SCALED_CVT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 5))


# ptxas keeps a constant that is the same in every thread in a uniform register and copies it into a regular one
# before every prmt that reads it (a prmt has one immediate operand and cannot read uniform registers): ~6
# instructions per 4 code bytes, a sixth of the decode loop.  min(laneid | c, c) == c, but ptxas cannot prove the
# value uniform, so it computes it once and keeps it in a regular register.  The asm's input ($1) is only there to
# give the result the layout of the codes it is combined with (a constant input would get a layout of its own).
def _thread_constant_ptx(value: int) -> tl.constexpr:
    v = value & 0xFFFFFFFF
    return tl.constexpr("{ .reg .u32 l; mov.u32 l, %%laneid; or.b32 l, l, %d; min.u32 $0, l, %d; }" % (v, v))


_BF16_LOW_TABLE = _thread_constant_ptx(0xC0800000)  # low bytes of bf16(|e2m1|) for codes 0..3
_BF16_HIGH_TABLE = _thread_constant_ptx(0x3F3F3F00)  # high bytes, codes 0..3
_F16_HIGH_TABLE = _thread_constant_ptx(0x3E3C3800)  # high bytes of fp16(|e2m1|), codes 0..3
_SIGN_TABLE = _thread_constant_ptx(0x8000)  # sign byte 0x00 / 0x80


# e4m3 block-scale bytes (4 in $4) → each as a pair (s, s) of the activation type ($0..$3), for the pair multiply.
# The hardware e4m3x2 → f16x2 convert (sm_89+) is exact (e4m3 ⊂ fp16), and so is fp16 → fp32 → bf16 (e4m3 ⊂ bf16).
# ``factor``: a power of two the pairs carry (the shift decode's; exact: 448 * 2^119 < the bf16 maximum,
# 448 * 2^7 < 65504), applied in fp32 for bf16 and as an f16x2 multiply for fp16.
def _scale_pairs_ptx(fmt: str, factor: float | None = None) -> tl.constexpr:
    if fmt == "f16":
        bits = struct.unpack("<H", struct.pack("<e", factor))[0] if factor is not None else None
        scale = ("mul.rn.f16x2 h0, h0, m; mul.rn.f16x2 h1, h1, m; " if bits is not None else "")
        return tl.constexpr(
            "{ .reg .b16 b<2>; .reg .b32 h<2>" + (", m" if bits is not None else "") + "; mov.b32 {b0, b1}, $4; "
            + (f"mov.b32 m, 0x{bits:04X}{bits:04X}; " if bits is not None else "")
            + "cvt.rn.f16x2.e4m3x2 h0, b0; cvt.rn.f16x2.e4m3x2 h1, b1; " + scale
            + "prmt.b32 $0, h0, 0, 0x1010; prmt.b32 $1, h0, 0, 0x3232; prmt.b32 $2, h1, 0, 0x1010; "
            "prmt.b32 $3, h1, 0, 0x3232; }"
        )
    scale = "" if factor is None else "".join(
        f"mul.f32 f{i}, f{i}, 0f{struct.pack('>f', factor).hex().upper()}; " for i in range(4))
    return tl.constexpr(
        "{ .reg .b16 b<2>, s<4>; .reg .b32 h<2>; .reg .f32 f<4>; mov.b32 {b0, b1}, $4; "
        "cvt.rn.f16x2.e4m3x2 h0, b0; cvt.rn.f16x2.e4m3x2 h1, b1; mov.b32 {s0, s1}, h0; mov.b32 {s2, s3}, h1; "
        "cvt.f32.f16 f0, s0; cvt.f32.f16 f1, s1; cvt.f32.f16 f2, s2; cvt.f32.f16 f3, s3; " + scale
        + "cvt.rn.bf16x2.f32 $0, f0, f0; cvt.rn.bf16x2.f32 $1, f1, f1; cvt.rn.bf16x2.f32 $2, f2, f2; "
        "cvt.rn.bf16x2.f32 $3, f3, f3; }"
    )


# sm_100+ / sm_120 (PTX ISA >= 9.2): e4m3x2 → bf16x2 / f16x2 in one convert (exact), two scales at a time; each pair
# (s, s) is a copy of one half, which ptxas folds into the multiply that reads it (an .H0_H0 / .H1_H1 operand).
def _scale_pairs_cvt_ptx(fmt: str) -> tl.constexpr:
    return tl.constexpr("{ .reg .b16 s<2>, l<4>; .reg .b32 q<2>; mov.b32 {s0, s1}, $4; "
                        f"cvt.rn.{fmt}x2.e4m3x2 q0, s0; cvt.rn.{fmt}x2.e4m3x2 q1, s1; "
                        "mov.b32 {l0, l1}, q0; mov.b32 {l2, l3}, q1; "
                        + "".join(f"mov.b32 ${i}, {{l{i}, l{i}}}; " for i in range(4)) + "}")


SCALE_PAIRS_CVT_PTX = {"bf16": _scale_pairs_cvt_ptx("bf16"), "f16": _scale_pairs_cvt_ptx("f16")}
_SCALE_PAIRS_CVT_BF16_PTX = SCALE_PAIRS_CVT_PTX["bf16"]
_SCALE_PAIRS_CVT_F16_PTX = SCALE_PAIRS_CVT_PTX["f16"]
_SCALE_PAIRS_F16_PTX = _scale_pairs_ptx("f16")
_SCALE_PAIRS_BF16_PTX = _scale_pairs_ptx("bf16")
_SHIFT_SCALE_PAIRS_F16_PTX = _scale_pairs_ptx("f16", SHIFT_SCALE["f16"])
_SHIFT_SCALE_PAIRS_BF16_PTX = _scale_pairs_ptx("bf16", SHIFT_SCALE["bf16"])


@triton.jit
def _scale_pairs(sf, DTYPE: tl.constexpr, SHIFT: tl.constexpr = False, CVT: tl.constexpr = False):
    """e4m3 scale bytes (uint8, any shape) → int32 of the same shape: ``(s, s)`` packed in ``DTYPE`` (bf16/fp16);
    ``SHIFT``: times the shift decode's power of two; ``CVT``: by the sm_100+ / sm_120 convert (no ``SHIFT``)."""
    if CVT:
        tl.static_assert(not SHIFT, "moe_decode: the shift decode has no native-convert variant")
        if DTYPE == tl.bfloat16:
            ptx: tl.constexpr = _SCALE_PAIRS_CVT_BF16_PTX
        else:
            ptx: tl.constexpr = _SCALE_PAIRS_CVT_F16_PTX
    elif DTYPE == tl.bfloat16:
        ptx: tl.constexpr = _SHIFT_SCALE_PAIRS_BF16_PTX if SHIFT else _SCALE_PAIRS_BF16_PTX
    else:
        ptx: tl.constexpr = _SHIFT_SCALE_PAIRS_F16_PTX if SHIFT else _SCALE_PAIRS_F16_PTX
    return tl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r", [sf], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit
def _thread_constant(PTX: tl.constexpr, like):
    """An int32 tensor with the layout of ``like``, every element the constant of ``PTX``, held in a regular
    register (see above)."""
    return tl.inline_asm_elementwise(PTX, "=r,r", [like.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _scaled_pairs(codes, sf, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                  CVT: tl.constexpr = False):
    """``[ROWS, BLOCK_K/2]`` code bytes, ``[ROWS, BLOCK_K/16]`` e4m3 bytes → int32 ``[ROWS, BLOCK_K/16, 8]``: per
    code byte its two weights ``e2m1 * e4m3`` (exact) as a packed 16-bit pair, the even element in the low half.
    ``CVT``: by the native e2m1 convert (sm_100+ / sm_120), else by the lop3/prmt table."""
    c3 = codes.reshape(ROWS, BLOCK_K // 16, 8)
    if CVT:
        if DTYPE == tl.bfloat16:
            ptx: tl.constexpr = _SCALED_CVT_BF16_PTX
        else:
            tl.static_assert(DTYPE == tl.float16, "moe_decode: activations must be bf16 or fp16")
            ptx: tl.constexpr = _SCALED_CVT_F16_PTX
        pair = _scale_pairs(sf, DTYPE, CVT=True)[:, :, None]
        return tl.inline_asm_elementwise(ptx, _SCALED_CVT_CONSTRAINTS, [c3, pair], dtype=tl.int32, is_pure=True,
                                         pack=4)
    pair = _scale_pairs(sf, DTYPE)[:, :, None]
    sign = _thread_constant(_SIGN_TABLE, c3)
    if DTYPE == tl.bfloat16:
        low = _thread_constant(_BF16_LOW_TABLE, c3)
        high = _thread_constant(_BF16_HIGH_TABLE, c3)
        out = tl.inline_asm_elementwise(_SCALED_BF16X2_PTX, _SCALED_PAIRS_CONSTRAINTS, [c3, pair, low, high, sign],
                                        dtype=tl.int32, is_pure=True, pack=4)
    else:
        tl.static_assert(DTYPE == tl.float16, "moe_decode: activations must be bf16 or fp16")
        high = _thread_constant(_F16_HIGH_TABLE, c3)
        out = tl.inline_asm_elementwise(_SCALED_F16X2_PTX, _SCALED_PAIRS_CONSTRAINTS, [c3, pair, high, high, sign],
                                        dtype=tl.int32, is_pure=True, pack=4)
    return out


@triton.jit
def _dequant_tile(codes, sf, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                  FAST_DECODE: tl.constexpr):
    """Scaled weights ``[ROWS, BLOCK_K]`` in ``DTYPE`` (the MMA operand); ``FAST_DECODE`` as the kernels'."""
    if FAST_DECODE:
        p = _scaled_pairs(codes, sf, ROWS, BLOCK_K, DTYPE, FAST_DECODE == _CVT)
        lo = p.to(tl.int16).to(DTYPE, bitcast=True)  # truncation keeps the low half
        hi = (p >> 16).to(tl.int16).to(DTYPE, bitcast=True)
        w = tl.join(lo, hi).reshape(ROWS, BLOCK_K)
    else:
        w = dequant_rows_16bit(codes, sf, ROWS, BLOCK_K, DTYPE, False)
    return w


@triton.jit
def _dequant_tile_f32(codes, sf, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                      FAST_DECODE: tl.constexpr):
    """The same weights as fp32 ``[ROWS, BLOCK_K]`` (CUDA-core path); bf16 → fp32 is a shift of the pair."""
    if FAST_DECODE and DTYPE == tl.bfloat16:
        p = _scaled_pairs(codes, sf, ROWS, BLOCK_K, DTYPE, FAST_DECODE == _CVT)
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & -65536).to(tl.float32, bitcast=True)
        w = tl.join(lo, hi).reshape(ROWS, BLOCK_K)
    else:
        w = _dequant_tile(codes, sf, ROWS, BLOCK_K, DTYPE, FAST_DECODE).to(tl.float32)
    return w


# The shift decode with the block scale: 4 code bytes in $4 (one word: Triton packs 4 consecutive bytes of the
# thread, which the tensor-core operand layout makes a memory word), their scale pairs in $5..$8 (one block: equal).
def _shift_scaled_ptx(body: str, fmt: str) -> tl.constexpr:
    return tl.constexpr("{ .reg .b32 q, d<4>; " + body
                        + "".join(f"mul.rn.{fmt}x2 ${i}, d{i}, ${5 + i}; " for i in range(4)) + "}")


_SHIFT_SCALED_BF16_PTX = _shift_scaled_ptx(SHIFT_BF16_BODY, "bf16")
_SHIFT_SCALED_F16_PTX = _shift_scaled_ptx(SHIFT_F16_BODY, "f16")
_SHIFT_SCALED_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 5))
_SHIFT_RESTORE = tl.constexpr(2.0 ** SHIFT_EXP)


@triton.jit
def _shift_tile(codes, sf, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Scaled weights times ``2^-SHIFT_EXP`` as ``[ROWS, BLOCK_K]`` in the relabelled k order (within each 8
    elements, operand ``2j + h`` is memory ``j + 4h``)."""
    c3 = codes.reshape(ROWS, BLOCK_K // 16, 8)
    pair = _scale_pairs(sf, DTYPE, True)[:, :, None]
    if DTYPE == tl.bfloat16:
        p = tl.inline_asm_elementwise(_SHIFT_SCALED_BF16_PTX, _SHIFT_SCALED_CONSTRAINTS, [c3, pair], dtype=tl.int32,
                                      is_pure=True, pack=4)
    else:
        tl.static_assert(DTYPE == tl.float16, "moe_decode: activations must be bf16 or fp16")
        p = tl.inline_asm_elementwise(_SHIFT_SCALED_F16_PTX, _SHIFT_SCALED_CONSTRAINTS, [c3, pair], dtype=tl.int32,
                                      is_pure=True, pack=4)
    lo = p.to(tl.int16).to(DTYPE, bitcast=True)
    hi = (p >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return tl.join(lo, hi).reshape(ROWS, BLOCK_K)


@triton.jit
def _shift_order(a, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """Activations ``[BLOCK_K, BLOCK_T]`` in memory order → the shift decode's k order (see :func:`_shift_tile`)."""
    return a.reshape(BLOCK_K // 8, 2, 4, BLOCK_T).permute(0, 2, 1, 3).reshape(BLOCK_K, BLOCK_T)


@triton.jit
def _acc_init(ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr,
              K_WARPS: tl.constexpr):
    """The K-loop accumulator: the MMA's ``[ROWS, BLOCK_T]`` (``[K_WARPS, ROWS, BLOCK_T]``: one per K slice), or
    per-element fp32 partial sums ``[ROWS, BLOCK_K, BLOCK_T]`` on CUDA cores (one FMA per weight and route; reduced
    over K once, after the loop)."""
    if USE_DOT and K_WARPS > 1:
        acc = tl.zeros((K_WARPS, ROWS, BLOCK_T), dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros((ROWS, BLOCK_T), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_K, BLOCK_T), dtype=tl.float32)
    return acc


@triton.jit
def _acc_finish(acc, USE_DOT: tl.constexpr, SHIFT: tl.constexpr, K_WARPS: tl.constexpr):
    """``[ROWS, BLOCK_T]`` sums of the accumulator (``SHIFT``: the shift decode's power of two restored, exact;
    ``K_WARPS``: the slices added by one fixed reduction: the same bits on every run)."""
    if USE_DOT:
        out = acc
        if K_WARPS > 1:
            out = tl.sum(out, axis=0)
        if SHIFT:
            out = out * _SHIFT_RESTORE
    else:
        out = tl.sum(acc, axis=1)
    return out


@triton.jit
def _tile_product(w, s, a, acc, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, USE_DOT: tl.constexpr,
                  FAST_DECODE: tl.constexpr, SHIFT: tl.constexpr, K_WARPS: tl.constexpr = 1):
    """``acc += W [ROWS, BLOCK_K] @ a [BLOCK_K, BLOCK_T]`` (fp32) for the accumulator of :func:`_acc_init`; the
    weights are decoded to ``DTYPE`` (the activations' 16-bit type; ``a`` itself may be fp32 on CUDA cores).
    ``SHIFT`` (with the inline-PTX decode): the shift decode, so ``acc`` holds the sums times ``2^-SHIFT_EXP`` until
    :func:`_acc_finish`.  ``K_WARPS``: slice ``j`` of the K step (elements ``j * BLOCK_K / K_WARPS ..``) into
    ``acc[j]``, decoded as ``K_WARPS * ROWS`` rows of ``BLOCK_K / K_WARPS``."""
    if USE_DOT and K_WARPS > 1:
        KS: tl.constexpr = BLOCK_K // K_WARPS
        w3 = w.reshape(ROWS, K_WARPS, KS // 2).permute(1, 0, 2).reshape(K_WARPS * ROWS, KS // 2)
        s3 = s.reshape(ROWS, K_WARPS, KS // 16).permute(1, 0, 2).reshape(K_WARPS * ROWS, KS // 16)
        if SHIFT:
            wd = _shift_tile(w3, s3, K_WARPS * ROWS, KS, DTYPE)
            a = _shift_order(a, BLOCK_K, a.shape[1])
        else:
            wd = _dequant_tile(w3, s3, K_WARPS * ROWS, KS, DTYPE, FAST_DECODE)
        acc = tl.dot(wd.reshape(K_WARPS, ROWS, KS), a.reshape(K_WARPS, KS, a.shape[1]), acc)
    elif USE_DOT and SHIFT:
        acc = tl.dot(_shift_tile(w, s, ROWS, BLOCK_K, DTYPE), _shift_order(a, BLOCK_K, a.shape[1]), acc)
    elif USE_DOT:
        acc = tl.dot(_dequant_tile(w, s, ROWS, BLOCK_K, DTYPE, FAST_DECODE), a, acc)
    else:
        wf = _dequant_tile_f32(w, s, ROWS, BLOCK_K, DTYPE, FAST_DECODE)
        acc = tl.fma(wf[:, :, None], a.to(tl.float32)[None, :, :], acc)
    return acc


# ---------------------------------------------------------------------------------------------------------------
# Programmatic dependent launch: the down kernel's prologue overlaps the gate_up kernel's tail
# ---------------------------------------------------------------------------------------------------------------
_PREFETCH_L2_PTX = tl.constexpr("prefetch.global.L2 [$1]; // $0")
_GDC_WAIT_PTX = tl.constexpr("griddepcontrol.wait; // $0")
_GDC_LAUNCH_PTX = tl.constexpr("griddepcontrol.launch_dependents; // $0")


@triton.jit
def _gdc_wait(GDC: tl.constexpr):
    """Wait for the preceding grid and the visibility of its writes (a no-op when not launched as a dependent)."""
    if GDC:
        tl.inline_asm_elementwise(_GDC_WAIT_PTX, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gdc_launch_dependents(GDC: tl.constexpr):
    """Let a programmatically dependent next grid start once every program here has started."""
    if GDC:
        tl.inline_asm_elementwise(_GDC_LAUNCH_PTX, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(w_ptr, w_sf_ptr, w_rows, s_rows, row_ok, K):
    """L2 prefetch of weight rows (byte offsets ``w_rows`` / ``s_rows`` into the codes / scales), 128-byte lines."""
    for off in range(0, K // 2, 128):
        ptrs = tl.where(row_ok, w_ptr + w_rows + off, w_ptr)
        tl.inline_asm_elementwise(_PREFETCH_L2_PTX, "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False,
                                  pack=1)
    for off in range(0, K // 16, 128):
        ptrs = tl.where(row_ok, w_sf_ptr + s_rows + off, w_sf_ptr)
        tl.inline_asm_elementwise(_PREFETCH_L2_PTX, "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _prefetch_down_share(w2_ptr, w2_sf_ptr, e, part, H, I, stride_we, stride_wn, stride_wse, stride_wsn,
                         PF_ROWS: tl.constexpr):
    """L2 prefetch of rows ``[part * PF_ROWS, (part + 1) * PF_ROWS)`` of expert ``e``'s down bank (``[E, H, I/2]``
    codes, ``[E, H, I/16]`` scales), rows past H skipped."""
    rows = (part * PF_ROWS + tl.arange(0, PF_ROWS)).to(tl.int64)
    e64 = e.to(tl.int64)
    _prefetch_rows(w2_ptr, w2_sf_ptr, e64 * stride_we + rows * stride_wn, e64 * stride_wse + rows * stride_wsn,
                   rows < H, I)


def prefetch_rows_per_program(h: int, programs: int) -> int:
    """``PF_ROWS`` of a gate_up launch with ``prefetch_down``: the down rows one of the ``programs`` programs of a
    grid row prefetches (a power of two: a tensor's length), so that together they cover all ``h`` rows."""
    return triton.next_power_of_2(-(-h // programs))


# ---------------------------------------------------------------------------------------------------------------
# Routing: which program works, and the routes of its expert
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _program_expert(row, ids_ptr, map_ptr, S, E, GLOBAL_E,
                    HAS_MAP: tl.constexpr, BY_EXPERT: tl.constexpr, S_BLOCK: tl.constexpr):
    """``(live, e, seen, count)`` of grid row ``row``: its local expert ``e``, per route the number of routes to ``e``
    up to and including it, and their count.  ``live`` is False for the programs that must do nothing: a slot that
    is not the first of its expert (or has none), an expert no route reaches."""
    offs = tl.arange(0, S_BLOCK)
    ids = local_expert(ids_ptr, map_ptr, offs, S, E, GLOBAL_E, HAS_MAP)
    if BY_EXPERT:
        e = row
        match = ids == e
        count = tl.sum(match.to(tl.int32), axis=0)
        live = count > 0
    else:
        e = tl.max(tl.where(offs == row, ids, -1), axis=0)
        match = (ids == e) & (e >= 0)
        count = tl.sum(match.to(tl.int32), axis=0)
        first = tl.min(tl.where(match, offs, S_BLOCK), axis=0)
        live = (e >= 0) & (first == row)
    seen = tl.cumsum(match.to(tl.int32), axis=0)
    return live, e, seen, count


@triton.jit
def _chunk_routes(seen, c0, count, BLOCK_T: tl.constexpr):
    """Routes ``c0 .. c0 + BLOCK_T`` of the expert (in route order) and their mask.  ``seen`` is non-decreasing,
    so the n-th route to the expert (from 0) is the number of routes with ``seen <= n``: one compare and one add
    per (route, slot)."""
    want = c0 + tl.arange(0, BLOCK_T)
    route = tl.sum((seen[None, :] <= want[:, None]).to(tl.int32), axis=1)
    return route, want < count


@triton.jit
def _load_tile(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, desc_p, desc_n, k0, K,
               ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr, EVICT_FIRST: tl.constexpr,
               EVEN_K: tl.constexpr):
    """Codes ``[ROWS, BLOCK_K/2]`` and scale bytes ``[ROWS, BLOCK_K/16]`` of K tile ``k0``.

    Pointer loads: rows at byte offsets ``w_rows`` / ``s_rows`` of the codes / scales (``row_ok`` masks them).
    ``USE_TMA``: the ``[P, ROWS / P, ...]`` boxes at ``(desc_p, desc_n, k0)`` of the banks' 3-D descriptors, rows past
    the bank zero-filled.  Zero codes and scales past K contribute exactly 0.
    """
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    if USE_TMA:
        w = w_desc.load([desc_p, desc_n, k0 // 2]).reshape(ROWS, BLOCK_K // 2)
        s = s_desc.load([desc_p, desc_n, k0 // 16]).reshape(ROWS, BLOCK_K // 16)
    else:
        w_ptrs = w_ptr + w_rows[:, None] + (k0 // 2 + offs_kb)[None, :]
        s_ptrs = w_sf_ptr + s_rows[:, None] + (k0 // 16 + offs_ks)[None, :]
        if EVEN_K:
            w_mask = row_ok[:, None]
            s_mask = row_ok[:, None]
        else:
            w_mask = row_ok[:, None] & ((k0 // 2 + offs_kb) < K // 2)[None, :]
            s_mask = row_ok[:, None] & ((k0 // 16 + offs_ks) < K // 16)[None, :]
        if EVICT_FIRST:
            w = tl.load(w_ptrs, mask=w_mask, other=0, eviction_policy="evict_first")
            s = tl.load(s_ptrs, mask=s_mask, other=0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0)
            s = tl.load(s_ptrs, mask=s_mask, other=0)
    return w, s


@triton.jit
def _load_act(a_ptr, a_rows, a_ok, stride_a, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              A_CG: tl.constexpr = False):
    """Activation rows ``a_rows`` (masked by ``a_ok``) of K tile ``k0`` as the MMA's ``[BLOCK_K, BLOCK_T]``.
    ``A_CG``: from L2 (``.cg``), for rows another program of the same launch wrote: this SM's L1 may hold a stale
    copy of a line they share with a row read earlier."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = a_ptr + a_rows[None, :].to(tl.int64) * stride_a + offs_k[:, None]
    if EVEN_K:
        mask = a_ok[None, :]
    else:
        mask = a_ok[None, :] & (offs_k < K)[:, None]
    if A_CG:
        a = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        a = tl.load(ptrs, mask=mask, other=0.0)
    return a


@triton.jit
def _expert_rows_product(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, desc_p, desc_n, a_ptr, a_rows, a_ok,
                         stride_a, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                         USE_DOT: tl.constexpr, USE_TMA: tl.constexpr, FAST_DECODE: tl.constexpr,
                         EVICT_FIRST: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                         SHIFT: tl.constexpr, K_WARPS: tl.constexpr, A_CG: tl.constexpr = False):
    """``[ROWS, BLOCK_T]`` fp32: one expert's weight rows (see :func:`_load_tile`) times the activation rows
    ``a_rows`` of ``a``, over K (``A_CG`` as :func:`_load_act`)."""
    return _expert_rows_product_range(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, desc_p, desc_n, a_ptr,
                                      a_rows, a_ok, stride_a, 0, K, K, ROWS, BLOCK_K, BLOCK_T, USE_DOT, USE_TMA,
                                      FAST_DECODE, EVICT_FIRST, EVEN_K, NUM_STAGES, SHIFT, K_WARPS, A_CG)


@triton.jit
def _expert_rows_product_range(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, desc_p, desc_n, a_ptr,
                               a_rows, a_ok, stride_a, k_lo, k_hi, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr, USE_TMA: tl.constexpr,
                               FAST_DECODE: tl.constexpr, EVICT_FIRST: tl.constexpr, EVEN_K: tl.constexpr,
                               NUM_STAGES: tl.constexpr, SHIFT: tl.constexpr, K_WARPS: tl.constexpr,
                               A_CG: tl.constexpr = False):
    """:func:`_expert_rows_product` over the K tiles ``k_lo .. k_hi`` (multiples of ``BLOCK_K``; the bank's K masks
    the last one); ``A_CG`` as :func:`_load_act`."""
    acc = _acc_init(ROWS, BLOCK_K, BLOCK_T, USE_DOT, K_WARPS)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        w, s = _load_tile(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, desc_p, desc_n, k0, K, ROWS,
                          BLOCK_K, USE_TMA, EVICT_FIRST, EVEN_K)
        a = _load_act(a_ptr, a_rows, a_ok, stride_a, k0, K, BLOCK_K, EVEN_K, A_CG)
        acc = _tile_product(w, s, a, acc, ROWS, BLOCK_K, a_ptr.dtype.element_ty, USE_DOT, FAST_DECODE,
                            SHIFT and FAST_DECODE == _PTX, K_WARPS)
    return _acc_finish(acc, USE_DOT, SHIFT and FAST_DECODE == _PTX, K_WARPS)


@triton.jit
def _split_range(kid, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """K split ``kid``'s range ``k_lo .. k_hi``: an equal number of whole K tiles per split (the last ones may be
    short or empty)."""
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = kid * steps * BLOCK_K
    return k_lo, tl.minimum(k_lo + steps * BLOCK_K, K)


@triton.jit
def _zero_slice(zero_ptr, pid, zero_numel, zero_chunk, ZERO_BLOCK: tl.constexpr):
    start = pid.to(tl.int64) * zero_chunk
    for z0 in range(0, zero_chunk, ZERO_BLOCK):
        offs = z0 + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + start + offs, tl.zeros((ZERO_BLOCK,), tl.float32),
                 mask=(start + offs < zero_numel) & (offs < zero_chunk))


@triton.jit
def _gate_up_split(x_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, out_ptr, part_ptr, cnt_ptr, row, pid_n, kid,
                   e, seen, count, S, I, K, top_k, stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                   num_n, ACTIVATION: tl.constexpr, FAST_DECODE: tl.constexpr, EVEN_K: tl.constexpr,
                   USE_TMA: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr, EVICT_FIRST: tl.constexpr,
                   NUM_STAGES: tl.constexpr, SHIFT_DECODE: tl.constexpr, K_WARPS: tl.constexpr):
    """The gate_up program of K split ``kid``: its fp32 partial sums of the stacked tile go to ``part [SPLIT_K, S,
    2I]`` (plain stores: each split has its own slice), and the last split of (grid row, column block) to arrive,
    counted in ``cnt`` (zeroed by the launcher), sums the slices in split order, applies the activation and stores
    the intermediate: SPLIT_K times the programs at small T, bit-identical run to run."""
    r = tl.arange(0, 2 * BLOCK_N)
    col = pid_n * BLOCK_N + r % BLOCK_N
    w_row = ((r // BLOCK_N) * I + col).to(tl.int64)
    row_ok = col < I
    e64 = e.to(tl.int64)
    w_rows = e64 * stride_we + w_row * stride_wn
    s_rows = e64 * stride_wse + w_row * stride_wsn
    k_lo, k_hi = _split_range(kid, K, BLOCK_K, SPLIT_K)
    slice_numel = S.to(tl.int64) * 2 * I
    for c0 in range(0, count, BLOCK_T):
        route, r_ok = _chunk_routes(seen, c0, count, BLOCK_T)
        acc = _expert_rows_product_range(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, 2 * e,
                                         pid_n * BLOCK_N, x_ptr, route // top_k, r_ok, stride_xt, k_lo, k_hi, K,
                                         2 * BLOCK_N, BLOCK_K, BLOCK_T, USE_DOT, USE_TMA, FAST_DECODE, EVICT_FIRST,
                                         EVEN_K, NUM_STAGES, SHIFT_DECODE, K_WARPS)
        p_ptrs = part_ptr + kid * slice_numel + route[None, :].to(tl.int64) * (2 * I) + w_row[:, None]
        tl.store(p_ptrs, acc, mask=row_ok[:, None] & r_ok[None, :])
    tl.debug_barrier()  # every thread's partial sums before the release of the count
    done = tl.atomic_add(cnt_ptr + row * num_n + pid_n, 1, sem="acq_rel")
    if done == SPLIT_K - 1:
        tl.debug_barrier()
        dec = tl.load(w_dec_ptr + e)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        for c0 in range(0, count, BLOCK_T):
            route, r_ok = _chunk_routes(seen, c0, count, BLOCK_T)
            mask = row_ok[:, None] & r_ok[None, :]
            p_ptrs = part_ptr + route[None, :].to(tl.int64) * (2 * I) + w_row[:, None]
            total = tl.zeros((2 * BLOCK_N, BLOCK_T), dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):  # split order: the same bits on every run
                # .cg: the other splits' sums are in L2; this SM's L1 may hold a stale line.
                total += tl.load(p_ptrs + j * slice_numel, mask=mask, other=0.0, cache_modifier=".cg")
            gate, up = total.reshape(2, BLOCK_N, BLOCK_T).permute(1, 2, 0).split()
            inter = gated_activation_f32(gate * dec, up * dec, ACTIVATION)
            out_ptrs = out_ptr + route[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(out_ptrs, inter.to(out_ptr.dtype.element_ty), mask=(offs_n < I)[:, None] & r_ok[None, :])


@triton.jit
def _gate_up_columns(x_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, out_ptr, pid_n, e, seen, count, I, K, top_k,
                     stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, ACTIVATION: tl.constexpr,
                     FAST_DECODE: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr, EVICT_FIRST: tl.constexpr,
                     NUM_STAGES: tl.constexpr, SHIFT_DECODE: tl.constexpr, K_WARPS: tl.constexpr):
    """Intermediate columns ``pid_n * BLOCK_N ..`` of every route to expert ``e`` (whole K, one program)."""
    # Stacked tile: rows 0..BLOCK_N are gate rows n, rows BLOCK_N..2 BLOCK_N the up rows I + n (the TMA box
    # [2, BLOCK_N, .] of the bank viewed as [2E, I, K/2]).
    r = tl.arange(0, 2 * BLOCK_N)
    col = pid_n * BLOCK_N + r % BLOCK_N
    w_row = ((r // BLOCK_N) * I + col).to(tl.int64)
    row_ok = col < I
    e64 = e.to(tl.int64)
    w_rows = e64 * stride_we + w_row * stride_wn
    s_rows = e64 * stride_wse + w_row * stride_wsn
    dec = tl.load(w_dec_ptr + e)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    for c0 in range(0, count, BLOCK_T):
        route, r_ok = _chunk_routes(seen, c0, count, BLOCK_T)
        acc = _expert_rows_product(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, 2 * e,
                                   pid_n * BLOCK_N, x_ptr, route // top_k, r_ok, stride_xt, K, 2 * BLOCK_N,
                                   BLOCK_K, BLOCK_T, USE_DOT, USE_TMA, FAST_DECODE, EVICT_FIRST, EVEN_K,
                                   NUM_STAGES, SHIFT_DECODE, K_WARPS)
        gate, up = acc.reshape(2, BLOCK_N, BLOCK_T).permute(1, 2, 0).split()
        inter = gated_activation_f32(gate * dec, up * dec, ACTIVATION)
        out_ptrs = out_ptr + route[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, inter.to(out_ptr.dtype.element_ty), mask=(offs_n < I)[:, None] & r_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, ids_ptr, map_ptr, out_ptr, zero_ptr, part_ptr, cnt_ptr,
    w2_ptr, w2_sf_ptr,
    S, I, K, E, GLOBAL_E, top_k, zero_numel, zero_chunk,
    stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    stride_w2e, stride_w2n, stride_w2se, stride_w2sn,
    ACTIVATION: tl.constexpr, HAS_MAP: tl.constexpr, BY_EXPERT: tl.constexpr, ZERO: tl.constexpr,
    S_BLOCK: tl.constexpr, FAST_DECODE: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    GDC: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_DOT: tl.constexpr, EVICT_FIRST: tl.constexpr, NUM_STAGES: tl.constexpr, SHIFT_DECODE: tl.constexpr,
    K_WARPS: tl.constexpr, PREFETCH_DOWN: tl.constexpr, PF_ROWS: tl.constexpr,
):
    # A down kernel launched as a programmatic dependent may start its prologue (routing, L2 prefetch of its
    # weights: nothing this kernel writes) as soon as every program here has started.
    _gdc_launch_dependents(GDC)
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    kid = tl.program_id(2)  # the K split (SPLIT_K > 1)
    if ZERO:  # the atomic down kernel's accumulator, one slice per program (every program, live or not)
        if kid == 0:
            _zero_slice(zero_ptr, row * tl.num_programs(1) + pid_n, zero_numel, zero_chunk, _ZERO_BLOCK)
    live, e, seen, count = _program_expert(row, ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP, BY_EXPERT, S_BLOCK)
    if PREFETCH_DOWN and live:  # the down rows of the expert (H = K of this bank), PF_ROWS per program of the row
        _prefetch_down_share(w2_ptr, w2_sf_ptr, e, pid_n * SPLIT_K + kid, K, I, stride_w2e, stride_w2n, stride_w2se,
                             stride_w2sn, PF_ROWS)
    if live and SPLIT_K > 1:
        _gate_up_split(x_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, out_ptr, part_ptr, cnt_ptr, row, pid_n, kid,
                       e, seen, count, S, I, K, top_k, stride_xt, stride_we, stride_wn, stride_wse, stride_wsn,
                       stride_om, tl.num_programs(1), ACTIVATION, FAST_DECODE, EVEN_K, USE_TMA, SPLIT_K, BLOCK_N,
                       BLOCK_K, BLOCK_T, USE_DOT, EVICT_FIRST, NUM_STAGES, SHIFT_DECODE, K_WARPS)
    elif live:
        _gate_up_columns(x_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, out_ptr, pid_n, e, seen, count, I, K,
                         top_k, stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, ACTIVATION,
                         FAST_DECODE, EVEN_K, USE_TMA, BLOCK_N, BLOCK_K, BLOCK_T, USE_DOT, EVICT_FIRST, NUM_STAGES,
                         SHIFT_DECODE, K_WARPS)


@triton.jit
def _moe_decode_down_token_kernel(
    a_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, ids_ptr, map_ptr, tw_ptr, out_ptr,
    S, H, K, E, GLOBAL_E, top_k,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    HAS_MAP: tl.constexpr, TOPK_BLOCK: tl.constexpr, FAST_DECODE: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_DOT: tl.constexpr, EVICT_FIRST: tl.constexpr, NUM_STAGES: tl.constexpr, SHIFT_DECODE: tl.constexpr,
    K_WARPS: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, TOPK_BLOCK)
    routes = tl.where(slots < top_k, t * top_k + slots, S)
    ids = local_expert(ids_ptr, map_ptr, routes, S, E, GLOBAL_E, HAS_MAP)
    ok = ids >= 0
    # The slots with a local expert, compacted: the loop never touches another rank's (or no) expert.
    rank = tl.cumsum(ok.to(tl.int32), axis=0) - 1
    n_live = tl.sum(ok.to(tl.int32), axis=0)
    # Per slot: w2_dec[e] * topk_weight, applied to each K tile's partial product.
    coef = tl.load(w_dec_ptr + ids, mask=ok, other=0.0) * tl.load(tw_ptr + routes, mask=ok, other=0.0)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    if PDL:  # everything above reads only the router's outputs; the intermediate is the gate_up kernel's
        for j in range(n_live):
            e64 = tl.sum(tl.where(ok & (rank == j), ids, 0), axis=0).to(tl.int64)
            _prefetch_rows(w_ptr, w_sf_ptr, e64 * stride_we + rows.to(tl.int64) * stride_wn,
                           e64 * stride_wse + rows.to(tl.int64) * stride_wsn, row_ok, K)
        _gdc_wait(PDL)
    cols = tl.arange(0, BLOCK_T)
    nk = tl.cdiv(K, BLOCK_K)
    y = _acc_init(BLOCK_N, BLOCK_K, BLOCK_T, USE_DOT, K_WARPS)
    # One loop over (slot, K tile), so the loads stream across slots without draining the pipeline.
    for it in tl.range(0, n_live * nk, num_stages=NUM_STAGES):
        j = it // nk
        k0 = (it - j * nk) * BLOCK_K
        pick = ok & (rank == j)
        slot = tl.sum(tl.where(pick, slots, 0), axis=0)
        e = tl.sum(tl.where(pick, ids, 0), axis=0)
        c = tl.sum(tl.where(pick, coef, 0.0), axis=0)
        e64 = e.to(tl.int64)
        w_rows = e64 * stride_we + rows.to(tl.int64) * stride_wn
        s_rows = e64 * stride_wse + rows.to(tl.int64) * stride_wsn
        w, s = _load_tile(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, e, pid_n * BLOCK_N, k0, K,
                          BLOCK_N, BLOCK_K, USE_TMA, EVICT_FIRST, EVEN_K)
        # The route's row on column 0 of the MMA's N (or the single CUDA-core column); the others are zeros.
        a = _load_act(a_ptr, t * top_k + slot + cols * 0, cols == 0, stride_am, k0, K, BLOCK_K, EVEN_K)
        if USE_DOT:
            y += _tile_product(w, s, a, _acc_init(BLOCK_N, BLOCK_K, BLOCK_T, True, K_WARPS), BLOCK_N, BLOCK_K,
                               a.dtype, True, FAST_DECODE, SHIFT_DECODE and FAST_DECODE == _PTX, K_WARPS) * c
        else:  # the slot's factor on the activations: one multiply per k instead of one per weight
            y = _tile_product(w, s, a.to(tl.float32) * c, y, BLOCK_N, BLOCK_K, a.dtype, False, FAST_DECODE, False)
    y = _acc_finish(y, USE_DOT, SHIFT_DECODE and FAST_DECODE == _PTX, K_WARPS)
    out = tl.sum(tl.where((cols == 0)[None, :], y, 0.0), axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _local_slots(ids_ptr, map_ptr, tok, S, E, GLOBAL_E, top_k, HAS_MAP: tl.constexpr, TOPK_BLOCK: tl.constexpr):
    """Per token of ``tok``: how many of its slots have a local expert."""
    slots = tl.arange(0, TOPK_BLOCK)
    routes = tl.where(slots[None, :] < top_k, tok[:, None] * top_k + slots[None, :], S)
    ids = local_expert(ids_ptr, map_ptr, routes, S, E, GLOBAL_E, HAS_MAP)
    return tl.sum((ids >= 0).to(tl.int32), axis=1)


@triton.jit
def _moe_decode_down_expert_kernel(
    a_ptr, w_ptr, w_sf_ptr, w_desc, s_desc, w_dec_ptr, ids_ptr, map_ptr, tw_ptr, ws_ptr, cnt_ptr, out_ptr,
    S, H, K, E, GLOBAL_E, top_k,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    HAS_MAP: tl.constexpr, BY_EXPERT: tl.constexpr, DETERMINISTIC: tl.constexpr, S_BLOCK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr, FAST_DECODE: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    PDL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_DOT: tl.constexpr, EVICT_FIRST: tl.constexpr, NUM_STAGES: tl.constexpr, SHIFT_DECODE: tl.constexpr,
    K_WARPS: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_n = tl.num_programs(1)
    # K split ``kid`` (atomic mode only): its K tiles' products go into the same fp32 sums as every other split's,
    # so a token's tile is complete after n_local * SPLIT_K arrivals.
    kid = tl.program_id(2)
    k_lo, k_hi = _split_range(kid, K, BLOCK_K, SPLIT_K)
    live, e, seen, count = _program_expert(row, ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP, BY_EXPERT, S_BLOCK)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    e64 = e.to(tl.int64)
    w_rows = e64 * stride_we + rows.to(tl.int64) * stride_wn
    s_rows = e64 * stride_wse + rows.to(tl.int64) * stride_wsn
    if PDL:  # the routing reads only the router's outputs; no write before the gate_up kernel is done
        if live:
            _prefetch_rows(w_ptr, w_sf_ptr, w_rows, s_rows, row_ok, K)
        _gdc_wait(PDL)
    if not DETERMINISTIC and kid == 0:
        # A token none of whose slots has a local expert gets no down program: zeros, from the programs of grid
        # row t, t + rows, ... (grid rows >= tokens in slot mode).
        for t in range(row, S // top_k, tl.num_programs(0)):
            n_local = _local_slots(ids_ptr, map_ptr, tl.full((1,), t, tl.int32), S, E, GLOBAL_E, top_k, HAS_MAP,
                                   TOPK_BLOCK)
            if tl.sum(n_local, axis=0) == 0:
                tl.store(out_ptr + t * stride_om + rows,
                         tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=row_ok)
    if live:
        dec = tl.load(w_dec_ptr + e)
        for c0 in range(0, count, BLOCK_T):
            route, r_ok = _chunk_routes(seen, c0, count, BLOCK_T)
            acc = _expert_rows_product_range(w_ptr, w_sf_ptr, w_desc, s_desc, w_rows, s_rows, row_ok, e,
                                             pid_n * BLOCK_N, a_ptr, route, r_ok, stride_am, k_lo, k_hi, K, BLOCK_N,
                                             BLOCK_K, BLOCK_T, USE_DOT, USE_TMA, FAST_DECODE, EVICT_FIRST, EVEN_K,
                                             NUM_STAGES, SHIFT_DECODE, K_WARPS)
            y = (acc * dec) * tl.load(tw_ptr + route, mask=r_ok, other=0.0)[None, :]
            mask = row_ok[:, None] & r_ok[None, :]
            if DETERMINISTIC:  # one fp32 row per route, summed in slot order by the sum kernel
                tl.store(ws_ptr + route[None, :].to(tl.int64) * H + rows[:, None], y, mask=mask)
            else:
                # fp32 atomics into the token's row of the workspace (zeroed by the gate_up kernel); the program
                # whose add completes a token's tile (the last of its local experts, counted in cnt) casts it.
                tok = route // top_k
                ws_tile = ws_ptr + tok[None, :].to(tl.int64) * H + rows[:, None]
                tl.atomic_add(ws_tile, y, mask=mask, sem="relaxed")
                tl.debug_barrier()  # every thread's adds before the release of the count
                done = tl.atomic_add(cnt_ptr + tok * num_n + pid_n, 1, mask=r_ok, sem="acq_rel")
                n_local = _local_slots(ids_ptr, map_ptr, tok, S, E, GLOBAL_E, top_k, HAS_MAP, TOPK_BLOCK)
                last = r_ok & (done == n_local * SPLIT_K - 1)
                tl.debug_barrier()
                # .cg: the sum is in L2; this SM's L1 may hold a stale copy of a line shared with another tile.
                total = tl.load(ws_tile, mask=row_ok[:, None] & last[None, :], other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + tok[None, :].to(tl.int64) * stride_om + rows[:, None],
                         total.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & last[None, :])


@triton.jit
def _moe_decode_sum_kernel(
    src_ptr, ids_ptr, map_ptr, dst_ptr,
    H, S, E, GLOBAL_E, top_k, stride_dst,
    HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``dst[t] = sum over the token's slots with a local expert of src[t * top_k + slot]`` in slot order (rows of
    other ranks' routes were never written)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for slot in range(top_k):
        r = t * top_k + slot
        e = local_expert(ids_ptr, map_ptr, r, S, E, GLOBAL_E, HAS_MAP)
        acc += tl.load(src_ptr + r * H + offs, mask=ok & (e >= 0), other=0.0)
    tl.store(dst_ptr + t * stride_dst + offs, acc.to(dst_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def route_block(routes: int) -> int:
    """The width of the kernels' route-id vector for a call of ``routes`` routes (a compile-time argument: one of
    a few buckets)."""
    return next(b for b in _ROUTE_BLOCKS if routes <= b)


def _sm90_plus(device) -> bool:
    """A GPU of sm_90 or later, not the interpreter: where the inline PTX compiles (``mul.bf16x2``) and grid
    dependency control (``griddepcontrol``) exists."""
    import torch

    return device.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


_gdc_ok = _sm90_plus


def decode_for(cc_major: int, ptx_isa: int) -> int:
    """The decode a GPU of compute capability ``cc_major`` runs (sm_90 or later; ``ptx_isa`` as 92 for 9.2, the
    version Triton emits for it): the native convert where both the GPU (sm_100+, incl. sm_120) and the PTX ISA have
    it for bf16 *and* fp16 (9.2: one rule for both types), else the PTX table / shift decode.  Not a tuning choice:
    every decode gives the same bits."""
    return DECODE_CVT if cc_major >= 10 and ptx_isa >= 92 else DECODE_PTX


def decode_kind(device) -> int:
    """:data:`DECODE_TL` in the interpreter and before sm_90, else :func:`decode_for` this GPU and the ptxas Triton
    would use for it (a user may point Triton at another one, whose PTX ISA decides)."""
    import torch

    if not _sm90_plus(device):
        return DECODE_TL
    major = torch.cuda.get_device_capability(device)[0]
    return decode_for(major, _ptx_isa(major) if major >= 10 else 0)


@functools.cache
def _ptx_isa(cc_major: int) -> int:
    from .gluon_compat import ptx_isa_version

    return ptx_isa_version(cc_major * 10)


def shift_ok(k: int) -> bool:
    """Whether a bank with reduction size ``K`` may run the shift decode.  Its PTX takes the 4 code bytes Triton
    packs into one instance to be one memory word (elements j and j + 4 of a register pair come from it), which the
    layout Triton picks gives only when each thread's code loads are whole 16-byte vectors: when the JIT marks the
    rows' stride (``K / 2`` bytes) and the bank's address divisible by 16.  Elsewhere the table decode runs (bytewise:
    right for any packing).  On the H200 the shift decode was wrong at K = 336 and 80 (rows of 168 and 40 bytes) and
    right at K = 352, 512, 1408 and every checkpoint shape; the ready launchers also check the address per call
    (:class:`_Launches`)."""
    return k % 32 == 0


class _Launches:
    """A kernel's ready launches, one per key, made on first use: the strides the launch fixes (every integer of a
    ready launch is a fixed argument of its :class:`ReadyKernel`, so the per-call arguments are the tensors only)
    and, first, whether it runs the shift decode: the tile's where :func:`shift_ok` allows it, and the table decode
    for a call whose code bytes do not start 16-byte aligned.  The launchers read the strides per call (the flow's
    ready layer serves one signature, strides included, but the launchers do not rely on it)."""

    __slots__ = ("make", "made")

    def __init__(self, make):
        self.make, self.made = make, {}

    def __call__(self, key: tuple):
        launch = self.made.get(key)
        if launch is None:
            if len(self.made) >= 16:  # strides that change from call to call: a bound, not a cache of them all
                self.made.clear()
            launch = self.made[key] = self.make(*key)
        return launch


def _launch_key(shift: bool, a, codes, scale_bytes, out) -> tuple:
    """The :class:`_Launches` key of a decode launch: whether the shift decode runs (the tile's, and the codes start
    16-byte aligned), then the strides its ReadyKernel fixes (activation rows, the bank's codes and scales, out
    rows)."""
    return (shift and codes.data_ptr() % 16 == 0, a.stride(0), codes.stride(), scale_bytes.stride(), out.stride(0))


def _descriptors(name: str, codes, scale_bytes, parts: int, tile: DecodeTile):
    """``(w_desc, s_desc)`` kernel arguments: TMA descriptors over the bank viewed as ``[E * parts, rows / parts,
    K/2]`` (gate_up: parts 2, the gate and the up halves) when the tile asks for TMA, else the tensors (unused)."""
    if not tile.use_tma:
        return codes, scale_bytes
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, kh = codes.shape
    k = 2 * kh
    ok = tma_ok(k) and codes.stride(1) % 16 == 0 and codes.data_ptr() % 16 == 0 and scale_bytes.data_ptr() % 16 == 0
    ok = ok and scale_bytes.stride(1) % 16 == 0 and n % parts == 0
    if parts > 1:  # the [E * parts] view needs the experts' rows back to back
        ok = ok and codes.stride(0) == n * codes.stride(1) and scale_bytes.stride(0) == n * scale_bytes.stride(1)
    if not ok:
        raise ValueError(f"{name}_codes: use_tma needs K % 256 == 0, 16-byte aligned rows and row-contiguous experts, "
                         f"got shape {list(codes.shape)} strides {codes.stride()} (scales {scale_bytes.stride()})")
    rows = n // parts
    w_desc = TensorDescriptor(codes, [e * parts, rows, kh], [rows * codes.stride(1), codes.stride(1), 1],
                              [parts, tile.block_n, tile.block_k // 2])
    s_desc = TensorDescriptor(scale_bytes, [e * parts, rows, k // 16],
                              [rows * scale_bytes.stride(1), scale_bytes.stride(1), 1],
                              [parts, tile.block_n, tile.block_k // 16])
    return w_desc, s_desc


def moe_decode_gate_up(
    x, w13_codes, w13_scales, w13_dec, topk_ids, *, tile: DecodeTile, expert_map=None, activation: str = "silu",
    out=None, zero=None, check_ids: bool = False, down_bank=None,
):
    """``act(x[t] @ w13[e, :I]^T * dec) * (x[t] @ w13[e, I:]^T * dec)`` per route → intermediate ``[T * top_k, I]``
    in ``x.dtype`` (rows of routes without a local expert are left unwritten).

    ``x [T, H]`` bf16/fp16 (rows may be strided); ``topk_ids [T, top_k]`` int32/int64 global ids, mapped by
    ``expert_map [global_E]`` int32 (-1: another rank's expert).  ``zero``: an fp32 tensor (any shape, contiguous)
    the kernel's programs zero before any other work, e.g. the accumulator of :func:`moe_decode_down_expert`'s
    atomic mode, saving a memset launch.  ``down_bank``: ``(w2_codes [E, H, I/2], w2_scales [E, H, I/16], w2_dec)``,
    the bank a ``prefetch_down`` tile prefetches (required by such a tile, read by no other).
    """
    w_sf, e, h, i, t, k, global_e, emap, has_map, out = check_gate_up_inputs(
        x, w13_codes, w13_scales, w13_dec, topk_ids, expert_map, activation, out, zero, check_ids)
    s = t * k
    tile.check_rows(2 * tile.block_n, "gate_up")
    w2 = w2_sf = None
    if tile.prefetch_down:
        if down_bank is None:
            raise ValueError("down_bank: a prefetch_down tile needs the down bank (w2_codes, w2_scales, w2_dec)")
        w2 = down_bank[0]
        w2_sf = _check_bank("w2", *down_bank, h, i, x.device)[0]
        if w2.shape[0] != e:
            raise ValueError(f"w2_codes: expected {e} experts (as w13_codes), got shape {list(w2.shape)}")
    if s == 0:
        if zero is not None:
            zero.zero_()
        return out
    run = prepare_moe_decode_gate_up(t, h, i, e, k, global_e, x.device, tile=tile, activation=activation,
                                     has_map=has_map, zero_numel=None if zero is None else zero.numel())
    return run(x, w13_codes, w_sf, w13_dec, topk_ids, emap, out, zero, w2, w2_sf)


def _check_down_tile(tile: DecodeTile, kernel: str, deterministic: bool) -> None:
    if tile.prefetch_down:
        raise ValueError(f"tile: prefetch_down is a gate_up switch; the {kernel} kernel has none")
    if tile.split_k != 1 and (kernel != "down_expert" or deterministic):
        raise ValueError(f"tile: split_k is for the gate_up and the atomic expert-major down; the {kernel} kernel"
                         f"{' in deterministic mode' if deterministic else ''} has none (got {tile.split_k})")


def _check_down(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, expert_map, check_ids, out,
                tile: DecodeTile, kernel: str, deterministic: bool = False):
    """The Triton down launchers' checks (:func:`.moe_decode_checks.check_down_inputs` and the tile's)."""
    checked = check_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, expert_map, check_ids, out)
    tile.check_rows(tile.block_n, kernel)
    _check_down_tile(tile, kernel, deterministic)
    return checked


def moe_decode_down_token(
    inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, *, tile: DecodeTile, expert_map=None, out=None,
    check_ids: bool = False,
):
    """``out [T, H] = sum over slots of topk_weight * w2_dec[e] * (inter[route] @ w2[e]^T)`` in ``inter.dtype``:
    token-major, fp32 sum in slot order (bit-identical run to run), no atomics, no zeroing."""
    w_sf, e, h, i, t, k, global_e, emap, has_map, out = _check_down(
        inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, expert_map, check_ids, out, tile, "down_token")
    if t == 0:
        return out
    run = prepare_moe_decode_down_token(t, h, i, e, k, global_e, inter.device, tile=tile, has_map=has_map)
    return run(inter, w2_codes, w_sf, w2_dec, topk_ids, emap, topk_weights, out)


def down_expert_workspace(t: int, top_k: int, h: int, tile: DecodeTile, deterministic: bool, device):
    """The fp32 workspace :func:`moe_decode_down_expert` needs, 1-D: atomic mode, the ``[T, H]`` fp32 sums and
    ``T * cdiv(H, tile.block_n)`` int32 tile counts (zero it, e.g. with ``moe_decode_gate_up(..., zero=ws)``);
    deterministic, the per-route rows ``[T * top_k, H]`` (no zeroing)."""
    import torch

    return torch.empty(_workspace_numel(t, top_k, h, tile, deterministic), dtype=torch.float32, device=device)


def _workspace_numel(t: int, top_k: int, h: int, tile: DecodeTile, deterministic: bool) -> int:
    return t * top_k * h if deterministic else t * h + t * triton.cdiv(h, tile.block_n)


def moe_decode_down_expert(
    inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, workspace, *, tile: DecodeTile, expert_map=None,
    deterministic: bool = False, out=None, check_ids: bool = False,
):
    """The down GEMM expert-major (each w2 block read once per call) with the top-k sum → ``out [T, H]``.

    Atomic mode: fp32 atomics into the zeroed ``workspace`` (:func:`down_expert_workspace`; the gate_up kernel can
    zero it: ``zero=workspace``), and the program completing a token's tile casts it into ``out``: one launch.
    ``deterministic``: per-route fp32 rows, then a sum kernel in slot order (bit-identical run to run).
    """
    import torch

    from ..format.checks import check_tensor

    w_sf, e, h, i, t, k, global_e, emap, has_map, out = _check_down(
        inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, expert_map, check_ids, out, tile, "down_expert",
        deterministic)
    check_tensor("workspace", workspace, dtype=torch.float32, shape=[_workspace_numel(t, k, h, tile, deterministic)],
                 device=inter.device)
    if t == 0:
        return out
    run = prepare_moe_decode_down_expert(t, h, i, e, k, global_e, inter.device, tile=tile, has_map=has_map,
                                         deterministic=deterministic)
    return run(inter, w2_codes, w_sf, w2_dec, topk_ids, emap, topk_weights, workspace, out)


def decode_gate_up(x, w13_codes, w13_scales, w13_dec, topk_ids, *, tile, expert_map=None, activation: str = "silu",
                   zero=None, check_ids: bool = False, down_bank=None):
    """The decode gate_up of ``tile``'s kernel: :func:`moe_decode_gate_up` for a :class:`DecodeTile`, the streaming
    Gluon one (``gluon_moe_decode.moe_stream_gate_up``, which prefetches nothing: ``down_bank`` unused) for a
    ``MoeStreamTile``."""
    if isinstance(tile, DecodeTile):
        return moe_decode_gate_up(x, w13_codes, w13_scales, w13_dec, topk_ids, tile=tile, expert_map=expert_map,
                                  activation=activation, zero=zero, check_ids=check_ids, down_bank=down_bank)
    from .gluon_moe_decode import moe_stream_gate_up

    return moe_stream_gate_up(x, w13_codes, w13_scales, w13_dec, topk_ids, tile=tile, expert_map=expert_map,
                              activation=activation, zero=zero, check_ids=check_ids)


def moe_decode(
    x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, *,
    gate_up_tile, down_tile, down: str = "token", expert_map=None, activation: str = "silu",
    deterministic: bool = False, out=None, check_ids: bool = False,
):
    """The whole decode MoE layer as the flow runs it: gate_up launcher → down launcher.

    ``gate_up_tile`` / ``down_tile``: a :class:`DecodeTile` (the Triton kernels) or a
    ``gluon_moe_decode.MoeStreamTile`` (the streaming Gluon kernels, ``T <= block_t``; the down expert-major with
    atomics only).

    ``down``: ``"token"`` (token-major, bit-identical run to run whatever ``deterministic`` says) or ``"expert"``
    (expert-major: fp32 atomics into a ``[T, H]`` buffer the gate_up kernel zeroes, or with ``deterministic``
    per-route rows summed in slot order).  Tiles explicit; buffers sized from shapes.
    """
    import torch

    from ..format.checks import check_tensor

    if down not in ("token", "expert"):
        raise ValueError(f"down: expected 'token' or 'expert', got {down!r}")
    check_tensor("topk_ids", topk_ids, ndim=2)
    check_tensor("w2_codes", w2_codes, ndim=3)
    stream_down = not isinstance(down_tile, DecodeTile)  # the streaming Gluon down (a MoeStreamTile)
    if stream_down and (down != "expert" or deterministic):
        raise ValueError("down_tile: the streaming down is expert-major with fp32 atomics (down='expert', not "
                         "deterministic)")
    ws = None
    if stream_down:
        from .gluon_moe_decode import down_workspace_numel

        ws = torch.empty(down_workspace_numel(x.shape[0], w2_codes.shape[1], down_tile), dtype=torch.float32,
                         device=x.device)
    elif down == "expert":
        ws = down_expert_workspace(x.shape[0], topk_ids.shape[1], w2_codes.shape[1], down_tile, deterministic,
                                   x.device)
    inter = decode_gate_up(x, w13_codes, w13_scales, w13_dec, topk_ids, tile=gate_up_tile, expert_map=expert_map,
                           activation=activation, zero=ws if (ws is not None and not deterministic) else None,
                           check_ids=check_ids, down_bank=(w2_codes, w2_scales, w2_dec))
    if stream_down:
        from .gluon_moe_decode import moe_stream_down

        return moe_stream_down(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, ws, tile=down_tile,
                               expert_map=expert_map, out=out)
    if down == "token":
        return moe_decode_down_token(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, tile=down_tile,
                                     expert_map=expert_map, out=out)
    return moe_decode_down_expert(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, ws, tile=down_tile,
                                  expert_map=expert_map, deterministic=deterministic, out=out)


# ---------------------------------------------------------------------------------------------------------------
# Ready launches: one call signature's grid and compile-time arguments fixed once (the validating launchers above
# call them; the MoE flow keeps them per signature).  They check nothing: their inputs are what the validating
# launchers pass (the scales as uint8 bytes, ``emap`` the map or any int32 tensor when ``has_map`` is false,
# T > 0).  The TMA descriptors are made per call: they hold the bank's address, which differs between layers of
# one signature (``_descriptors`` checks its alignment).  Every integer argument is fixed in the ready kernel, the
# strides per launch of :class:`_Launches` (read per call: a call with other strides gets its own launch).
# ---------------------------------------------------------------------------------------------------------------
def down_expert_workspace_numel(t: int, top_k: int, h: int, tile: DecodeTile, deterministic: bool) -> int:
    """fp32 elements of :func:`down_expert_workspace`."""
    return _workspace_numel(t, top_k, h, tile, deterministic)


def prepare_moe_decode_gate_up(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, *,
                               tile: DecodeTile, activation: str, has_map: bool, zero_numel: int | None):
    """``run(x, w13_codes, w13_sf, w13_dec, topk_ids, emap, out=None, zero=None, w2_codes=None, w2_sf=None) -> out
    [T * top_k, I]``; ``zero``: a tensor of ``zero_numel`` elements (None: no zeroing); ``w2_codes`` / ``w2_sf``
    (the down bank's codes and scale bytes): required by a ``prefetch_down`` tile."""
    import torch

    from .launch import ReadyKernel

    tile.check_rows(2 * tile.block_n, "gate_up")  # a tile passed without the validating launchers
    s = t * top_k
    rows = min(s, e)  # one grid row per slot, or per local expert when that is fewer programs
    grid = (rows, triton.cdiv(i, tile.block_n), tile.split_k)
    programs = grid[0] * grid[1]
    has_zero = zero_numel is not None
    zero_chunk = -(-zero_numel // programs) if has_zero else 0
    split = tile.split_k > 1
    shift = tile.shift_decode and shift_ok(h) and decode_kind(device) != DECODE_CVT  # (the cvt needs none)
    # A prefetch is a GPU instruction (the interpreter has none); it changes no result.
    prefetch = tile.prefetch_down and device.type == "cuda" and not _interpreting()
    pf_rows = prefetch_rows_per_program(h, grid[1] * grid[2])
    launches = _Launches(lambda shift, stride_x, stride_w, stride_sf, stride_o, stride_w2=(0, 0), stride_sf2=(0, 0):
                         ReadyKernel(
        _moe_decode_gate_up_kernel, grid, S=s, I=i, K=h, E=e, GLOBAL_E=global_e, top_k=top_k,
        zero_numel=zero_numel if has_zero else 0, zero_chunk=zero_chunk, stride_xt=stride_x,
        stride_we=stride_w[0], stride_wn=stride_w[1], stride_wse=stride_sf[0], stride_wsn=stride_sf[1],
        stride_om=stride_o, stride_w2e=stride_w2[0], stride_w2n=stride_w2[1], stride_w2se=stride_sf2[0],
        stride_w2sn=stride_sf2[1], ACTIVATION=activation, HAS_MAP=has_map, BY_EXPERT=rows < s, ZERO=has_zero,
        S_BLOCK=route_block(s), FAST_DECODE=decode_kind(device), EVEN_K=h % tile.block_k == 0,
        GDC=_gdc_ok(device), SPLIT_K=tile.split_k, **(tile.kernel_kwargs() | {"SHIFT_DECODE": shift}),
        PREFETCH_DOWN=prefetch, PF_ROWS=pf_rows, **tile.launch_kwargs(),
    ))

    def run(x, w13_codes, w_sf, w13_dec, topk_ids, emap, out=None, zero=None, w2_codes=None, w2_sf=None):
        if prefetch and w2_codes is None:
            raise ValueError("w2_codes: a prefetch_down tile needs the down bank")
        if w2_codes is None:  # unused without the prefetch
            w2_codes, w2_sf = w13_codes, w_sf
        if out is None:
            out = torch.empty((s, i), dtype=x.dtype, device=x.device)
        part = cnt = w13_dec  # unused without split_k
        if split:  # per-split partial sums (each slice fully written where read) and zeroed arrival counts
            part = torch.empty(tile.split_k * s * 2 * i, dtype=torch.float32, device=x.device)
            cnt = torch.zeros(rows * grid[1], dtype=torch.int32, device=x.device)
        w_desc, s_desc = _descriptors("w13", w13_codes, w_sf, 2, tile)
        key = _launch_key(shift, x, w13_codes, w_sf, out)
        if prefetch:
            key += (w2_codes.stride()[:2], w2_sf.stride()[:2])
        launch = launches(key)
        launch(x, w13_codes, w_sf, w_desc, s_desc, w13_dec, topk_ids, emap, out, zero if has_zero else w13_dec,
               part, cnt, w2_codes, w2_sf)
        return out

    return run


def prepare_moe_decode_down_token(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, *,
                                  tile: DecodeTile, has_map: bool):
    """``run(inter, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, out=None) -> out [T, H]``."""
    import torch

    from .launch import ReadyKernel

    tile.check_rows(tile.block_n, "down_token")  # a tile passed without the validating launchers
    gdc = _gdc_ok(device)
    shift = tile.shift_decode and shift_ok(i) and decode_kind(device) != DECODE_CVT  # (the cvt needs none)
    launches = _Launches(lambda shift, stride_a, stride_w, stride_sf, stride_o: ReadyKernel(
        _moe_decode_down_token_kernel, (t, triton.cdiv(h, tile.block_n)), S=t * top_k, H=h, K=i, E=e,
        GLOBAL_E=global_e, top_k=top_k, stride_am=stride_a, stride_we=stride_w[0], stride_wn=stride_w[1],
        stride_wse=stride_sf[0], stride_wsn=stride_sf[1], stride_om=stride_o, HAS_MAP=has_map,
        TOPK_BLOCK=max(2, triton.next_power_of_2(top_k)), FAST_DECODE=decode_kind(device),
        EVEN_K=i % tile.block_k == 0, PDL=tile.pdl and gdc, **(tile.kernel_kwargs() | {"SHIFT_DECODE": shift}),
        **tile.launch_kwargs(gdc),
    ))

    def run(inter, w2_codes, w_sf, w2_dec, topk_ids, emap, topk_weights, out=None):
        if out is None:
            out = torch.empty((t, h), dtype=inter.dtype, device=inter.device)
        w_desc, s_desc = _descriptors("w2", w2_codes, w_sf, 1, tile)
        launch = launches(_launch_key(shift, inter, w2_codes, w_sf, out))
        launch(inter, w2_codes, w_sf, w_desc, s_desc, w2_dec, topk_ids, emap, topk_weights, out)
        return out

    return run


def prepare_moe_decode_down_expert(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, *,
                                   tile: DecodeTile, has_map: bool, deterministic: bool):
    """``run(inter, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, workspace, out=None) -> out [T, H]``;
    ``workspace`` as :func:`down_expert_workspace` makes it (zeroed in atomic mode)."""
    import torch

    from .launch import ReadyKernel

    tile.check_rows(tile.block_n, "down_expert")  # a tile passed without the validating launchers
    _check_down_tile(tile, "down_expert", deterministic)
    s = t * top_k
    rows = min(s, e)
    gdc = _gdc_ok(device)
    shift = tile.shift_decode and shift_ok(i) and decode_kind(device) != DECODE_CVT  # (the cvt needs none)
    launches = _Launches(lambda shift, stride_a, stride_w, stride_sf, stride_o: ReadyKernel(
        _moe_decode_down_expert_kernel, (rows, triton.cdiv(h, tile.block_n), tile.split_k), S=s, H=h, K=i, E=e,
        GLOBAL_E=global_e, top_k=top_k, stride_am=stride_a, stride_we=stride_w[0], stride_wn=stride_w[1],
        stride_wse=stride_sf[0], stride_wsn=stride_sf[1], stride_om=stride_o, HAS_MAP=has_map, BY_EXPERT=rows < s,
        DETERMINISTIC=deterministic, S_BLOCK=route_block(s), TOPK_BLOCK=max(2, triton.next_power_of_2(top_k)),
        FAST_DECODE=decode_kind(device), EVEN_K=i % tile.block_k == 0, PDL=tile.pdl and gdc, SPLIT_K=tile.split_k,
        **(tile.kernel_kwargs() | {"SHIFT_DECODE": shift}), **tile.launch_kwargs(gdc),
    ))
    block_h = min(_SUM_BLOCK_H, triton.next_power_of_2(h))
    sums = _Launches(lambda stride_o: ReadyKernel(
        _moe_decode_sum_kernel, (t, triton.cdiv(h, block_h)), H=h, S=s, E=e, GLOBAL_E=global_e, top_k=top_k,
        stride_dst=stride_o, HAS_MAP=has_map, BLOCK_H=block_h, num_warps=4))
    th = t * h

    def run(inter, w2_codes, w_sf, w2_dec, topk_ids, emap, topk_weights, workspace, out=None):
        if out is None:
            out = torch.empty((t, h), dtype=inter.dtype, device=inter.device)
        # Atomic mode: the sums are the workspace's first t * h elements (the kernel reads only its address there).
        counts = workspace.view(torch.int32) if deterministic else workspace[th:].view(torch.int32)
        w_desc, s_desc = _descriptors("w2", w2_codes, w_sf, 1, tile)
        launch = launches(_launch_key(shift, inter, w2_codes, w_sf, out))
        launch(inter, w2_codes, w_sf, w_desc, s_desc, w2_dec, topk_ids, emap, topk_weights, workspace, counts, out)
        if deterministic:
            sums((out.stride(0),))(workspace, topk_ids, emap, out)
        return out

    return run
