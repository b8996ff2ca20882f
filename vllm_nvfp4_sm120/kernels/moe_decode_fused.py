"""The whole decode MoE layer in one launch: gate_up, gated activation, down, routing weight and top-k sum.

The two-launch decode path (:mod:`.moe_decode`) pays at small T, besides its bytes, two kernels' fixed chains: each
launch's ramp (first DRAM latency with few bytes in flight) and tail, and the down kernel cannot start reading its
weights before the last gate_up program is done, although those weights do not depend on the gate_up result.  Here
one grid holds both kinds of work item and a down item reads its weights while gate_up items are still running:

* **Work items in start order.**  Every program first takes a ticket from a counter (``ctl[0]``): tickets
  ``0 .. rows * cdiv(I, GU_BLOCK_N)`` are gate_up items (grid row, column block), the rest down items (grid row, H
  block), with the rows of :mod:`.moe_decode` (a route slot, or a local expert when there are more slots than
  experts; the same dedupe: each touched expert's bytes are read once).  A down item waits for the gate_up items of
  its grid row.  Tickets go out in the order programs actually start, so every gate_up item a down item waits for
  belongs to a program that has already started and waits for nothing: no deadlock whatever order the hardware
  schedules programs in, and however few fit on the GPU at once.
* **Gate_up item**: the program of :func:`.moe_decode._gate_up_columns` (the intermediate ``[T * top_k, I]`` rows
  of its expert's routes, in ``x.dtype``), then a release increment of its grid row's ready count.
* **Down item**: its routing, an L2 prefetch of its w2 rows (GPU), the acquire wait for ``cdiv(I, GU_BLOCK_N)``
  gate_up items of its row, then the w2 product over the intermediate rows (read from L2: written in this launch)
  times ``w2_dec[e] * topk_weight``, stored as one fp32 row per route.  Each route then counts its (token, H block);
  the item that completes a token's block (the last of the token's local experts) adds the token's rows **in slot
  order** and stores the output: bit-identical run to run, without atomics on data and without zeroing.  A token
  with no local expert gets zeros from the down items of grid row ``t mod rows``.
* **Self-cleaning control block** (int32, zero before the first launch): the item completing a (token, H block)
  resets its count, and the last program to finish (``ctl[1]``) resets the ticket, the finish count and the ready
  counts.  One control block serves every later launch of the same grid (CUDA-graph replays included), but not two
  launches that may run at the same time.

Numerics are those of :func:`.moe_decode.moe_decode` with the deterministic expert-major down: weight-only, exact
products, fp32 sums, the 16-bit intermediate; bit-identical across runs whatever the mode.  Both tiles must be
tensor-core tiles by pointer loads (no TMA, K split or dependent launch: one grid, one program shape), with the same
``num_warps``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import register_cap_option
from .moe_decode import (
    DECODE_CVT,
    DECODE_PTX,
    DecodeTile,
    _BANK,
    _chunk_routes,
    _divisible,
    _expert_rows_product,
    _gate_up_columns,
    _Launches,
    _local_slots,
    _prefetch_rows,
    _program_expert,
    decode_kind,
    route_block,
    shift_ok,
)
from .moe_common import local_expert
from .moe_decode_checks import _check_bank, _check_routing

_ZERO_CHUNK = tl.constexpr(256)


def control_numel(t: int, top_k: int, e: int, h: int, down_tile: DecodeTile) -> int:
    """int32 elements of the control block: ticket, finish count, one ready count per grid row, one arrival count
    per (token, H block)."""
    return 2 + min(t * top_k, e) + t * triton.cdiv(h, down_tile.block_n)


def check_fused_tiles(gate_up_tile: DecodeTile, down_tile: DecodeTile) -> None:
    """ValueError unless both tiles can share one grid (see the module docstring)."""
    for name, tile in (("gate_up_tile", gate_up_tile), ("down_tile", down_tile)):
        if not isinstance(tile, DecodeTile):
            raise ValueError(f"{name}: the fused decode layer runs the Triton decode tiles (DecodeTile), got {tile}")
        if not tile.use_dot or tile.use_tma or tile.split_k != 1 or tile.pdl or tile.prefetch_down:
            raise ValueError(f"{name}: the fused decode layer takes tensor-core tiles by pointer loads without K "
                             f"splits, dependent launch or a down prefetch (its down items prefetch their own "
                             f"rows), got {tile}")
    if gate_up_tile.num_warps != down_tile.num_warps:
        raise ValueError(f"down_tile: num_warps must equal the gate_up tile's ({gate_up_tile.num_warps}: one grid), "
                         f"got {down_tile.num_warps}")
    if gate_up_tile.max_regs != down_tile.max_regs:
        raise ValueError(f"down_tile: max_regs must equal the gate_up tile's ({gate_up_tile.max_regs}: one kernel), "
                         f"got {down_tile.max_regs}")
    gate_up_tile.check_rows(2 * gate_up_tile.block_n, "gate_up")
    down_tile.check_rows(down_tile.block_n, "down_expert")


def _tile_kwargs(prefix: str, tile: DecodeTile, shift: bool) -> dict:
    return {f"{prefix}_BLOCK_N": tile.block_n, f"{prefix}_BLOCK_K": tile.block_k, f"{prefix}_BLOCK_T": tile.block_t,
            f"{prefix}_STAGES": tile.num_stages, f"{prefix}_SHIFT": shift, f"{prefix}_K_WARPS": tile.k_warps,
            f"{prefix}_EVICT_FIRST": tile.evict_first}


@triton.jit
def _moe_decode_fused_kernel(
    x_ptr, w13_ptr, w13_sf_ptr, w13_dec_ptr, w2_ptr, w2_sf_ptr, w2_dec_ptr, ids_ptr, map_ptr, tw_ptr,
    inter_ptr, rows_ptr, ctl_ptr, out_ptr,
    S, H, I, E, GLOBAL_E, top_k,
    stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e, stride_w2n, stride_s2e, stride_s2n,
    stride_om,
    ACTIVATION: tl.constexpr, HAS_MAP: tl.constexpr, BY_EXPERT: tl.constexpr, S_BLOCK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr, FAST_DECODE: tl.constexpr, EVEN_H: tl.constexpr, EVEN_I: tl.constexpr,
    GU_BLOCK_N: tl.constexpr, GU_BLOCK_K: tl.constexpr, GU_BLOCK_T: tl.constexpr, GU_STAGES: tl.constexpr,
    GU_SHIFT: tl.constexpr, GU_K_WARPS: tl.constexpr, GU_EVICT_FIRST: tl.constexpr,
    DN_BLOCK_N: tl.constexpr, DN_BLOCK_K: tl.constexpr, DN_BLOCK_T: tl.constexpr, DN_STAGES: tl.constexpr,
    DN_SHIFT: tl.constexpr, DN_K_WARPS: tl.constexpr, DN_EVICT_FIRST: tl.constexpr,
):
    if BY_EXPERT:
        rows = E
    else:
        rows = S
    num_gu = tl.cdiv(I, GU_BLOCK_N)
    num_dn = tl.cdiv(H, DN_BLOCK_N)
    ready_ptr = ctl_ptr + 2
    cnt_ptr = ctl_ptr + 2 + rows
    ticket = tl.atomic_add(ctl_ptr, 1, sem="relaxed")
    if ticket < rows * num_gu:
        row = ticket // num_gu
        live, e, seen, count = _program_expert(row, ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP, BY_EXPERT, S_BLOCK)
        if live:
            _gate_up_columns(x_ptr, w13_ptr, w13_sf_ptr, w13_ptr, w13_sf_ptr, w13_dec_ptr, inter_ptr,
                             ticket % num_gu, e, seen, count, I, H, top_k, stride_xt, stride_w13e, stride_w13n,
                             stride_s13e, stride_s13n, I, ACTIVATION, FAST_DECODE, EVEN_H, False, GU_BLOCK_N,
                             GU_BLOCK_K, GU_BLOCK_T, True, GU_EVICT_FIRST, GU_STAGES, GU_SHIFT, GU_K_WARPS)
        tl.debug_barrier()  # every thread's intermediate stores before the release
        tl.atomic_add(ready_ptr + row, 1, sem="release")
    else:
        d = ticket - rows * num_gu
        row = d // num_dn
        pid_n = d % num_dn
        offs_h = pid_n * DN_BLOCK_N + tl.arange(0, DN_BLOCK_N)
        h_ok = offs_h < H
        T = S // top_k
        for t in range(row, T, rows):  # tokens with no local expert: zeros (no down item counts them)
            n_local = _local_slots(ids_ptr, map_ptr, tl.full((1,), t, tl.int32), S, E, GLOBAL_E, top_k, HAS_MAP,
                                   TOPK_BLOCK)
            if tl.sum(n_local, axis=0) == 0:
                tl.store(out_ptr + t * stride_om + offs_h, tl.zeros((DN_BLOCK_N,), dtype=out_ptr.dtype.element_ty),
                         mask=h_ok)
        live, e, seen, count = _program_expert(row, ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP, BY_EXPERT, S_BLOCK)
        if live:
            e64 = e.to(tl.int64)
            w_rows = e64 * stride_w2e + offs_h.to(tl.int64) * stride_w2n
            s_rows = e64 * stride_s2e + offs_h.to(tl.int64) * stride_s2n
            if FAST_DECODE:  # the weights do not depend on the gate_up items: on their way into L2 while they run
                _prefetch_rows(w2_ptr, w2_sf_ptr, w_rows, s_rows, h_ok, I)
            ready = tl.atomic_add(ready_ptr + row, 0, sem="acquire")
            while ready < num_gu:
                ready = tl.atomic_add(ready_ptr + row, 0, sem="acquire")
            tl.debug_barrier()  # the acquire before any thread's intermediate load
            dec = tl.load(w2_dec_ptr + e)
            for c0 in range(0, count, DN_BLOCK_T):
                route, r_ok = _chunk_routes(seen, c0, count, DN_BLOCK_T)
                acc = _expert_rows_product(w2_ptr, w2_sf_ptr, w2_ptr, w2_sf_ptr, w_rows, s_rows, h_ok, e,
                                           pid_n * DN_BLOCK_N, inter_ptr, route, r_ok, I, I, DN_BLOCK_N, DN_BLOCK_K,
                                           DN_BLOCK_T, True, False, FAST_DECODE, DN_EVICT_FIRST, EVEN_I, DN_STAGES,
                                           DN_SHIFT, DN_K_WARPS, True)
                y = (acc * dec) * tl.load(tw_ptr + route, mask=r_ok, other=0.0)[None, :]
                tl.store(rows_ptr + route[None, :].to(tl.int64) * H + offs_h[:, None], y,
                         mask=h_ok[:, None] & r_ok[None, :])
                tl.debug_barrier()  # every thread's rows before the release of the counts
                tok = route // top_k
                done = tl.atomic_add(cnt_ptr + tok * num_dn + pid_n, 1, mask=r_ok, sem="acq_rel")
                n_local = _local_slots(ids_ptr, map_ptr, tok, S, E, GLOBAL_E, top_k, HAS_MAP, TOPK_BLOCK)
                last = r_ok & (done == n_local - 1)
                tl.debug_barrier()
                total = tl.zeros((DN_BLOCK_N, DN_BLOCK_T), dtype=tl.float32)
                for j in range(top_k):  # slot order: the same bits whichever expert arrived last
                    rj = tok * top_k + j
                    ok = last & (local_expert(ids_ptr, map_ptr, rj, S, E, GLOBAL_E, HAS_MAP) >= 0)
                    # .cg: the other items' rows are in L2; this SM's L1 may hold a stale line.
                    total += tl.load(rows_ptr + rj[None, :].to(tl.int64) * H + offs_h[:, None],
                                     mask=h_ok[:, None] & ok[None, :], other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + tok[None, :].to(tl.int64) * stride_om + offs_h[:, None],
                         total.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & last[None, :])
                tl.store(cnt_ptr + tok * num_dn + pid_n, tl.zeros_like(tok), mask=last)  # for the next launch
    tl.debug_barrier()
    finished = tl.atomic_add(ctl_ptr + 1, 1, sem="acq_rel")
    if finished == rows * (num_gu + num_dn) - 1:  # the last program: every ticket taken, every wait over
        for z0 in range(0, rows, _ZERO_CHUNK):
            offs = z0 + tl.arange(0, _ZERO_CHUNK)
            tl.store(ready_ptr + offs, tl.zeros((_ZERO_CHUNK,), tl.int32), mask=offs < rows)
        tl.store(ctl_ptr + tl.arange(0, 2), tl.zeros((2,), tl.int32))


# Compile harness (bf16 activations, int32 ids); divisible as the other decode kernels'.
MOE_DECODE_FUSED_SIGNATURE = {
    "x_ptr": "*bf16", "w13_ptr": "*u8", "w13_sf_ptr": "*u8", "w13_dec_ptr": "*fp32", "w2_ptr": "*u8",
    "w2_sf_ptr": "*u8", "w2_dec_ptr": "*fp32", "ids_ptr": _BANK["ids_ptr"], "map_ptr": _BANK["map_ptr"],
    "tw_ptr": "*fp32", "inter_ptr": "*bf16", "rows_ptr": "*fp32", "ctl_ptr": "*i32", "out_ptr": "*bf16",
    **{k: "i32" for k in ("S", "H", "I", "E", "GLOBAL_E", "top_k", "stride_xt", "stride_w13e", "stride_w13n",
                          "stride_s13e", "stride_s13n", "stride_w2e", "stride_w2n", "stride_s2e", "stride_s2n",
                          "stride_om")},
    **{k: "constexpr" for k in ("ACTIVATION", "HAS_MAP", "BY_EXPERT", "S_BLOCK", "TOPK_BLOCK", "FAST_DECODE",
                                "EVEN_H", "EVEN_I")},
    **{f"{p}_{k}": "constexpr" for p in ("GU", "DN")
       for k in ("BLOCK_N", "BLOCK_K", "BLOCK_T", "STAGES", "SHIFT", "K_WARPS", "EVICT_FIRST")},
}
MOE_DECODE_FUSED_DIVISIBLE = _divisible(MOE_DECODE_FUSED_SIGNATURE) + [
    k for k in ("stride_w13e", "stride_w13n", "stride_s13e", "stride_s13n", "stride_w2e", "stride_w2n",
                "stride_s2e", "stride_s2n") if k not in _divisible(MOE_DECODE_FUSED_SIGNATURE)]


def compile_constexprs(gate_up_tile: DecodeTile, down_tile: DecodeTile, *, fast_decode: int = DECODE_PTX,
                       activation: str = "silu", s_block: int = 64, by_expert: bool = False) -> dict:
    """The kernel's constexprs for a tile pair (the compile harness; the launcher derives the same).
    ``fast_decode``: a :mod:`.moe_decode` decode kind (the shift decode off with the native convert)."""
    shift = fast_decode != DECODE_CVT
    return dict(ACTIVATION=activation, HAS_MAP=False, BY_EXPERT=by_expert, S_BLOCK=s_block, TOPK_BLOCK=8,
                FAST_DECODE=fast_decode, EVEN_H=True, EVEN_I=True,
                **_tile_kwargs("GU", gate_up_tile, gate_up_tile.shift_decode and shift),
                **_tile_kwargs("DN", down_tile, down_tile.shift_decode and shift))


def fused_workspace(t: int, top_k: int, e: int, h: int, down_tile: DecodeTile, device):
    """A zeroed control block for :func:`moe_decode_fused` (keep it for later calls: the kernel leaves it zero)."""
    import torch

    return torch.zeros(control_numel(t, top_k, e, h, down_tile), dtype=torch.int32, device=device)


def moe_decode_fused(
    x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, *,
    gate_up_tile: DecodeTile, down_tile: DecodeTile, expert_map=None, activation: str = "silu", control=None,
    out=None, check_ids: bool = False,
):
    """The decode MoE layer in one launch → ``out [T, H]`` in ``x.dtype`` (what :func:`.moe_decode.moe_decode`
    computes with the deterministic expert-major down, bit for bit).

    ``control``: the int32 control block (:func:`fused_workspace`; zero before the first call, left zero by every
    call); None allocates a zeroed one for this call."""
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor
    from ..format.reference import ACTIVATIONS

    check_fused_tiles(gate_up_tile, down_tile)
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, h = x.shape
    w13_sf, e, two_i, _ = _check_bank("w13", w13_codes, w13_scales, w13_dec, None, h, x.device)
    if two_i % 32:
        raise ValueError(f"w13_codes: 2I = {two_i} rows must be gate and up halves with I % 16 == 0")
    i = two_i // 2
    w2_sf, _, _, _ = _check_bank("w2", w2_codes, w2_scales, w2_dec, h, i, x.device)
    if w2_codes.shape[0] != e:
        raise ValueError(f"w2_codes: expected {e} experts (as w13_codes), got shape {list(w2_codes.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    t, k, global_e, emap, has_map = _check_routing(topk_ids, topk_weights, expert_map, e, t, check_ids, x.device)
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=[t, h], last_dim_contiguous=True, device=x.device)
    need = control_numel(t, k, e, h, down_tile)
    if control is None:
        control = torch.zeros(need, dtype=torch.int32, device=x.device)
    check_tensor("control", control, dtype=torch.int32, device=x.device)
    if control.numel() < need or not control.is_contiguous():
        raise ValueError(f"control: expected a contiguous int32 tensor of >= {need} elements, got shape "
                         f"{list(control.shape)}")
    if t == 0:
        return out
    run = prepare_moe_decode_fused(t, h, i, e, k, global_e, x.device, gate_up_tile=gate_up_tile,
                                   down_tile=down_tile, activation=activation, has_map=has_map)
    return run(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, control, out)


def prepare_moe_decode_fused(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, *,
                             gate_up_tile: DecodeTile, down_tile: DecodeTile, activation: str, has_map: bool):
    """``run(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, control,
    out=None) -> out [T, H]`` (checks nothing; as the other ready launches)."""
    import torch

    from .launch import ReadyKernel

    check_fused_tiles(gate_up_tile, down_tile)
    s = t * top_k
    rows = min(s, e)
    grid = (rows * (triton.cdiv(i, gate_up_tile.block_n) + triton.cdiv(h, down_tile.block_n)),)
    fast = decode_kind(device)
    gu_shift = gate_up_tile.shift_decode and shift_ok(h) and fast != DECODE_CVT  # (the native cvt needs none)
    dn_shift = down_tile.shift_decode and shift_ok(i) and fast != DECODE_CVT
    launch_kw = dict(num_warps=gate_up_tile.num_warps, num_stages=gate_up_tile.num_stages,
                     **register_cap_option("DecodeTile", gate_up_tile.max_regs))
    launches = _Launches(lambda gu, dn, stride_x, s13w, s13s, s2w, s2s, stride_o: ReadyKernel(
        _moe_decode_fused_kernel, grid, S=s, H=h, I=i, E=e, GLOBAL_E=global_e, top_k=top_k, stride_xt=stride_x,
        stride_w13e=s13w[0], stride_w13n=s13w[1], stride_s13e=s13s[0], stride_s13n=s13s[1], stride_w2e=s2w[0],
        stride_w2n=s2w[1], stride_s2e=s2s[0], stride_s2n=s2s[1], stride_om=stride_o, ACTIVATION=activation,
        HAS_MAP=has_map, BY_EXPERT=rows < s, S_BLOCK=route_block(s), TOPK_BLOCK=max(2, triton.next_power_of_2(top_k)),
        FAST_DECODE=fast, EVEN_H=h % gate_up_tile.block_k == 0, EVEN_I=i % down_tile.block_k == 0,
        **_tile_kwargs("GU", gate_up_tile, gu), **_tile_kwargs("DN", down_tile, dn), **launch_kw,
    ))

    def run(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, control,
            out=None):
        if out is None:
            out = torch.empty((t, h), dtype=x.dtype, device=x.device)
        inter = torch.empty((s, i), dtype=x.dtype, device=x.device)
        rows_f32 = torch.empty((s, h), dtype=torch.float32, device=x.device)
        # The shift decode needs 16-byte aligned code rows (see moe_decode.shift_ok); a bank that is not gets the
        # table decode, as the two-launch path does.
        launch = launches((gu_shift and w13_codes.data_ptr() % 16 == 0, dn_shift and w2_codes.data_ptr() % 16 == 0,
                           x.stride(0), w13_codes.stride(), w13_sf.stride(), w2_codes.stride(), w2_sf.stride(),
                           out.stride(0)))
        launch(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, inter,
               rows_f32, control, out)
        return out

    return run
