"""The streaming linear kernel's loads alone, on its grid: a timing probe for ``linear_decode_sweep.py``.

The read-only ceiling of the sweep reads the weight with a plain grid (one program per row tile and K split, many
waves).  The streaming kernel reads it with a one-wave stream-K grid: CTA ``p`` takes blocks ``[p * total // ctas,
(p + 1) * total // ctas)`` of the (row tile, 128-k block) list, as runs along K, each warp one block of its rows per
step, one step loaded ahead, and a row tile shared by CTAs summed by the last to arrive.  This kernel keeps all of
that (the same grid, the same per-lane loads of codes, scales and activations, the same two register buffers, the
same cross-CTA sums, reused from :mod:`vllm_nvfp4_sm120.kernels.gluon_gemv_stream`) and replaces the decode, the
scale arithmetic and the MMAs by a mask and an add per loaded word (9.2 SASS instructions per code word in the loop
on sm_90 at T <= 8, against the plan's 25.2).  Beside the plan and the read-only ceiling in one run it says whether
the bytes themselves arrive more slowly in this pattern (the probe near the plan) or the kernel's work between the
loads is what keeps the plan below the ceiling (the probe near the ceiling).

Unlike the decode probes of the streaming kernel, the result is checkable: each lane adds the low nibble of every
code word, scale byte and activation word it loads (adds within the lane: no shuffle in the loop), and a run ends
with the sum of its CTA's lanes, so a row tile's sum over its runs depends on the weight and the activations alone,
whatever the split (:func:`stream_loads_expected`; exact in fp32 below 2^24, which every layer of the sweep stays
under).  ``sums=False`` leaves out the cross-CTA sums as well (each run's sum is stored to its CTA's workspace slot,
nothing else): its output is not written and it is timed unchecked, beside the checked variant with the same loads.

K must be a multiple of 128 (every layer of the sweep): the probe has no K tail.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import REGISTERS_PER_SM
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs
from vllm_nvfp4_sm120.kernels.gluon_compat import HAS_GLUON, gl, gluon, require_gluon

from vllm_nvfp4_sm120.kernels.gluon_moe_decode import MoeStreamTile, moe_stream_grid, route_block

if HAS_GLUON:
    from vllm_nvfp4_sm120.kernels.gluon_gemv_stream import (_cta_blocks, _end_tile, _lane_offsets, _reduce_tile,
                                                            _row_tile, _run_span, _slot_offsets, _step_blocks,
                                                            _token_tile)
    from vllm_nvfp4_sm120.kernels.gluon_moe_decode import (_expert_routes, _expert_run, _list_blocks, _route_list,
                                                           _tile_offsets)

# Argument types as the launcher passes them (for the compile tests).
LOADS_SIGNATURE = {
    "x_ptr": "*i32", "w_ptr": "*i32", "ws_ptr": "*u8", "wdec_ptr": "*fp32", "out_ptr": "*fp32", "part_ptr": "*fp32",
    "cnt_ptr": "*i32", "T": "i32", "N": "i32", "K": "i32", "stride_xt": "i32", "stride_ww": "i32",
    "stride_wsn": "i32", "stride_ot": "i32", "total_blocks": "i32", "slots_per_cta": "i32",
    "LOAD_X": "constexpr", "SUMS": "constexpr", "BLOCK_M": "constexpr", "BLOCK_T": "constexpr",
    "WARPS": "constexpr", "ROW_WARPS": "constexpr",
}
LOADS_DIVISIBLE = [k for k, v in LOADS_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_xt", "stride_ww", "stride_wsn", "stride_ot",
]
MOE_LOADS_SIGNATURE = {
    "x_ptr": "*i32", "w_ptr": "*i32", "ws_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*fp32", "part_ptr": "*fp32",
    "cnt_ptr": "*i32", "stride_xt": "i32", "stride_we": "i32", "stride_ww": "i32", "stride_wse": "i32",
    "stride_wsn": "i32", "S": "i32", "N": "i32", "K": "i32", "E": "i32", "top_k": "i32", "tiles_e": "i32",
    "slots_per_cta": "i32", "DOWN": "constexpr", "LOAD_X": "constexpr", "SUMS": "constexpr", "S_BLOCK": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_T": "constexpr", "WARPS": "constexpr", "ROW_WARPS": "constexpr",
}
MOE_LOADS_DIVISIBLE = [k for k, v in MOE_LOADS_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_xt", "stride_we", "stride_ww", "stride_wse", "stride_wsn",
]

if HAS_GLUON:

    @gluon.jit
    def _loads(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb, LOAD_X: gl.constexpr):
        """A step's loads, as the streaming kernel's ``_load_step`` makes them (the activations as 32-bit words)."""
        words = gl.load(w_base + (w_offs + kb[0] * 16))
        sc = gl.load(s_base + (s_offs + kb[1] * 8))
        if LOAD_X:
            xw = gl.load(x_base + (x_offs + kb[2] * 64), eviction_policy="evict_last")
        else:
            xw = 0
        return words, sc, xw

    @gluon.jit
    def _lane_sum(v, GROUPS: gl.constexpr, PER_LANE: gl.constexpr):
        """``[WARPS, GROUPS * 8, 4 * PER_LANE]`` (8 x 4 lanes, each holding GROUPS x PER_LANE values) -> the sum of
        each lane's own values, ``[WARPS, 8, 4]``: adds within the lane only, no shuffle."""
        W: gl.constexpr = v.shape[0]
        return gl.sum(gl.sum(v.reshape([W, GROUPS, 8, 4, PER_LANE]), axis=4), axis=1)

    @gluon.jit
    def _add(words, sc, xw, acc_w, acc_s, acc_x, BMW: gl.constexpr, BLOCK_T: gl.constexpr, LOAD_X: gl.constexpr):
        """What the probe does with a step: the low nibble of each code word, scale byte and activation word, added
        to the lane's three sums."""
        acc_w += _lane_sum(words & 0xF, BMW // 8, 4)
        acc_s += _lane_sum(sc.to(gl.int32) & 0xF, BMW // 8, 2)
        if LOAD_X:
            acc_x += _lane_sum(xw & 0xF, BLOCK_T // 8, 16)
        return acc_w, acc_s, acc_x

    @gluon.jit
    def _loads_run(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, last, w_c, w_s, w_x,
                   LOAD_X: gl.constexpr, WARPS: gl.constexpr, ROW_WARPS: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_T: gl.constexpr, CL: gl.constexpr, S3: gl.constexpr, XW: gl.constexpr, O2: gl.constexpr):
        """One run, step for step the streaming kernel's (``_run_first`` / ``_run_steps`` / ``_run_last``): returns
        the run's total (its rows' and its token tile's nibbles), in every entry of a ``[BLOCK_M, BLOCK_T]`` fp32
        tile in ``O2``."""
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        kb_w, kb_s, kb_x = kb0 + w_c // ROW_WARPS, kb0 + w_s // ROW_WARPS, kb0 + w_x // ROW_WARPS
        acc_w = _lane_sum(gl.zeros([WARPS, BMW, 16], gl.int32, CL), BMW // 8, 4)
        acc_s = _lane_sum(gl.zeros([WARPS, BMW, 8], gl.int32, S3), BMW // 8, 2)
        acc_x = _lane_sum(gl.zeros([WARPS, BLOCK_T, 64], gl.int32, XW), BLOCK_T // 8, 16)
        words_a, sc_a, x_a = _loads(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                    _step_blocks(kb_w, kb_s, kb_x, 0, kb_last), LOAD_X)
        for i in range(0, last - 1, 2):  # pairs of steps before the last: every warp has a block
            words_b, sc_b, x_b = _loads(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                        _step_blocks(kb_w, kb_s, kb_x, (i + 1) * KW, kb_last), LOAD_X)
            acc_w, acc_s, acc_x = _add(words_a, sc_a, x_a, acc_w, acc_s, acc_x, BMW, BLOCK_T, LOAD_X)
            words_a, sc_a, x_a = _loads(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                        _step_blocks(kb_w, kb_s, kb_x, (i + 2) * KW, kb_last), LOAD_X)
            acc_w, acc_s, acc_x = _add(words_b, sc_b, x_b, acc_w, acc_s, acc_x, BMW, BLOCK_T, LOAD_X)
        if last % 2 == 1:
            words_b, sc_b, x_b = _loads(w_base, w_offs, s_base, s_offs, x_base, x_offs,
                                        _step_blocks(kb_w, kb_s, kb_x, last * KW, kb_last), LOAD_X)
            acc_w, acc_s, acc_x = _add(words_a, sc_a, x_a, acc_w, acc_s, acc_x, BMW, BLOCK_T, LOAD_X)
            words_a, sc_a, x_a = words_b, sc_b, x_b
        # The last step: the surplus warps' blocks are clamped re-reads, which add nothing.
        words_a = gl.where(kb_w + last * KW <= kb_last, words_a, 0)
        sc_a = gl.where(kb_s + last * KW <= kb_last, sc_a, 0)
        if LOAD_X:
            x_a = gl.where(kb_x + last * KW <= kb_last, x_a, 0)
        acc_w, acc_s, acc_x = _add(words_a, sc_a, x_a, acc_w, acc_s, acc_x, BMW, BLOCK_T, LOAD_X)
        # One number per run: the tile's rows and the token tile's activations together.
        total = gl.sum(gl.sum(gl.sum(acc_w, axis=2), axis=1), axis=0) + gl.sum(gl.sum(gl.sum(acc_s, axis=2), axis=1),
                                                                               axis=0)
        total += gl.sum(gl.sum(gl.sum(acc_x, axis=2), axis=1), axis=0)
        return gl.full([BLOCK_M, BLOCK_T], 0.0, gl.float32, O2) + total.to(gl.float32)

    @gluon.jit
    def _stream_loads_kernel(
        x_ptr, w_ptr, ws_ptr, wdec_ptr, out_ptr, part_ptr, cnt_ptr,
        T, N, K, stride_xt, stride_ww, stride_wsn, stride_ot, total_blocks, slots_per_cta,
        LOAD_X: gl.constexpr, SUMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr,
        WARPS: gl.constexpr, ROW_WARPS: gl.constexpr,
    ):
        # The streaming kernel's layouts and offsets (gluon_gemv_stream._stream_kernel), the activations as words.
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        W4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        S3: gl.constexpr = gl.SliceLayout(3, W4)
        XW: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        O2: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, WARPS], [0, 1])
        NB = K // 128

        pid = gl.program_id(0)
        pid_t = gl.program_id(1)
        ctas = gl.num_programs(0)
        tiles_m = gl.cdiv(N, BLOCK_M)
        w_c, k_c, row_c, w_s, k_s, row_s, w_x, n_x, k_x = _lane_offsets(WARPS, BMW, ROW_WARPS, BLOCK_T, 64, CL, S3, XW)
        x_base, x_offs, rows_o, toks_o, part_offs = _token_tile(x_ptr, pid_t, T, stride_xt, n_x, k_x, BLOCK_M, BLOCK_T,
                                                                O2)
        b_begin, b_end, first_tile = _cta_blocks(pid, ctas, total_blocks, NB)
        b = b_begin
        while b < b_end:
            tile, run_end, kb0, kb_last, last = _run_span(b, b_end, NB, KW)
            w_base, w_offs, s_base, s_offs = _row_tile(tile, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, N, stride_ww,
                                                       stride_wsn, BLOCK_M)
            y = _loads_run(w_base, w_offs, s_base, s_offs, x_base, x_offs, kb0, kb_last, last, w_c, w_s, w_x,
                           LOAD_X, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, CL, S3, XW, O2)
            if SUMS:
                _end_tile(y, tile, pid, pid_t, ctas, total_blocks, NB, first_tile, slots_per_cta, part_ptr,
                          part_offs, cnt_ptr + pid_t * tiles_m + tile, rows_o, toks_o, wdec_ptr, wdec_ptr, out_ptr,
                          stride_ot, T, N, False, 0, BLOCK_M, BLOCK_T, O2)
            else:  # a timing variant: the run's sum to its slot, no count, no output
                slot = (pid_t * ctas + pid) * slots_per_cta + (tile - first_tile)
                gl.store(part_ptr + slot.to(gl.int64) * (BLOCK_M * BLOCK_T) + part_offs, y)
            b = run_end

    @gluon.jit
    def _moe_stream_loads_kernel(
        x_ptr, w_ptr, ws_ptr, ids_ptr, out_ptr, part_ptr, cnt_ptr,
        stride_xt, stride_we, stride_ww, stride_wse, stride_wsn, S, N, K, E, top_k, tiles_e, slots_per_cta,
        DOWN: gl.constexpr, LOAD_X: gl.constexpr, SUMS: gl.constexpr, S_BLOCK: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_T: gl.constexpr, WARPS: gl.constexpr, ROW_WARPS: gl.constexpr,
    ):
        # The MoE streaming kernel's walk (gluon_moe_decode._moe_stream_kernel without expert map, overlapped runs or
        # row pointers): the routing found by every CTA, the list of (expert, row tile, 128-k block), its stream-K
        # split and each run's routing; the loads probe's steps; a list tile's total to out[tile].
        BMW: gl.constexpr = BLOCK_M // ROW_WARPS
        KW: gl.constexpr = WARPS // ROW_WARPS
        HALF: gl.constexpr = BLOCK_M // 2
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        W4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        S3: gl.constexpr = gl.SliceLayout(3, W4)
        XW: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0])
        O2: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, WARPS], [0, 1])
        R2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0])
        NB = K // 128

        pid = gl.program_id(0)
        ctas = gl.num_programs(0)
        offs_b, ids_b, before_b, nth_b, n_e = _route_list(ids_ptr, ids_ptr, S, E, E, False, S_BLOCK, R2)
        total = n_e * tiles_e * NB

        w_c, k_c, row_c, w_s, k_s, row_s, w_x, _, k_x = _lane_offsets(WARPS, BMW, ROW_WARPS, BLOCK_T, 64, CL, S3, XW)
        n_r = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, R2))
        part_offs = _slot_offsets(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O2)), BLOCK_T, O2)
        ctas, b_begin, b_end, first_tile = _list_blocks(pid, ctas, total, NB)
        b = b_begin
        while b < b_end:
            tile, run_end, kb0, kb_last, last, q, j = _expert_run(b, b_end, NB, tiles_e, KW)
            # (the activation rows come back in XW's token slice: the x offsets below are in 32-bit words)
            e, count, route, a_row = _expert_routes(q, nth_b, ids_b, before_b, offs_b, n_r, top_k, DOWN, XW)
            w_base, w_offs, s_base, s_offs, x_offs = _tile_offsets(
                e, j, a_row, w_ptr, ws_ptr, row_c, row_s, k_c, k_s, k_x, stride_xt, stride_we, stride_ww,
                stride_wse, stride_wsn, N, DOWN, BLOCK_M, HALF)
            y = _loads_run(w_base, w_offs, s_base, s_offs, x_ptr, x_offs, kb0, kb_last, last, w_c, w_s, w_x,
                           LOAD_X, WARPS, ROW_WARPS, BLOCK_M, BLOCK_T, CL, S3, XW, O2)
            if SUMS:
                done, y = _reduce_tile(y, tile, pid, 0, ctas, total, NB, first_tile, slots_per_cta, part_ptr,
                                       part_offs, cnt_ptr + tile, BLOCK_M, BLOCK_T, O2)
                if done:  # every entry of y is the tile's total
                    gl.store(out_ptr + tile + part_offs * 0, y, mask=part_offs == 0)
            else:  # a timing variant: the run's sum to its slot, no count, no output
                slot = pid * slots_per_cta + (tile - first_tile)
                gl.store(part_ptr + slot.to(gl.int64) * (BLOCK_M * BLOCK_T) + part_offs, y)
            b = run_end


def _check(x, codes, scales, tile):
    from vllm_nvfp4_sm120.format.checks import check_tensor

    t, k = x.shape
    n = codes.shape[0]
    if k % gs.K_BLOCK:
        raise ValueError(f"x: K = {k} must be a multiple of {gs.K_BLOCK} for the loads probe")
    check_tensor("x", x, dtype=torch.bfloat16, shape=(t, k))
    check_tensor("codes", codes, dtype=torch.uint8, shape=(n, k // 2))
    check_tensor("scales", scales, dtype=(torch.uint8, torch.float8_e4m3fn), shape=(n, k // 16))
    if not (x.is_contiguous() and codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("x, codes, scales: the loads probe takes contiguous tensors")
    if tile.prefetch != 1 or tile.overlap_runs:
        raise ValueError(f"tile: the loads probe follows the plain one-step loop, got {tile}")


_ONES: dict = {}


def stream_loads(x, codes, scales, *, tile: gs.StreamTile, ctas: int, load_x: bool = True, sums: bool = True,
                 workspace: gs.StreamWorkspace | None = None, out=None):
    """Run the probe on ``x [T, K]`` bf16 and an ``[N, K]`` checkpoint weight; returns ``out [T, N]`` fp32 (with
    ``sums``: :func:`stream_loads_expected`, exactly; without: not written).  ``tile`` gives the rows, tokens,
    warps and register cap, ``ctas`` the grid, as for :func:`vllm_nvfp4_sm120.kernels.gluon_gemv_stream.gemv_stream`.
    """
    require_gluon("stream_loads")
    _check(x, codes, scales, tile)
    t, k = x.shape
    n = codes.shape[0]
    grid = gs.stream_grid(t, n, k, tile, ctas)
    if workspace is None:
        workspace = gs.StreamWorkspace.for_grid(grid, tile, x.device)
    workspace.check(grid, tile, x.device)
    out = torch.empty(t, n, dtype=torch.float32, device=x.device) if out is None else out
    if t == 0:  # nothing to read (the kernel would clamp its token rows to T - 1)
        return out
    ones = _ONES.get((n, x.device))
    if ones is None:  # the epilogue's per-row scale: kept, so that a captured call launches the probe alone
        ones = _ONES[(n, x.device)] = torch.ones(n, dtype=torch.float32, device=x.device)
    _stream_loads_kernel[(grid.ctas, grid.tiles_t)](
        x.view(torch.int32), codes.view(torch.int32), scales.view(torch.uint8), ones, out, workspace.partials,
        workspace.counters, t, n, k, x.stride(0) // 2, codes.stride(0) // 4, scales.stride(0), out.stride(0),
        grid.total_blocks, grid.slots_per_cta, LOAD_X=load_x, SUMS=sums, BLOCK_M=tile.block_m, BLOCK_T=tile.block_t,
        WARPS=tile.num_warps, ROW_WARPS=tile.row_warps, **tile.launch_options)
    return out


def stream_loads_expected(x, codes, scales, tile: gs.StreamTile, load_x: bool = True) -> torch.Tensor:
    """What :func:`stream_loads` computes with ``sums``, in torch.  ``out[t, r]`` is the sum of the low nibbles of
    the code words and scale bytes of the rows of ``r``'s row tile (rows past N are row N - 1 again, as the kernel
    reads them), plus those of the activation words of ``t``'s token tile (tokens past T are token T - 1 again), which
    each of the tile's row warps reads once."""
    _check(x, codes, scales, tile)
    t, n = x.shape[0], codes.shape[0]
    per_row = (codes.view(torch.int32) & 0xF).sum(1, dtype=torch.int64) + (scales.view(torch.uint8) & 0xF).sum(
        1, dtype=torch.int64)
    rows = torch.arange(triton.cdiv(n, tile.block_m) * tile.block_m, device=x.device).clamp_(max=n - 1)
    per_tile = per_row[rows].view(-1, tile.block_m).sum(1)
    per_tok = torch.zeros(t, dtype=torch.int64, device=x.device)
    if load_x:
        per_tok = (x.view(torch.int32) & 0xF).sum(1, dtype=torch.int64) * tile.row_warps
    toks = torch.arange(triton.cdiv(t, tile.block_t) * tile.block_t, device=x.device).clamp_(max=t - 1)
    per_tok_tile = per_tok[toks].view(-1, tile.block_t).sum(1)
    total = per_tok_tile.repeat_interleave(tile.block_t)[:t, None] + per_tile.repeat_interleave(tile.block_m)[None, :n]
    if total.numel() and int(total.max()) >= 2**24:
        raise ValueError("stream_loads_expected: the sums pass 2^24 and would not be exact in fp32")
    return total.to(torch.float32)


def workspace_for(t: int, n: int, k: int, tile: gs.StreamTile, ctas: int, device) -> gs.StreamWorkspace:
    """A workspace the probe can keep across calls (its counters return to zero after each)."""
    return gs.StreamWorkspace.for_grid(gs.stream_grid(t, n, k, tile, ctas), tile, device)


# ---------------------------------------------------------------------------------------------------------------
# The MoE walk
# ---------------------------------------------------------------------------------------------------------------
def _check_moe(x, codes, scales, topk_ids, tile, down):
    from vllm_nvfp4_sm120.format.checks import check_tensor

    e, rows, kh = check_tensor("codes", codes, dtype=torch.uint8, ndim=3).shape
    k = 2 * kh
    if k % gs.K_BLOCK:
        raise ValueError(f"codes: K = {k} must be a multiple of {gs.K_BLOCK} for the loads probe")
    check_tensor("scales", scales, dtype=(torch.uint8, torch.float8_e4m3fn), shape=(e, rows, k // 16))
    t, top_k = check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2).shape
    if down:
        check_tensor("x", x, dtype=torch.bfloat16, shape=(t * top_k, k))
    else:
        check_tensor("x", x, dtype=torch.bfloat16, shape=(None, k))
        if rows % 2:
            raise ValueError(f"codes: a gate_up bank has 2 * I rows, got {rows}")
    if not all(v.is_contiguous() for v in (x, codes, scales, topk_ids)):
        raise ValueError("x, codes, scales, topk_ids: the loads probe takes contiguous tensors")
    if t > tile.block_t:
        raise ValueError(f"topk_ids: T = {t} tokens exceed the tile's {tile.block_t} routes per expert")
    if tile.prefetch != 1 or tile.overlap_runs or tile.row_pointers:
        raise ValueError(f"tile: the loads probe follows the plain one-step loop, got {tile}")
    return e, rows, k, t, top_k


def _moe_sizes(rows: int, down: bool) -> int:
    """N of the kernel: the down's H rows, the gate_up's I columns (its bank has 2 * I rows)."""
    return rows if down else rows // 2


def moe_register_cap(tile: MoeStreamTile) -> int:
    """The probe's register cap on a MoE tile: the tile's own, or the budget of its ``ctas_per_sm`` in the units of 8
    the hardware allocates (without a cap ptxas takes 128 registers for the probe on sm_120 and spills outside the
    loop)."""
    budget = REGISTERS_PER_SM // (tile.ctas_per_sm * 32 * tile.num_warps)
    return tile.max_regs or min(248, budget // 8 * 8)


def moe_stream_loads(x, codes, scales, topk_ids, *, tile: MoeStreamTile, ctas: int, down: bool, load_x: bool = True,
                     sums: bool = True, counters=None, out=None):
    """The MoE streaming kernel's walk with the loads probe's steps, on one bank (the gate_up's ``w13`` with ``x``
    the tokens' activations ``[T, H]``, or the down's ``w2`` with ``x`` the routes' intermediate ``[T * top_k, I]``)
    and a routing ``topk_ids [T, top_k]`` (no expert map).  Returns ``out``: fp32, one entry per (distinct expert in
    the order of its first slot, row tile), with ``sums`` :func:`moe_stream_loads_expected` on the list's entries
    (those past the list, and every entry without ``sums``, are not written).  ``counters``: int32 zeros of at least
    the list's length, kept across calls (the kernel leaves them zero); ``ctas``: the grid, as the MoE launchers take
    ``tile.ctas(device)``."""
    require_gluon("moe_stream_loads")
    e, rows, k, t, top_k = _check_moe(x, codes, scales, topk_ids, tile, down)
    n = _moe_sizes(rows, down)
    s = t * top_k
    grid = moe_stream_grid(s, e, n, k, tile, ctas, down=down)
    if out is None:  # (empty: a fill would be a second kernel in every timed call)
        out = torch.empty(grid.counters_numel, dtype=torch.float32, device=x.device)
    if counters is None:
        counters = torch.zeros(grid.counters_numel, dtype=torch.int32, device=x.device)
    part = torch.empty(max(grid.partials_numel(tile), 1), dtype=torch.float32, device=x.device)
    _moe_stream_loads_kernel[(grid.ctas,)](
        x.view(torch.int32), codes.view(torch.int32), scales.view(torch.uint8), topk_ids, out, part, counters,
        x.stride(0) // 2, codes.stride(0) // 4, codes.stride(1) // 4, scales.stride(0), scales.stride(1), s, n, k, e,
        top_k, grid.tiles_e, grid.slots_per_cta, DOWN=down, LOAD_X=load_x, SUMS=sums, S_BLOCK=route_block(s),
        BLOCK_M=tile.block_m, BLOCK_T=tile.block_t, WARPS=tile.num_warps, ROW_WARPS=tile.row_warps,
        **replace(tile, max_regs=moe_register_cap(tile)).launch_options)
    return out


def moe_stream_loads_expected(x, codes, scales, topk_ids, tile: MoeStreamTile, down: bool,
                              load_x: bool = True) -> torch.Tensor:
    """What :func:`moe_stream_loads` writes with ``sums``, in torch: for the q-th distinct expert (in the order of
    its first slot) and its row tile j, the low nibbles of the code words and scale bytes of the tile's rows (the
    down: rows j * block_m.., past H row H - 1 again; the gate_up: gate columns j * block_m / 2.., past I column
    I - 1 again, and the same columns' up rows), plus those of the activation words of each of the tile's block_t
    columns (column n: the expert's n-th route, or its first route past its count; the down's route row, the
    gate_up's token row), read once by each row warp.  One fp32 per list tile, ``[experts * tiles]``."""
    e, rows, k, t, top_k = _check_moe(x, codes, scales, topk_ids, tile, down)
    n = _moe_sizes(rows, down)
    per_row = ((codes.view(torch.int32) & 0xF).sum(-1, dtype=torch.int64)
               + (scales.view(torch.uint8) & 0xF).sum(-1, dtype=torch.int64))  # [E, rows]
    per_act = (x.view(torch.int32) & 0xF).sum(-1, dtype=torch.int64) * tile.row_warps
    flat = topk_ids.reshape(-1).tolist()
    experts = list(dict.fromkeys(i for i in flat if 0 <= i < e))  # distinct, in the order of the first slot
    if down:
        tiles_e = triton.cdiv(n, tile.block_m)
        tile_rows = [[min(j * tile.block_m + r, n - 1) for r in range(tile.block_m)] for j in range(tiles_e)]
    else:
        half = tile.block_m // 2
        tiles_e = triton.cdiv(n, half)
        cols = [[min(j * half + r, n - 1) for r in range(half)] for j in range(tiles_e)]
        tile_rows = [c + [n + v for v in c] for c in cols]
    out = []
    for ex in experts:
        routes = [r for r, i in enumerate(flat) if i == ex]
        act_rows = [r if down else r // top_k for r in routes]
        cols_rows = [act_rows[c] if c < len(routes) else act_rows[0] for c in range(tile.block_t)]
        acts = int(per_act[cols_rows].sum()) if load_x else 0
        out += [int(per_row[ex, tr].sum()) + acts for tr in tile_rows]
    total = torch.tensor(out, dtype=torch.int64)
    if total.numel() and int(total.max()) >= 2**24:
        raise ValueError("moe_stream_loads_expected: the sums pass 2^24 and would not be exact in fp32")
    return total.to(torch.float32).to(x.device)
