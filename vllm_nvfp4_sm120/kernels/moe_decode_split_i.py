"""The decode MoE layer in one launch with the down split over I: no program waits for another.

The two-launch decode path (:mod:`.moe_decode`) starts the down kernel's reads only after the last gate_up
program, and the one-launch kernel of :mod:`.moe_decode_fused` makes its down items wait for their expert's gate_up
items.  Here the down needs no complete intermediate row, because the down product is a sum over I:

    out[t, :] = sum over (e, column block n) of  w2[e][:, n] @ inter[route, n] * w2_dec[e] * topk_weight

so a program that has computed intermediate columns ``n`` of a route (the gate_up program of
:func:`.moe_decode._gate_up_columns`: whole K, the gated activation, the 16-bit round of the two-launch path) goes
straight on to multiply them by the ``[H, BLOCK_N]`` column slice of the expert's down weights and adds the
``[H]`` products into the token's fp32 sums.  Every program streams gate_up bytes and then down bytes, the down
reads start with the first programs, and there is one launch's ramp and tail.

What it costs instead:

* **Atomics.**  Each (token, h) sum receives one fp32 add per (local expert, column block): ``top_k * I /
  BLOCK_N`` adds at T = 1 (384 on Qwen3-30B-A3B with 16 columns).  Adds to one address serialize in L2, so the sums
  exist in ``COPIES`` copies (program ``p`` adds into copy ``p % COPIES``) and the cast sums the copies.
* **Short down rows.**  A program reads ``BLOCK_N / 2`` code bytes of each of the H down rows (8 bytes of a
  32-byte sector with 16 columns).  The neighbouring column blocks' programs run at the same time and read the
  rest of the sector from L2, so DRAM reads each byte about once; L2 moves ``32 / (BLOCK_N / 2)`` times more.
* **The cast by the last program.**  Every program raises one count (acq_rel, after a CTA barrier over its adds);
  the program that completes it sums the copies of each ``[T, H]`` sum (``.cg``: L2), casts to ``x.dtype``, stores
  the output and zeroes the copies and the count for the next launch (CUDA-graph replays included).  That pass is
  ``T * H`` elements in one program, so the kernel is for small T.

Numerics: weight-only (the decode path's), exact products, fp32 sums, the 16-bit intermediate as in the two-launch
path; the down sums are added in arrival order, so the last bits vary from run to run (no deterministic mode: the
flow's deterministic plans run the two-launch path).  Tokens with no local expert get zeros.  The workspace (the
sums and the count) must be zero before the first launch, is left zero by each, and serves one launch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .common import register_cap_option
from .moe_common import gated_activation_f32
from .moe_decode import (
    DECODE_CVT,
    DECODE_PTX,
    DECODE_TL,
    DecodeTile,
    _BANK,
    _chunk_routes,
    _divisible,
    _expert_rows_product,
    _PREFETCH_L2_PTX,
    _Launches,
    _load_tile,
    _program_expert,
    _tile_product,
    decode_kind,
    route_block,
    shift_ok,
)
from .moe_decode_checks import _check_bank, _check_routing

_CAST_BLOCK = tl.constexpr(4096)  # elements of the [T, H] sums per step of the last program's cast
MAX_TOKENS = 16  # the cast is one program's: T * H elements


@dataclass(frozen=True)
class SplitIDown:
    """The down part of a program: ``block_h`` rows of H per step of its loop over H (the MMA's M; K is the gate_up
    tile's ``block_n`` columns; each step's loads are issued before the previous step's product, from registers, since
    Triton's pipeliner does not stage these narrow loads), the copies of the fp32 sums, and ``prefetch``: the program
    first asks L2 for its down slice (one line per row of codes and of scales, GPU only), so the slice comes in while
    its gate_up part streams and the H loop, a chain of short dependent steps, reads L2."""

    block_h: int = 128
    copies: int = 1
    prefetch: bool = False

    def __post_init__(self):
        if self.block_h not in (16, 32, 64, 128, 256) or self.copies < 1:
            raise ValueError(f"SplitIDown: block_h must be 16-256 (a power of two) and copies >= 1, got {self}")


def check_split_i_tiles(gate_up_tile: DecodeTile, down: SplitIDown) -> None:
    """ValueError unless the gate_up tile can feed the down part: a tensor-core tile by pointer loads, no K split,
    no dependent launch or down prefetch, and at least 16 columns (the down MMA's K)."""
    if not isinstance(gate_up_tile, DecodeTile):
        raise ValueError(f"gate_up_tile: the split-I decode layer runs the Triton decode tiles (DecodeTile), got "
                         f"{gate_up_tile}")
    if not isinstance(down, SplitIDown):
        raise ValueError(f"down: expected a SplitIDown, got {down}")
    t = gate_up_tile
    if not t.use_dot or t.use_tma or t.split_k != 1 or t.pdl or t.prefetch_down or t.block_n < 16:
        raise ValueError(f"gate_up_tile: the split-I decode layer takes a tensor-core tile of >= 16 columns by "
                         f"pointer loads without K splits, dependent launch or a down prefetch, got {t}")
    t.check_rows(2 * t.block_n, "gate_up")


def workspace_numel(t: int, h: int, down: SplitIDown) -> int:
    """fp32 elements of the sums: ``copies`` copies of ``[T, H]``."""
    return down.copies * t * h


def split_i_workspace(t: int, h: int, down: SplitIDown, device):
    """``(sums, count)``: zeroed fp32 sums and the int32 count (keep them for later calls: the kernel leaves them
    zero)."""
    import torch

    return (torch.zeros(workspace_numel(t, h, down), dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


@triton.jit
def _moe_decode_split_i_kernel(
    x_ptr, w13_ptr, w13_sf_ptr, w13_dec_ptr, w2_ptr, w2_sf_ptr, w2_dec_ptr, ids_ptr, map_ptr, tw_ptr,
    sums_ptr, cnt_ptr, out_ptr,
    S, H, I, E, GLOBAL_E, top_k,
    stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e, stride_w2n, stride_s2e, stride_s2n,
    stride_om,
    ACTIVATION: tl.constexpr, HAS_MAP: tl.constexpr, BY_EXPERT: tl.constexpr, S_BLOCK: tl.constexpr,
    FAST_DECODE: tl.constexpr, EVEN_H: tl.constexpr, EVEN_I: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr, SHIFT: tl.constexpr,
    K_WARPS: tl.constexpr, EVICT_FIRST: tl.constexpr,
    BLOCK_H: tl.constexpr, COPIES: tl.constexpr, PREFETCH: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_n = tl.num_programs(1)
    T = S // top_k
    DT: tl.constexpr = x_ptr.dtype.element_ty
    live, e, seen, count = _program_expert(row, ids_ptr, map_ptr, S, E, GLOBAL_E, HAS_MAP, BY_EXPERT, S_BLOCK)
    if live:
        # The gate_up tile: gate rows n, then the up rows I + n, of this program's BLOCK_N columns.
        r = tl.arange(0, 2 * BLOCK_N)
        col = pid_n * BLOCK_N + r % BLOCK_N
        w_row = ((r // BLOCK_N) * I + col).to(tl.int64)
        e64 = e.to(tl.int64)
        w_rows = e64 * stride_w13e + w_row * stride_w13n
        s_rows = e64 * stride_s13e + w_row * stride_s13n
        offs_h = tl.arange(0, BLOCK_H)
        w_rows2 = e64 * stride_w2e + offs_h.to(tl.int64) * stride_w2n  # the down slice's first step
        s_rows2 = e64 * stride_s2e + offs_h.to(tl.int64) * stride_s2n
        if PREFETCH:  # the line of each down row that holds this program's codes, and the one of its scales
            for h0 in range(0, H, BLOCK_H):
                hs64 = tl.minimum(h0 + offs_h, H - 1).to(tl.int64)
                pc = w2_ptr + (e64 * stride_w2e + hs64 * stride_w2n + pid_n * (BLOCK_N // 2))
                ps = w2_sf_ptr + (e64 * stride_s2e + hs64 * stride_s2n + pid_n * (BLOCK_N // 16))
                tl.inline_asm_elementwise(_PREFETCH_L2_PTX, "=r,l", [pc.to(tl.int64)], dtype=tl.int32,
                                          is_pure=False, pack=1)
                tl.inline_asm_elementwise(_PREFETCH_L2_PTX, "=r,l", [ps.to(tl.int64)], dtype=tl.int32,
                                          is_pure=False, pack=1)
        dec13 = tl.load(w13_dec_ptr + e)
        dec2 = tl.load(w2_dec_ptr + e)
        sums = sums_ptr + ((row * num_n + pid_n) % COPIES).to(tl.int64) * T * H
        for c0 in range(0, count, BLOCK_T):
            route, r_ok = _chunk_routes(seen, c0, count, BLOCK_T)
            acc = _expert_rows_product(w13_ptr, w13_sf_ptr, w13_ptr, w13_sf_ptr, w_rows, s_rows, col < I, 2 * e,
                                       pid_n * BLOCK_N, x_ptr, route // top_k, r_ok, stride_xt, H, 2 * BLOCK_N,
                                       BLOCK_K, BLOCK_T, True, False, FAST_DECODE, EVICT_FIRST, EVEN_H, STAGES,
                                       SHIFT, K_WARPS)
            gate, up = acc.reshape(2, BLOCK_N, BLOCK_T).permute(1, 2, 0).split()
            # [BLOCK_N, BLOCK_T] in x.dtype: the K operand of the down slice (columns past I are 0: their code
            # rows were masked to zero, and both activations map (0, 0) to 0).
            inter = gated_activation_f32(gate * dec13, up * dec13, ACTIVATION).to(DT)
            coef = dec2 * tl.load(tw_ptr + route, mask=r_ok, other=0.0)
            tok_rows = sums + (route // top_k).to(tl.int64) * H
            w_next, s_next = _load_tile(w2_ptr, w2_sf_ptr, w2_ptr, w2_sf_ptr, w_rows2, s_rows2, offs_h < H, 0, 0,
                                        pid_n * BLOCK_N, I, BLOCK_H, BLOCK_N, False, EVICT_FIRST, EVEN_I)
            for h0 in range(0, H, BLOCK_H):
                w, s = w_next, s_next
                hs = h0 + offs_h
                # the next step's loads first (rows past H masked: no traffic)
                h1 = h0 + BLOCK_H
                w_next, s_next = _load_tile(w2_ptr, w2_sf_ptr, w2_ptr, w2_sf_ptr, w_rows2 + h1 * stride_w2n,
                                            s_rows2 + h1 * stride_s2n, hs + BLOCK_H < H, 0, 0, pid_n * BLOCK_N, I,
                                            BLOCK_H, BLOCK_N, False, EVICT_FIRST, EVEN_I)
                y = _tile_product(w, s, inter, tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32), BLOCK_H, BLOCK_N,
                                  DT, True, FAST_DECODE, False)
                tl.atomic_add(tok_rows[None, :] + hs[:, None], y * coef[None, :],
                              mask=(hs < H)[:, None] & r_ok[None, :], sem="relaxed")
    tl.debug_barrier()  # every thread's adds before the release of the count
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) * num_n - 1:  # the last program: every other program's adds are visible
        for o in range(0, T * H, _CAST_BLOCK):
            offs = o + tl.arange(0, _CAST_BLOCK)
            ok = offs < T * H
            total = tl.zeros((_CAST_BLOCK,), dtype=tl.float32)
            for c in range(COPIES):  # .cg: the sums are in L2; this SM's L1 may hold none of them, or stale ones
                total += tl.load(sums_ptr + c * T * H + offs, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(sums_ptr + c * T * H + offs, tl.zeros((_CAST_BLOCK,), dtype=tl.float32), mask=ok)
            tok = offs // H
            tl.store(out_ptr + tok.to(tl.int64) * stride_om + (offs - tok * H), total.to(DT), mask=ok)
        tl.store(cnt_ptr, 0)


# Compile harness (bf16 activations, int32 ids); divisible as the other decode kernels'.
MOE_DECODE_SPLIT_I_SIGNATURE = {
    "x_ptr": "*bf16", "w13_ptr": "*u8", "w13_sf_ptr": "*u8", "w13_dec_ptr": "*fp32", "w2_ptr": "*u8",
    "w2_sf_ptr": "*u8", "w2_dec_ptr": "*fp32", "ids_ptr": _BANK["ids_ptr"], "map_ptr": _BANK["map_ptr"],
    "tw_ptr": "*fp32", "sums_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*bf16",
    **{k: "i32" for k in ("S", "H", "I", "E", "GLOBAL_E", "top_k", "stride_xt", "stride_w13e", "stride_w13n",
                          "stride_s13e", "stride_s13n", "stride_w2e", "stride_w2n", "stride_s2e", "stride_s2n",
                          "stride_om")},
    **{k: "constexpr" for k in ("ACTIVATION", "HAS_MAP", "BY_EXPERT", "S_BLOCK", "FAST_DECODE", "EVEN_H", "EVEN_I",
                                "BLOCK_N", "BLOCK_K", "BLOCK_T", "STAGES", "SHIFT", "K_WARPS", "EVICT_FIRST",
                                "BLOCK_H", "COPIES", "PREFETCH")},
}
MOE_DECODE_SPLIT_I_DIVISIBLE = _divisible(MOE_DECODE_SPLIT_I_SIGNATURE) + [
    k for k in ("stride_w13e", "stride_w13n", "stride_s13e", "stride_s13n", "stride_w2e", "stride_w2n",
                "stride_s2e", "stride_s2n") if k not in _divisible(MOE_DECODE_SPLIT_I_SIGNATURE)]


def _tile_constexprs(gate_up_tile: DecodeTile, down: SplitIDown, shift: bool, prefetch: bool) -> dict:
    t = gate_up_tile
    return dict(BLOCK_N=t.block_n, BLOCK_K=t.block_k, BLOCK_T=t.block_t, STAGES=t.num_stages, SHIFT=shift,
                K_WARPS=t.k_warps, EVICT_FIRST=t.evict_first, BLOCK_H=down.block_h, COPIES=down.copies, PREFETCH=prefetch)


def compile_constexprs(gate_up_tile: DecodeTile, down: SplitIDown, *, fast_decode: int = DECODE_PTX,
                       activation: str = "silu", s_block: int = 64, by_expert: bool = False) -> dict:
    """The kernel's constexprs (the compile harness; the launcher derives the same)."""
    return dict(ACTIVATION=activation, HAS_MAP=False, BY_EXPERT=by_expert, S_BLOCK=s_block, FAST_DECODE=fast_decode,
                EVEN_H=True, EVEN_I=True,
                **_tile_constexprs(gate_up_tile, down, gate_up_tile.shift_decode and fast_decode != DECODE_CVT,
                                   down.prefetch))


def moe_decode_split_i(
    x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, *,
    gate_up_tile: DecodeTile, down: SplitIDown, expert_map=None, activation: str = "silu", workspace=None,
    out=None, check_ids: bool = False,
):
    """The decode MoE layer in one launch, the down split over I → ``out [T, H]`` in ``x.dtype`` (T <=
    :data:`MAX_TOKENS`).

    ``workspace``: ``(sums, count)`` of :func:`split_i_workspace` (zero before the first call, left zero by every
    call; at least :func:`workspace_numel` sums); None allocates a zeroed one for this call."""
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor
    from ..format.reference import ACTIVATIONS

    check_split_i_tiles(gate_up_tile, down)
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, h = x.shape
    if t > MAX_TOKENS:
        raise ValueError(f"x: the split-I decode layer takes at most {MAX_TOKENS} tokens (its cast is one "
                         f"program's), got shape {list(x.shape)}")
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
    if workspace is None:
        workspace = split_i_workspace(t, h, down, x.device)
    sums, count = workspace
    check_tensor("workspace.sums", sums, dtype=torch.float32, device=x.device)
    check_tensor("workspace.count", count, dtype=torch.int32, device=x.device)
    need = workspace_numel(t, h, down)
    if sums.numel() < need or not sums.is_contiguous():
        raise ValueError(f"workspace.sums: expected a contiguous fp32 tensor of >= {need} elements, got shape "
                         f"{list(sums.shape)}")
    if t == 0:
        return out
    run = prepare_moe_decode_split_i(t, h, i, e, k, global_e, x.device, gate_up_tile=gate_up_tile, down=down,
                                     activation=activation, has_map=has_map)
    return run(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, sums, count,
               out)


def prepare_moe_decode_split_i(t: int, h: int, i: int, e: int, top_k: int, global_e: int, device, *,
                               gate_up_tile: DecodeTile, down: SplitIDown, activation: str, has_map: bool):
    """``run(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, sums, count,
    out=None) -> out [T, H]`` (checks nothing; as the other ready launches)."""
    import torch

    from .launch import ReadyKernel

    check_split_i_tiles(gate_up_tile, down)
    s = t * top_k
    rows = min(s, e)
    grid = (rows, triton.cdiv(i, gate_up_tile.block_n))
    fast = decode_kind(device)
    shift = gate_up_tile.shift_decode and shift_ok(h) and fast != DECODE_CVT  # (the native cvt needs none)
    launch_kw = dict(num_warps=gate_up_tile.num_warps, num_stages=gate_up_tile.num_stages,
                     **register_cap_option("DecodeTile", gate_up_tile.max_regs))
    launches = _Launches(lambda sh, stride_x, s13w, s13s, s2w, s2s, stride_o: ReadyKernel(
        _moe_decode_split_i_kernel, grid, S=s, H=h, I=i, E=e, GLOBAL_E=global_e, top_k=top_k, stride_xt=stride_x,
        stride_w13e=s13w[0], stride_w13n=s13w[1], stride_s13e=s13s[0], stride_s13n=s13s[1], stride_w2e=s2w[0],
        stride_w2n=s2w[1], stride_s2e=s2s[0], stride_s2n=s2s[1], stride_om=stride_o, ACTIVATION=activation,
        HAS_MAP=has_map, BY_EXPERT=rows < s, S_BLOCK=route_block(s), FAST_DECODE=fast,
        EVEN_H=h % gate_up_tile.block_k == 0, EVEN_I=i % gate_up_tile.block_n == 0,
        **_tile_constexprs(gate_up_tile, down, sh, down.prefetch and fast != DECODE_TL), **launch_kw,
    ))

    def run(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, sums, count,
            out=None):
        if out is None:
            out = torch.empty((t, h), dtype=x.dtype, device=x.device)
        # The shift decode needs 16-byte aligned code rows (see moe_decode.shift_ok); a bank that is not gets the
        # table decode, as the two-launch path does.
        launch = launches((shift and w13_codes.data_ptr() % 16 == 0, x.stride(0), w13_codes.stride(),
                           w13_sf.stride(), w2_codes.stride(), w2_sf.stride(), out.stride(0)))
        launch(x, w13_codes, w13_sf, w13_dec, w2_codes, w2_sf, w2_dec, topk_ids, emap, topk_weights, sums, count,
               out)
        return out

    return run
