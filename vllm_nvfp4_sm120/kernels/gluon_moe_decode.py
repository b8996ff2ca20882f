"""Streaming MoE decode GEMMs (Gluon, tensor cores): the streaming W4A16 kernel's decode loop over the routed experts.

One kernel, two modes, for calls of at most ``block_t`` tokens:

* gate_up (:func:`moe_stream_gate_up`): the result of :func:`.moe_decode.moe_decode_gate_up` (the intermediate
  ``[T * top_k, I]``, one row per route, ``act(gate * dec) * (up * dec)``; rows of routes without a local expert left
  unwritten; an optional fp32 buffer zeroed for the atomic down kernel).
* down (:func:`moe_stream_down`): the atomic mode of :func:`.moe_decode.moe_decode_down_expert` (each route's
  product times its routing weight added by fp32 atomics into its token's sums, which the gate_up kernel zeroes; the
  add that completes a token's row tile, counted per token and tile, casts it into ``out``; tokens without a local
  expert get zeros; or, with :attr:`MoeStreamTile.late_cast`, the last CTA to finish casts all of them).  The order
  of a token's experts in its sums varies run to run: no deterministic mode.

What differs from the Triton decode kernels is the loop: they decode a weight tile into one layout and hand it to
``tl.dot`` through another, while this kernel runs the step of :mod:`.gluon_gemv_stream` (each lane's 16-byte code
load decoded straight into its MMA operand fragment, the k order relabelled on both operands): 25.8 SASS
instructions per code word on sm_90 for the 32 x 8 tile against the Triton gate_up loop's 31.6.

Work list and grid
    The distinct local experts of the call, in the order of their first route slot, each split into row tiles (gate_up:
    ``BLOCK_M / 2`` intermediate columns, its gate rows then the same columns' up rows, since the gated activation
    needs both in one program; down: ``BLOCK_M`` rows of H) and each row tile into 128-k blocks.  Every CTA finds the
    experts itself from the routing ids (``[S, S]`` compares: no host sync, no extra launch), so the list's length is
    a device value, but the grid is fixed (``ctas``, as many as fit on the GPU): CTA ``p`` takes blocks
    ``[p * total // ctas, (p + 1) * total // ctas)`` of the list, the stream-K split of :mod:`.gluon_gemv_stream`
    (with ``ctas`` lowered to ``total`` where the list is shorter than the grid).  A row tile shared by several CTAs
    is finished by the last to arrive, summing the fp32 partials in CTA order (bit-identical run to run).

Tokens
    Every route of an expert is one column of the MMA (``BLOCK_T`` = 8 or 16), so a call of ``T <= BLOCK_T`` tokens
    reads each touched expert's bytes once; the launchers refuse larger calls (the MoE decode table sends them
    elsewhere).

The precision contract is the streaming kernel's: products exact, fp32 sums, one rounding of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .common import register_cap_option
from .gluon_compat import HAS_GLUON, gl, gluon, require_gluon
from .gluon_gemv_stream import DECODE_NAMES, K_BLOCK, check_stream_step, default_stream_decode

if HAS_GLUON:
    from .gluon_gemv_stream import (_EPILOGUE_SHIFT, _lane_offsets, _reduce_tile, _run_bases, _run_first,
                                    _run_last, _run_product, _run_span, _run_steps, _slot_offsets)


@dataclass(frozen=True)
class MoeStreamTile:
    """``block_m`` weight rows per row tile (gate_up: ``block_m / 2`` gate rows and the same columns' up rows; down:
    ``block_m`` rows of H), ``block_t`` routes per expert at most (the MMA's N: 8 or 16), warps as in
    :class:`.gluon_gemv_stream.StreamTile`;
    ``ctas_per_sm``: the fixed grid is that many CTAs per SM of the GPU (as many as its registers let one SM hold,
    so the whole grid runs at once);
    ``row_pointers``: 64-bit row pointers per run instead of 32-bit offsets on a base (see
    :func:`.gluon_gemv_stream._run_product`): fewer address instructions, a few more registers;
    ``late_cast`` (the down; the gate_up ignores it): each run's products go straight into the fp32 sums, with no
    partial sums for row tiles shared by CTAs and no count per token and row tile, and the last CTA to finish (one
    arrival per CTA) casts the whole ``[T, H]`` sums into the output: a run ends with its atomic adds instead of a
    chain of dependent round trips to L2 (partial store, count, sum load), paid once per CTA instead;
    ``overlap_runs``: each run's first step is loaded before the previous run's last step and epilogue, and the
    routing is recomputed only where the expert changes: a CTA's short runs (a few 128-k blocks per row tile where
    K is small) keep loads in flight across their boundaries instead of draining at each;
    ``prefetch``: steps a warp has loaded ahead of the one it decodes, 1 or 2 (2: three register buffers, see
    :func:`.gluon_gemv_stream._run_steps_deep`; not with ``overlap_runs``)."""

    block_m: int
    block_t: int
    num_warps: int = 4
    row_warps: int = 1
    max_regs: int | None = None
    ctas_per_sm: int = 2
    row_pointers: bool = False
    late_cast: bool = False
    overlap_runs: bool = False
    prefetch: int = 1

    def __post_init__(self):
        check_stream_step(self)
        if not 1 <= self.ctas_per_sm <= 32:
            raise ValueError(f"MoeStreamTile: ctas_per_sm = {self.ctas_per_sm} (expected 1..32)")

    def ctas(self, device) -> int:
        """The grid on ``device``'s GPU."""
        return self.ctas_per_sm * torch.cuda.get_device_properties(device).multi_processor_count

    @property
    def columns(self) -> int:
        """Intermediate columns per row tile."""
        return self.block_m // 2

    @property
    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, **register_cap_option("MoeStreamTile", self.max_regs)}

    @property
    def constexprs(self) -> dict:
        """The kernel's compile-time arguments this tile sets."""
        return dict(BLOCK_M=self.block_m, BLOCK_T=self.block_t, WARPS=self.num_warps, ROW_WARPS=self.row_warps,
                    ROW_POINTERS=self.row_pointers, LATE_CAST=self.late_cast,
                    OVERLAP_RUNS=self.overlap_runs, PREFETCH=self.prefetch)


@dataclass(frozen=True)
class MoeStreamGrid:
    """The largest work list a call of this shape can have, and what the workspace is sized from."""

    tiles_e: int  # row tiles per expert
    blocks_per_row: int  # 128-k blocks per row (NB)
    max_experts: int  # distinct local experts a call can touch: min(T * top_k, E)
    ctas: int
    slots_per_cta: int  # most row tiles one CTA's range can touch

    @property
    def counters_numel(self) -> int:
        return self.max_experts * self.tiles_e

    def partials_numel(self, tile: MoeStreamTile) -> int:
        return self.ctas * self.slots_per_cta * tile.block_m * tile.block_t


def moe_stream_grid(routes: int, experts: int, n: int, k: int, tile: MoeStreamTile, ctas: int, *,
                    down: bool = False) -> MoeStreamGrid:
    """The gate_up's (``n = I`` columns, ``k = H``) or the down's (``down``: ``n = H`` rows, ``k = I``) largest list;
    ``ctas`` clamped to at least one; slots sized for the longest range the largest list gives (a shorter list gives
    shorter ranges, which touch no more row tiles)."""
    tiles_e = triton.cdiv(n, tile.block_m if down else tile.columns)
    nb = triton.cdiv(k, K_BLOCK)
    max_experts = max(1, min(routes, experts))
    total = max_experts * tiles_e * nb
    ctas = max(1, int(ctas))
    if total * ctas >= 2**31:
        raise ValueError(f"moe stream: {total} blocks x {ctas} CTAs overflows the kernel's 32-bit range arithmetic")
    longest = triton.cdiv(total, ctas)
    slots = triton.cdiv(max(longest - 1, 0), nb) + 1
    return MoeStreamGrid(tiles_e, nb, max_experts, ctas, slots)


def down_workspace_numel(t: int, h: int, tile: MoeStreamTile) -> int:
    """fp32 elements of the streaming down's workspace: the ``[T, H]`` fp32 sums, then one int32 count per token and
    row tile, or with ``late_cast`` one count of the CTAs that finished (zero it before the call, e.g. by the gate_up
    kernel's ``zero``)."""
    return t * h + (1 if tile.late_cast else t * triton.cdiv(h, tile.block_m))


def route_block(routes: int) -> int:
    """The routing vector's width, a power of two >= 32 (one compile per bucket): the slot dimension of the
    kernel's routing compares then covers a warp's 32 lanes without replicated lanes (the GPU tests ran this)."""
    return max(32, triton.next_power_of_2(routes))


# For the compile harness: argument types as the launchers pass them (bf16 activations).
MOE_STREAM_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wdec_ptr": "*fp32", "ids_ptr": "*i32", "map_ptr": "*i32",
    "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "zero_ptr": "*fp32", "tw_ptr": "*fp32",
    "acc_ptr": "*fp32", "tcnt_ptr": "*i32",
    "stride_xt": "i32", "stride_we": "i32", "stride_ww": "i32", "stride_wse": "i32", "stride_wsn": "i32",
    "stride_om": "i32", "S": "i32", "N": "i32", "K": "i32", "E": "i32", "GLOBAL_E": "i32", "top_k": "i32",
    "tiles_e": "i32", "slots_per_cta": "i32", "zero_numel": "i32", "zero_chunk": "i32",
    "DOWN": "constexpr", "ACTIVATION": "constexpr", "HAS_MAP": "constexpr", "ZERO": "constexpr",
    "S_BLOCK": "constexpr", "DECODE": "constexpr", "EVEN_K": "constexpr", "BLOCK_M": "constexpr",
    "BLOCK_T": "constexpr", "WARPS": "constexpr", "ROW_WARPS": "constexpr", "ROW_POINTERS": "constexpr",
    "LATE_CAST": "constexpr", "OVERLAP_RUNS": "constexpr", "PREFETCH": "constexpr",
}
MOE_STREAM_DIVISIBLE = [k for k, v in MOE_STREAM_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_xt", "stride_we", "stride_ww", "stride_wse", "stride_wsn", "stride_om",
]


if HAS_GLUON:

    @gluon.jit
    def _local_ids(ids_ptr, map_ptr, offs, S, E, GLOBAL_E, HAS_MAP: gl.constexpr):
        """Local expert of each route slot in ``offs``; -1 past S, for another rank's expert, or an id out of range."""
        ids = gl.load(ids_ptr + offs, mask=offs < S, other=-1).to(gl.int32)
        if HAS_MAP:
            known = (ids >= 0) & (ids < GLOBAL_E)
            ids = gl.load(map_ptr + ids, mask=known, other=-1).to(gl.int32)
        return gl.where((ids >= 0) & (ids < E), ids, -1)

    @gluon.jit
    def _route_list(ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP: gl.constexpr, S_BLOCK: gl.constexpr, R2: gl.constexpr):
        """The call's distinct local experts, in the order of their first route slot, as vectors over the slots
        (``SliceLayout(0, R2)``): ``(offs_b, ids_b, before_b, nth_b, n_e)``, the slot, its local expert (-1 for none),
        the routes to the same expert in earlier slots, the 1-based rank of a first slot among the first slots (0
        elsewhere) and the number of distinct experts."""
        offs_a = gl.arange(0, S_BLOCK, layout=gl.SliceLayout(1, R2))
        offs_b = gl.arange(0, S_BLOCK, layout=gl.SliceLayout(0, R2))
        ids_a = _local_ids(ids_ptr, map_ptr, offs_a, S, E, GLOBAL_E, HAS_MAP)
        ids_b = _local_ids(ids_ptr, map_ptr, offs_b, S, E, GLOBAL_E, HAS_MAP)
        # (scans have no layout here for these vectors: sums over [slot, slot] compares instead)
        earlier = ((ids_a[:, None] == ids_b[None, :]) & (offs_b[None, :] < offs_a[:, None])).to(gl.int32)
        before_a = gl.sum(earlier, axis=1)  # routes to the same expert in earlier slots
        first_a = (ids_a >= 0) & (before_a == 0)
        first_b = gl.convert_layout(first_a, gl.SliceLayout(0, R2))
        before_b = gl.convert_layout(before_a, gl.SliceLayout(0, R2))
        # Only the slot-b vectors stay live through the callers' loops (a lane holds S_BLOCK / 32 slots of them,
        # against S_BLOCK / WARPS of the slot-a ones).
        nth_a = gl.sum((first_b[None, :] & (offs_b[None, :] <= offs_a[:, None])).to(gl.int32), axis=1)
        nth_b = gl.convert_layout(gl.where(first_a, nth_a, 0), gl.SliceLayout(0, R2))
        return offs_b, ids_b, before_b, nth_b, gl.sum(first_a.to(gl.int32), axis=0)

    @gluon.jit
    def _list_blocks(pid, ctas, total, NB):
        """CTA ``pid``'s stream-K range of the call's ``total`` list blocks: ``(ctas, b_begin, b_end, first_tile)``,
        the grid clamped to the list.  The list can be shorter than the grid (a few experts of a narrow layer): then
        only the first ``total`` CTAs take a block each, so that every CTA between a tile's first and last holder
        contributes to it (the arrival count relies on that); the others find an empty range."""
        ctas = gl.maximum(gl.minimum(ctas, total), 1)
        b_begin = gl.minimum(pid, ctas) * total // ctas
        b_end = gl.minimum(pid + 1, ctas) * total // ctas
        return ctas, b_begin, b_end, b_begin // NB

    @gluon.jit
    def _gated(gate, up, ACTIVATION: gl.constexpr):
        """``act(gate) * up`` in fp32, the formulas of moe_common.gated_activation_f32."""
        if ACTIVATION == "silu":
            g = gate / (1.0 + gl.exp(-gate))
        else:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            g = 0.5 * gate * (2.0 - 2.0 / (gl.exp(2.0 * inner) + 1.0))
        return g * up

    @gluon.jit
    def _expert_run(b, b_end, NB, tiles_e, KW: gl.constexpr):
        """The run at block ``b`` (:func:`.gluon_gemv_stream._run_span`) and its list tile's expert rank q and row
        tile j: ``(tile, run_end, kb0, kb_last, last, q, j)``."""
        tile, run_end, kb0, kb_last, last = _run_span(b, b_end, NB, KW)
        q = tile // tiles_e
        return tile, run_end, kb0, kb_last, last, q, tile - q * tiles_e

    @gluon.jit
    def _expert_routes(q, nth_b, ids_b, before_b, offs_b, n_r, top_k, DOWN: gl.constexpr, XL: gl.constexpr):
        """The expert of rank q (``e``), its number of routes, each MMA column's route (column n: the expert's route
        with n earlier routes to it; columns past its routes read the first route's activations, an L1 hit, and
        store nothing) and each column's activation row (down: the route's intermediate row; gate_up: its token)."""
        e = gl.max(gl.where(nth_b == q + 1, ids_b, -1), axis=0)
        match = ids_b == e
        count = gl.sum(match.to(gl.int32), axis=0)
        route = gl.max(gl.where(match[None, :] & (before_b[None, :] == n_r[:, None]), offs_b[None, :], -1), axis=1)
        route = gl.where(n_r < count, route, gl.max(gl.where(match & (before_b == 0), offs_b, -1), axis=0))
        if DOWN:
            a_row = gl.convert_layout(route, gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        else:
            a_row = gl.convert_layout(route // top_k, gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        return e, count, route, a_row

    @gluon.jit
    def _tile_offsets(e, j, a_row, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, k_x, stride_xt, stride_we, stride_ww,
                      stride_wse, stride_wsn, N, DOWN: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr):
        """Row tile j of expert e: its code and scale bases and per-lane offsets, and the activations' offsets."""
        x_offs = a_row[None, :, None] * stride_xt + k_x
        if DOWN:  # rows j * BLOCK_M ..; rows past N re-read row N - 1
            wrow_c = gl.minimum(j * BLOCK_M + row_c, N - 1)
            wrow_s = gl.minimum(j * BLOCK_M + row_s, N - 1)
        else:  # gate rows j * HALF .., then the up rows I + j * HALF ..; columns past I re-read column I - 1
            wrow_c = (row_c // HALF) * N + gl.minimum(j * HALF + row_c % HALF, N - 1)
            wrow_s = (row_s // HALF) * N + gl.minimum(j * HALF + row_s % HALF, N - 1)
        return (w_ptr + e.to(gl.int64) * stride_we, wrow_c * stride_ww + k_c, ws_ptr + e.to(gl.int64) * stride_wse,
                wrow_s * stride_wsn + k_s, x_offs)

    @gluon.jit
    def _tile_first_step(e, j, a_row, kb0, kb_last, w_ptr, ws_ptr, x_ptr, row_c, row_s, w_c, w_s, w_x, k_c, k_s, k_x,
                         stride_xt, stride_we, stride_ww, stride_wse, stride_wsn, N, K, DOWN: gl.constexpr,
                         EVEN_K: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr, ROW_WARPS: gl.constexpr,
                         ROW_POINTERS: gl.constexpr):
        """The loads of the first step of a run over blocks ``kb0 .. kb_last`` of row tile j of expert e."""
        w_base, w_offs, s_base, s_offs, x_offs = _tile_offsets(e, j, a_row, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, k_x,
                                                               stride_xt, stride_we, stride_ww, stride_wse, stride_wsn,
                                                               N, DOWN, BLOCK_M, HALF)
        w_base, w_offs, s_base, s_offs, x_base, x_offs = _run_bases(w_base, w_offs, s_base, s_offs, x_ptr, x_offs,
                                                                    ROW_POINTERS)
        return _run_first(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, w_c, w_s, w_x, k_c, k_s, k_x,
                          K, EVEN_K, ROW_WARPS)

    @gluon.jit
    def _end_run(y, tile, e, route, count, j, pid, ctas, total, NB, first_tile, slots_per_cta, part_ptr, part_offs,
                 cnt_ptr, wdec_ptr, out_ptr, tw_ptr, acc_ptr, tcnt_ptr, ids_b, offs_b, stride_om, N, top_k, tiles_e,
                 DOWN: gl.constexpr, ACTIVATION: gl.constexpr, DECODE: gl.constexpr, LATE_CAST: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, HALF: gl.constexpr, O2: gl.constexpr,
                 R2: gl.constexpr, Y3: gl.constexpr):
        """A run's products ``y`` into the result: with the late cast straight into the sums; otherwise through the
        shared tile's partial sums, the CTA that completes the tile applying the epilogue."""
        if DOWN and LATE_CAST:  # this run's share of the tile straight into the sums
            _down_add(y * _expert_dec(wdec_ptr, e, DECODE), route, count, j, tw_ptr, acc_ptr, N, top_k, BLOCK_M,
                      BLOCK_T, O2)
        else:
            done, y = _reduce_tile(y, tile, pid, 0, ctas, total, NB, first_tile, slots_per_cta, part_ptr, part_offs,
                                   cnt_ptr + tile, BLOCK_M, BLOCK_T, O2)
            if done:
                dec = _expert_dec(wdec_ptr, e, DECODE)
                if DOWN:
                    _down_epilogue(y * dec, route, count, ids_b, offs_b, j, out_ptr, tw_ptr, acc_ptr, tcnt_ptr,
                                   stride_om, N, top_k, tiles_e, BLOCK_M, BLOCK_T, O2, R2)
                else:
                    _gate_up_epilogue(y * dec, route, count, j, out_ptr, stride_om, N, ACTIVATION, HALF, BLOCK_T, Y3)

    @gluon.jit
    def _moe_stream_kernel(
        x_ptr, w_ptr, ws_ptr, wdec_ptr, ids_ptr, map_ptr, out_ptr, part_ptr, cnt_ptr, zero_ptr, tw_ptr, acc_ptr,
        tcnt_ptr, stride_xt, stride_we, stride_ww, stride_wse, stride_wsn, stride_om,
        S, N, K, E, GLOBAL_E, top_k, tiles_e, slots_per_cta, zero_numel, zero_chunk,
        DOWN: gl.constexpr, ACTIVATION: gl.constexpr, HAS_MAP: gl.constexpr, ZERO: gl.constexpr,
        S_BLOCK: gl.constexpr, DECODE: gl.constexpr, EVEN_K: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, WARPS: gl.constexpr, ROW_WARPS: gl.constexpr,
        ROW_POINTERS: gl.constexpr, LATE_CAST: gl.constexpr, OVERLAP_RUNS: gl.constexpr,
        PREFETCH: gl.constexpr,
    ):
        # gate_up (DOWN false): N = I columns, a row tile = HALF gate rows + the same columns' up rows of w13[e],
        # activations x[token]; down: N = H rows of w2[e], activations inter[route], the routing weight and the
        # top-k sum in the epilogue (fp32 atomics into acc, a count per token and row tile in tcnt).
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        HALF: gl.constexpr = BLOCK_M // 2
        # The step's layouts, as in gluon_gemv_stream._stream_kernel.
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        W4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        S3: gl.constexpr = gl.SliceLayout(3, W4)
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        O2: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, WARPS], [0, 1])
        ACC_B: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 16, 2], [WARPS, 1, 1], [1, 2, 0])
        # gate / up halves of a row tile side by side in each thread, for the activation
        Y3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [16, 2, 1], [1, WARPS, 1], [2, 0, 1])
        # the routing: [slot a, slot b] compares, and [column n, slot] for the routes of an expert
        R2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0])
        ZL: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
        NB = gl.cdiv(K, 128)

        pid = gl.program_id(0)
        ctas = gl.num_programs(0)
        if ZERO:  # the atomic down kernel's accumulator, one slice per CTA, before anything else
            start = pid * zero_chunk
            for z0 in range(0, zero_chunk, 4 * 32 * WARPS):
                zo = z0 + gl.arange(0, 4 * 32 * WARPS, layout=ZL)
                gl.store(zero_ptr + start + zo, gl.zeros([4 * 32 * WARPS], gl.float32, ZL),
                         mask=(start + zo < zero_numel) & (zo < zero_chunk))

        # ---- the distinct local experts, in the order of their first slot
        offs_b, ids_b, before_b, nth_b, n_e = _route_list(ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP, S_BLOCK, R2)
        total = n_e * tiles_e * NB

        if DOWN and not LATE_CAST:  # a token none of whose slots has a local expert gets no tile: zeros, from CTA t
            for t in range(pid, S // top_k, ctas):
                if gl.sum(((offs_b // top_k == t) & (ids_b >= 0)).to(gl.int32), axis=0) == 0:
                    for h0 in range(0, N, 4 * 32 * WARPS):
                        ho = h0 + gl.arange(0, 4 * 32 * WARPS, layout=ZL)
                        gl.store(out_ptr + t.to(gl.int64) * stride_om + ho,
                                 gl.zeros([4 * 32 * WARPS], out_ptr.dtype.element_ty, ZL), mask=ho < N)

        # ---- per-lane offsets (as in the streaming kernel)
        w_c, k_c, row_c, w_s, k_s, row_s, w_x, _, k_x = _lane_offsets(WARPS, BMW, ROW_WARPS, BLOCK_T, 128, CL, S3, XL)
        n_r = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, R2))
        part_offs = _slot_offsets(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O2)), BLOCK_T, O2)

        ctas, b_begin, b_end, first_tile = _list_blocks(pid, ctas, total, NB)
        if not OVERLAP_RUNS:
            b = b_begin
            while b < b_end:
                tile, run_end, kb0, kb_last, last, q, j = _expert_run(b, b_end, NB, tiles_e, KW)
                e, count, route, a_row = _expert_routes(q, nth_b, ids_b, before_b, offs_b, n_r, top_k, DOWN, XL)
                w_base, w_offs, s_base, s_offs, x_offs = _tile_offsets(
                    e, j, a_row, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, k_x, stride_xt, stride_we, stride_ww,
                    stride_wse, stride_wsn, N, DOWN, BLOCK_M, HALF)
                y = _run_product(w_base, w_offs, s_base, s_offs, x_ptr, x_offs, kb0, kb_last, last, w_c, w_s, w_x,
                                 k_c, k_s, k_x, K, EVEN_K, DECODE, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, MMA, W4, A_OP,
                                 B_OP, ACC_B, O2, ROW_POINTERS, PREFETCH)
                _end_run(y, tile, e, route, count, j, pid, ctas, total, NB, first_tile, slots_per_cta, part_ptr,
                         part_offs, cnt_ptr, wdec_ptr, out_ptr, tw_ptr, acc_ptr, tcnt_ptr, ids_b, offs_b, stride_om,
                         N, top_k, tiles_e, DOWN, ACTIVATION, DECODE, LATE_CAST, BLOCK_M, BLOCK_T, HALF, O2, R2, Y3)
                b = run_end
        elif b_begin < b_end:
            # The same runs, but each run's first step is loaded before the previous run's last step and its
            # epilogue (the reduction and the atomics), so a short run's loads do not wait for the one before to
            # end; the routing is computed again only where the expert changes.  The run after the CTA's last
            # loads that run's last block again (an L1 / L2 hit), which keeps the loop free of a branch there.
            tile, run_end, kb0, kb_last, last, q, j = _expert_run(b_begin, b_end, NB, tiles_e, KW)
            e, count, route, a_row = _expert_routes(q, nth_b, ids_b, before_b, offs_b, n_r, top_k, DOWN, XL)
            words, sc, xv = _tile_first_step(e, j, a_row, kb0, kb_last, w_ptr, ws_ptr, x_ptr, row_c, row_s, w_c, w_s,
                                             w_x, k_c, k_s, k_x, stride_xt, stride_we, stride_ww, stride_wse,
                                             stride_wsn, N, K, DOWN, EVEN_K, BLOCK_M, HALF, ROW_WARPS, ROW_POINTERS)
            b = b_begin
            while b < b_end:
                # (the bases are derived again from (e, j) rather than carried from the previous iteration's
                # prefetch: a few integer instructions per run against live registers across the whole loop)
                tile, run_end, kb0, kb_last, last, q, j = _expert_run(b, b_end, NB, tiles_e, KW)
                w_base, w_offs, s_base, s_offs, x_offs = _tile_offsets(
                    e, j, a_row, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, k_x, stride_xt, stride_we, stride_ww,
                    stride_wse, stride_wsn, N, DOWN, BLOCK_M, HALF)
                w_base, w_offs, s_base, s_offs, x_base, x_offs = _run_bases(w_base, w_offs, s_base, s_offs, x_ptr,
                                                                            x_offs, ROW_POINTERS)
                acc, words, sc, xv = _run_steps(words, sc, xv, w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0,
                                                kb_last, last, w_c, w_s, w_x, k_c, k_s, k_x, K, EVEN_K, DECODE,
                                                WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, MMA, W4, A_OP, B_OP)
                # the next run's first step
                n_tile, n_end, n_kb0, n_kb_last, n_last, n_q, n_j = _expert_run(gl.minimum(run_end, b_end - 1),
                                                                                b_end, NB, tiles_e, KW)
                if n_q != q:
                    n_e, n_count, n_route, n_row = _expert_routes(n_q, nth_b, ids_b, before_b, offs_b, n_r, top_k,
                                                                  DOWN, XL)
                else:
                    n_e, n_count, n_route, n_row = e, count, route, a_row
                n_words, n_sc, n_xv = _tile_first_step(n_e, n_j, n_row, n_kb0, n_kb_last, w_ptr, ws_ptr, x_ptr, row_c,
                                                       row_s, w_c, w_s, w_x, k_c, k_s, k_x, stride_xt, stride_we,
                                                       stride_ww, stride_wse, stride_wsn, N, K, DOWN, EVEN_K, BLOCK_M,
                                                       HALF, ROW_WARPS, ROW_POINTERS)
                y = _run_last(words, sc, xv, acc, DECODE, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, W4, A_OP, B_OP, ACC_B,
                              O2)
                _end_run(y, tile, e, route, count, j, pid, ctas, total, NB, first_tile, slots_per_cta, part_ptr,
                         part_offs, cnt_ptr, wdec_ptr, out_ptr, tw_ptr, acc_ptr, tcnt_ptr, ids_b, offs_b, stride_om,
                         N, top_k, tiles_e, DOWN, ACTIVATION, DECODE, LATE_CAST, BLOCK_M, BLOCK_T, HALF, O2, R2, Y3)
                words, sc, xv = n_words, n_sc, n_xv
                e, count, route, a_row = n_e, n_count, n_route, n_row
                b = run_end

        if DOWN and LATE_CAST:  # every CTA arrives once (an empty range too); the last casts every token's sums
            gl.barrier()  # every thread's adds before the release of the count
            arrived = gl.atomic_add(tcnt_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == gl.num_programs(0) - 1:
                _cast_sums(acc_ptr, out_ptr, S // top_k, N, stride_om, WARPS)
                gl.atomic_xchg(tcnt_ptr, 0, sem="relaxed", scope="gpu")  # as the zeroed workspace had it

    @gluon.jit
    def _gate_up_epilogue(y, route, count, j, out_ptr, stride_om, I, ACTIVATION: gl.constexpr, HALF: gl.constexpr,
                          BLOCK_T: gl.constexpr, Y3: gl.constexpr):
        """[gate rows | up rows] x routes -> ``act(gate) * up`` into the intermediate rows of the routes."""
        # (column, route, gate / up) with both halves in one thread
        y3 = gl.convert_layout(y.reshape([2, HALF, BLOCK_T]).permute(1, 2, 0), Y3)
        gate, up = gl.split(y3)
        inter = gl.convert_layout(_gated(gate, up, ACTIVATION), gl.SliceLayout(2, Y3))
        cols = j * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, gl.SliceLayout(2, Y3)))
        n_o = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, gl.SliceLayout(2, Y3)))
        route_o = gl.convert_layout(route, gl.SliceLayout(0, gl.SliceLayout(2, Y3)))
        out_ptrs = out_ptr + route_o[None, :].to(gl.int64) * stride_om + cols[:, None]
        gl.store(out_ptrs, inter.to(out_ptr.dtype.element_ty), mask=(cols < I)[:, None] & (n_o < count)[None, :])

    @gluon.jit
    def _expert_dec(wdec_ptr, e, DECODE: gl.constexpr):
        """Expert ``e``'s decode global, with the power of two the shift decode's scale pairs left out."""
        dec = gl.load(wdec_ptr + e)
        if DECODE == 2:  # DECODE_SHIFT
            dec = dec * _EPILOGUE_SHIFT
        return dec

    @gluon.jit
    def _down_add(y, route, count, j, tw_ptr, acc_ptr, H, top_k, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr,
                  O2: gl.constexpr):
        """Rows ``j * BLOCK_M ..`` of each route's (partial) product, times its routing weight, added (fp32
        atomics) into its token's sums; returns the pointers of those sums."""
        n_o = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, O2))
        live = n_o < count
        route_o = gl.convert_layout(route, gl.SliceLayout(0, O2))
        rows = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O2))
        y = y * gl.load(tw_ptr + route_o, mask=live, other=0.0)[None, :]
        sums = acc_ptr + (route_o // top_k)[None, :].to(gl.int64) * H + rows[:, None]
        gl.atomic_add(sums, y, mask=(rows < H)[:, None] & live[None, :], sem="relaxed", scope="gpu")
        return sums

    @gluon.jit
    def _cast_sums(acc_ptr, out_ptr, T, H, stride_om, WARPS: gl.constexpr):
        """The whole ``[T, H]`` fp32 sums into ``out`` (tokens without a local expert get their zeroed sums), 8
        tokens by ``256 * WARPS`` columns per step: 16 16-byte loads in flight per thread."""
        CT: gl.constexpr = gl.BlockedLayout([8, 8], [1, 32], [1, WARPS], [1, 0])
        HB: gl.constexpr = 8 * 32 * WARPS
        t_r = gl.arange(0, 8, layout=gl.SliceLayout(1, CT))
        h_r = gl.arange(0, HB, layout=gl.SliceLayout(0, CT))
        for t0 in range(0, T, 8):
            tok = (t0 + t_r)[:, None]
            for h0 in range(0, H, HB):
                col = (h0 + h_r)[None, :]
                ok = (tok < T) & (col < H)
                # .cg: the sums are in L2; this SM's L1 may hold a stale line
                v = gl.load(acc_ptr + tok.to(gl.int64) * H + col, mask=ok, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + tok.to(gl.int64) * stride_om + col, v.to(out_ptr.dtype.element_ty), mask=ok)

    @gluon.jit
    def _down_epilogue(y, route, count, ids_b, offs_b, j, out_ptr, tw_ptr, acc_ptr, tcnt_ptr, stride_om, H, top_k,
                       tiles_h, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, O2: gl.constexpr,
                       R2: gl.constexpr):
        """Rows ``j * BLOCK_M ..`` of each route's product, times its routing weight, added (fp32 atomics) into its
        token's sums; the add that completes a token's tile (the last of its local experts, counted per token and
        row tile) casts the tile into the output.  The sums and counts are zeroed by the gate_up kernel."""
        sums = _down_add(y, route, count, j, tw_ptr, acc_ptr, H, top_k, BLOCK_M, BLOCK_T, O2)
        live = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, O2)) < count
        tok = gl.convert_layout(route, gl.SliceLayout(0, O2)) // top_k
        # local routes of each column's token (the count its tile waits for)
        tok_r = gl.convert_layout(tok, gl.SliceLayout(1, R2))
        n_local = gl.sum(((offs_b[None, :] // top_k == tok_r[:, None]) & (ids_b[None, :] >= 0)).to(gl.int32), axis=1)
        n_local = gl.convert_layout(n_local, gl.SliceLayout(0, O2))
        rows = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O2))
        row_ok = rows < H
        gl.barrier()  # every thread's adds before the release of the count
        arrived = gl.atomic_add(tcnt_ptr + tok * tiles_h + j, 1, mask=live, sem="acq_rel", scope="gpu")
        last = live & (arrived == n_local - 1)
        gl.barrier()
        # .cg: the sums are in L2; this SM's L1 may hold a stale line
        total = gl.load(sums, mask=row_ok[:, None] & last[None, :], other=0.0, cache_modifier=".cg")
        gl.store(out_ptr + tok[None, :].to(gl.int64) * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & last[None, :])


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------
def _ready(grid: MoeStreamGrid, tile: MoeStreamTile, device, dtype, decode, **const):
    from .launch import ReadyKernel, StreamCounters

    decode = default_stream_decode(torch.device(device), dtype) if decode is None else decode
    if decode not in DECODE_NAMES:
        raise ValueError(f"decode: expected one of {sorted(DECODE_NAMES)}, got {decode}")
    launch = ReadyKernel(
        _moe_stream_kernel, (grid.ctas,), tiles_e=grid.tiles_e, slots_per_cta=grid.slots_per_cta, DECODE=decode,
        **tile.constexprs, **const, **tile.launch_options)
    return launch, StreamCounters(grid.counters_numel, device), grid.partials_numel(tile)


def prepare_moe_stream_gate_up(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, dtype, *,
                               tile: MoeStreamTile, ctas: int, activation: str, has_map: bool,
                               zero_numel: int | None, decode: int | None = None):
    """A ready launch: ``run(x, w13_codes, w13_sf_u8, w13_dec, topk_ids, emap, out, zero, w2_codes, w2_sf) -> out
    [T * top_k, I]`` for ``T = t <= tile.block_t``: the Triton ready gate_up's call signature (the down bank, which
    only its prefetching tiles read, is unused here).  It checks nothing (:func:`moe_stream_gate_up` does); partial
    sums are a fresh buffer per call (every slot read is written first in the same launch), the arrival counters
    one zeroed tensor per CUDA stream that the kernel leaves zero."""
    if t > tile.block_t:
        raise ValueError(f"gate_up stream: T = {t} tokens exceed the tile's {tile.block_t} routes per expert")
    s = t * top_k
    grid = moe_stream_grid(s, e, i, h, tile, ctas)
    has_zero = zero_numel is not None
    launch, counters, partials = _ready(
        grid, tile, device, dtype, decode, S=s, N=i, K=h, E=e, GLOBAL_E=global_e, top_k=top_k,
        zero_numel=zero_numel if has_zero else 0, zero_chunk=-(-zero_numel // grid.ctas) if has_zero else 0,
        DOWN=False, ACTIVATION=activation, HAS_MAP=has_map, ZERO=has_zero, S_BLOCK=route_block(s),
        EVEN_K=h % K_BLOCK == 0)

    def run(x, w13_codes, w13_sf, w13_dec, topk_ids, emap, out=None, zero=None, w2_codes=None, w2_sf=None):
        if out is None:
            out = torch.empty((s, i), dtype=x.dtype, device=x.device)
        part = torch.empty(max(partials, 1), dtype=torch.float32, device=x.device)
        launch(x, w13_codes.view(torch.int32), w13_sf, w13_dec, topk_ids, emap, out, part, counters.get(),
               zero if has_zero else part, part, part, counters.get(), x.stride(0), w13_codes.stride(0) // 4,
               w13_codes.stride(1) // 4, w13_sf.stride(0), w13_sf.stride(1), out.stride(0))
        return out

    run.counters = counters
    return run


def prepare_moe_stream_down(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, dtype, *,
                            tile: MoeStreamTile, ctas: int, has_map: bool, decode: int | None = None):
    """A ready launch: ``run(inter, w2_codes, w2_sf_u8, w2_dec, topk_ids, emap, topk_weights, workspace, out=None) ->
    out [T, H]`` for ``T = t <= tile.block_t`` (the Triton expert-major ready down's call signature);
    ``workspace``: :func:`down_workspace_numel` fp32 elements, zero before the call.  It checks nothing
    (:func:`moe_stream_down` does)."""
    if t > tile.block_t:
        raise ValueError(f"down stream: T = {t} tokens exceed the tile's {tile.block_t} routes per expert")
    s = t * top_k
    grid = moe_stream_grid(s, e, h, i, tile, ctas, down=True)
    launch, counters, partials = _ready(
        grid, tile, device, dtype, decode, S=s, N=h, K=i, E=e, GLOBAL_E=global_e, top_k=top_k, zero_numel=0,
        zero_chunk=0, DOWN=True, ACTIVATION="silu", HAS_MAP=has_map, ZERO=False, S_BLOCK=route_block(s),
        EVEN_K=i % K_BLOCK == 0)

    def run(inter, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, workspace, out=None):
        if out is None:
            out = torch.empty((t, h), dtype=inter.dtype, device=inter.device)
        part = torch.empty(max(partials, 1), dtype=torch.float32, device=inter.device)
        cnt = counters.get()
        launch(inter, w2_codes.view(torch.int32), w2_sf, w2_dec, topk_ids, emap, out, part, cnt, part,
               topk_weights, workspace, workspace[t * h:].view(torch.int32), inter.stride(0),
               w2_codes.stride(0) // 4, w2_codes.stride(1) // 4, w2_sf.stride(0), w2_sf.stride(1), out.stride(0))
        return out

    run.counters = counters
    return run


def _check_words(name: str, codes) -> None:
    if codes.stride(1) % 4 or codes.stride(0) % 4:
        raise ValueError(f"{name}: strides {list(codes.stride())} bytes must be multiples of 4 (read as words)")


def moe_stream_gate_up(x, w13_codes, w13_scales, w13_dec, topk_ids, *, tile: MoeStreamTile, expert_map=None,
                       activation: str = "silu", out=None, zero=None, check_ids: bool = False,
                       decode: int | None = None):
    """:func:`.moe_decode.moe_decode_gate_up`'s result by the streaming Gluon kernel, for ``T <= tile.block_t``.

    Inputs are checked as the Triton launcher checks them; ``zero`` (fp32, contiguous) is zeroed by the kernel's
    CTAs first."""
    from .moe_decode_checks import check_gate_up_inputs

    require_gluon("moe_stream_gate_up")
    w_sf, e, h, i, t, k, global_e, emap, has_map, out = check_gate_up_inputs(
        x, w13_codes, w13_scales, w13_dec, topk_ids, expert_map, activation, out, zero, check_ids)
    _check_words("w13_codes", w13_codes)
    if t > tile.block_t:
        raise ValueError(f"x: T = {t} tokens exceed the tile's {tile.block_t} routes per expert "
                         f"(the streaming gate_up takes T <= block_t)")
    if t * k == 0:
        if zero is not None:
            zero.zero_()
        return out
    if x.device.type != "cuda":
        raise ValueError(f"x: the streaming gate_up runs on a CUDA GPU (Gluon has no interpreter), got {x.device}")
    run = prepare_moe_stream_gate_up(t, h, i, e, k, global_e, x.device, x.dtype, tile=tile, ctas=tile.ctas(x.device),
                                     activation=activation, has_map=has_map,
                                     zero_numel=None if zero is None else zero.numel(), decode=decode)
    return run(x, w13_codes, w_sf, w13_dec, topk_ids.reshape(-1), emap, out, zero)


def moe_stream_down(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, workspace, *, tile: MoeStreamTile,
                    expert_map=None, out=None, check_ids: bool = False, decode: int | None = None):
    """:func:`.moe_decode.moe_decode_down_expert`'s atomic mode by the streaming Gluon kernel, for ``T <=
    tile.block_t``: ``out [T, H] = sum over each token's local routes of topk_weight * (inter[route] @ w2[e]^T *
    dec)``.  ``workspace``: :func:`down_workspace_numel` fp32 elements, zeroed (the gate_up launchers' ``zero``).
    fp32 atomics: the sum order of a token's experts varies run to run (no deterministic mode)."""
    from ..format.checks import check_tensor
    from .moe_decode_checks import check_down_inputs

    require_gluon("moe_stream_down")
    w_sf, e, h, i, t, k, global_e, emap, has_map, out = check_down_inputs(
        inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, expert_map, check_ids, out)
    _check_words("w2_codes", w2_codes)
    if t > tile.block_t:
        raise ValueError(f"topk_ids: T = {t} tokens exceed the tile's {tile.block_t} routes per expert "
                         f"(the streaming down takes T <= block_t)")
    check_tensor("workspace", workspace, dtype=torch.float32, shape=[down_workspace_numel(t, h, tile)],
                 device=inter.device)
    if t == 0:
        return out
    if inter.device.type != "cuda":
        raise ValueError(f"inter: the streaming down runs on a CUDA GPU (Gluon has no interpreter), got {inter.device}")
    run = prepare_moe_stream_down(t, h, i, e, k, global_e, inter.device, inter.dtype, tile=tile,
                                  ctas=tile.ctas(inter.device), has_map=has_map, decode=decode)
    return run(inter, w2_codes, w_sf, w2_dec, topk_ids, emap, topk_weights, workspace, out)

