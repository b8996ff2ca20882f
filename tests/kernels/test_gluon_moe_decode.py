"""Streaming MoE decode gate_up (kernels/gluon_moe_decode.py).

Gluon does not run in the interpreter.  On CPU: the tile and grid rules, the launcher's argument checks, and a torch
model of the kernel's work list (the distinct experts in first-slot order, each expert's routes as MMA columns, the
stream-K ranges, the partial slots and the last-arriver sum) against ``format.moe_ref``'s intermediate; the decode
step itself is the streaming linear kernel's, proven in test_gemv_stream.py.  ``compile``: every sweep tile for
sm_120 (native cvt) and sm_90 (shift decode).  ``gpu``: the layer with the streaming gate_up against ``moe_ref`` on
odd and real shapes, both activations, maps, fp16, the zeroed down workspace, bit-identical reruns and graph replay.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from moe_gpu_common import assert_moe_close
from test_moe_decode import SWEEP
from test_moe_decode import _problem as _decode_problem

from vllm_nvfp4_sm120.dispatch.moe import DECODE_STREAM_GATE_UP_TILES
from vllm_nvfp4_sm120.format import GlobalScale, NvFp4, dequantize_nvfp4, moe_ref
from vllm_nvfp4_sm120.kernels import gluon_moe_decode as gm
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.moe_decode import DecodeTile, moe_decode, moe_decode_gate_up
from vllm_nvfp4_sm120.kernels.sass_stats import main_loop


TILES = dict(SWEEP.STREAM_GATE_UP)
DOWN_TILE = DecodeTile(16, 128, 16, num_warps=1, num_stages=3, use_dot=True)


def _problem(t, e, k, h, i, *, dtype=torch.bfloat16, with_map=False, device="cpu", seed=0, ids_dtype=torch.int32):
    """test_moe_decode's problem (all code bytes, softmax top-k routing, with a map every other global expert
    local) on ``device``."""
    moved = lambda v: v.to(device) if v is not None else None  # noqa: E731
    problem = _decode_problem(t, e, k, h, i, dtype=dtype, with_map=with_map, ids_dtype=ids_dtype, seed=seed)
    return tuple(NvFp4(moved(v.codes), moved(v.scales)) if isinstance(v, NvFp4) else moved(v) for v in problem)


# ------------------------------------------------------------------------------------------------------------
# CPU: tiles, grid, checks
# ------------------------------------------------------------------------------------------------------------
def test_tile_rules():
    assert gm.MoeStreamTile(32, 8).columns == 16
    for bad in (dict(block_m=48, block_t=8), dict(block_m=32, block_t=12), dict(block_m=32, block_t=8, num_warps=3),
                dict(block_m=32, block_t=8, ctas_per_sm=0), dict(block_m=32, block_t=8, row_warps=2, num_warps=2,
                                                                  max_regs=8)):
        with pytest.raises(ValueError, match="MoeStreamTile"):
            gm.MoeStreamTile(**bad)
    assert gm.MoeStreamTile(32, 8, max_regs=128).launch_options == {"num_warps": 4, "maxnreg": 128}
    assert gm.MoeStreamTile(64, 8, row_warps=2).constexprs == dict(
        BLOCK_M=64, BLOCK_T=8, WARPS=4, ROW_WARPS=2, ROW_POINTERS=False, LATE_CAST=False, OVERLAP_RUNS=False,
        PREFETCH=1)
    assert gm.MoeStreamTile(32, 8, row_pointers=True).constexprs["ROW_POINTERS"] is True
    assert gm.MoeStreamTile(32, 8, late_cast=True).constexprs["LATE_CAST"] is True
    assert gm.MoeStreamTile(32, 8, overlap_runs=True).constexprs["OVERLAP_RUNS"] is True
    assert gm.MoeStreamTile(32, 8, prefetch=2).constexprs["PREFETCH"] == 2
    for bad in (dict(prefetch=3), dict(prefetch=0), dict(prefetch=2, overlap_runs=True)):
        with pytest.raises(ValueError, match="prefetch"):
            gm.MoeStreamTile(32, 8, **bad)


def test_grid_sizes_the_largest_list():
    tile = gm.MoeStreamTile(32, 8)
    g = gm.moe_stream_grid(routes=8, experts=128, n=768, k=2048, tile=tile, ctas=264)
    assert (g.tiles_e, g.blocks_per_row, g.max_experts, g.ctas) == (48, 16, 8, 264)
    assert g.counters_numel == 8 * 48
    # a CTA's range of ceil(8 * 48 * 16 / 264) = 24 blocks touches at most 3 row tiles of 16 blocks
    assert g.slots_per_cta == 3 and g.partials_numel(tile) == 264 * 3 * 32 * 8
    assert gm.moe_stream_grid(200, 8, 96, 80, tile, 4).max_experts == 8  # more routes than experts
    d = gm.moe_stream_grid(8, 128, 2048, 768, tile, 396, down=True)  # the down: H rows in tiles of block_m, K = I
    assert (d.tiles_e, d.blocks_per_row) == (64, 6)
    assert gm.down_workspace_numel(3, 2048, tile) == 3 * 2048 + 3 * 64
    assert gm.down_workspace_numel(3, 2048, gm.MoeStreamTile(32, 8, late_cast=True)) == 3 * 2048 + 1  # one count
    with pytest.raises(ValueError, match="32-bit"):
        gm.moe_stream_grid(1024, 256, 2048, 7168, tile, 10**6)


def test_launcher_checks():
    x, w13, d13, *_, ti, _ = _problem(3, 8, 2, 80, 96)
    tile = gm.MoeStreamTile(32, 8)
    run = lambda **kw: gm.moe_stream_gate_up(**({"x": x, "w13_codes": w13.codes, "w13_scales": w13.scales,  # noqa: E731
                                                   "w13_dec": d13, "topk_ids": ti, "tile": tile} | kw))
    with pytest.raises(TypeError, match="x"):
        run(x=x.float())
    with pytest.raises(ValueError, match="w13"):
        run(w13_scales=w13.scales[:, :-16])
    with pytest.raises(ValueError, match="T = 9 tokens exceed"):
        xx, _, _, _, _, _, ti9, _ = _problem(9, 8, 2, 80, 96)
        run(x=xx, topk_ids=ti9)
    with pytest.raises(ValueError, match="topk_ids"):
        run(topk_ids=torch.full_like(ti, 8))  # out of range (checked on CPU tensors)
    with pytest.raises(ValueError, match="activation"):
        run(activation="relu")
    with pytest.raises(ValueError, match="x: the streaming gate_up runs on a CUDA GPU"):
        run()
    with pytest.raises((TypeError, ValueError), match="out"):
        run(out=torch.empty(6, 95, dtype=x.dtype))
    with pytest.raises(ValueError, match="decode"):
        gm.prepare_moe_stream_gate_up(3, 80, 96, 8, 2, 8, "cpu", torch.bfloat16, tile=tile, ctas=4,
                                      activation="silu", has_map=False, zero_numel=None, decode=7)


def test_down_launcher_checks():
    t, e, k, h, i = 3, 8, 2, 80, 96
    *_, w2, d2, tw, ti, _ = _problem(t, e, k, h, i)
    inter = torch.randn(t * k, i).to(torch.bfloat16)
    tile = gm.MoeStreamTile(32, 8)
    ws = torch.zeros(gm.down_workspace_numel(t, h, tile))
    base = {"inter": inter, "w2_codes": w2.codes, "w2_scales": w2.scales, "w2_dec": d2, "topk_ids": ti,
            "topk_weights": tw, "workspace": ws, "tile": tile}
    run = lambda **kw: gm.moe_stream_down(**(base | kw))  # noqa: E731
    with pytest.raises(TypeError, match="inter"):
        run(inter=inter.float())
    with pytest.raises(ValueError, match="inter"):
        run(inter=inter[:-1])
    with pytest.raises(ValueError, match="workspace"):
        run(workspace=ws[:-1])
    with pytest.raises(ValueError, match="w2"):
        run(w2_scales=w2.scales[:, :-1])
    with pytest.raises(ValueError, match="topk_ids"):
        run(topk_ids=torch.full_like(ti, 8))
    with pytest.raises(ValueError, match="T = 9 tokens exceed"):
        run(topk_ids=ti.repeat(3, 1), topk_weights=tw.repeat(3, 1), inter=inter.repeat(3, 1),
            workspace=torch.zeros(gm.down_workspace_numel(9, h, tile)))
    with pytest.raises(ValueError, match="inter: the streaming down runs on a CUDA GPU"):
        run()
    with pytest.raises(ValueError, match="down_tile: the streaming down is expert-major"):
        x, w13, d13, *_ = _problem(t, e, k, h, i)
        moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=DOWN_TILE,
                   down_tile=tile, down="token")


# ------------------------------------------------------------------------------------------------------------
# CPU: a model of the kernel's work list against the reference intermediate
# ------------------------------------------------------------------------------------------------------------
def _weights(w13) -> torch.Tensor:
    """The bank's values without the per-expert decode global (exact in float64)."""
    return dequantize_nvfp4(w13.codes, w13.scales, GlobalScale.from_decode(1.0), torch.float64)


def kernel_model(x, w13, d13, ti, emap, tile, ctas, activation="silu", cta_order=None, trace=None, tw=None):
    """The kernel's index arithmetic in Python, the products in float64 on the dequantized weights (the decode
    step is gluon_gemv_stream's, proven there).  gate_up (``tw`` None): ``x [T, H]``, ``w13`` the stacked bank,
    returns the intermediate (rows of routes without a local expert NaN).  down (``tw``: the routing weights):
    ``x`` the intermediate ``[T * top_k, I]``, ``w13`` the down bank, returns ``[T, H]`` as the atomic epilogue
    leaves it (tokens without a local expert zero).  Checks that every counter ends at zero and that each token's
    tile is cast once, after its last local expert; with ``tile.late_cast`` every run adds into the sums and the
    last CTA to arrive casts them all, once."""
    down = tw is not None
    top_k = ti.shape[1]
    e, n_w, kk = w13.codes.shape[0], w13.codes.shape[1], x.shape[1]
    n = n_w if down else n_w // 2  # rows of the output (down: H) or intermediate columns (gate_up: I)
    ids = ti.reshape(-1).tolist()
    s = len(ids)
    t = s // top_k
    if emap is not None:
        ids = [int(emap[v]) if 0 <= v < len(emap) else -1 for v in ids]
    ids = [v if 0 <= v < e else -1 for v in ids]
    before = [sum(1 for b in range(a) if ids[b] == ids[a]) for a in range(s)]
    first = [ids[a] >= 0 and before[a] == 0 for a in range(s)]
    nth = [sum(first[: a + 1]) for a in range(s)]
    n_e = sum(first)
    grid = gm.moe_stream_grid(s, e, n, kk, tile, ctas, down=down)
    nb, tiles_e, half = grid.blocks_per_row, grid.tiles_e, tile.columns
    total = n_e * tiles_e * nb
    ctas = max(min(grid.ctas, total), 1)  # a list shorter than the grid: one block per CTA, the rest idle
    w = _weights(w13)
    out = torch.full((t, n) if down else (s, n), float("nan"), dtype=torch.float64)
    sums = torch.zeros(t, n, dtype=torch.float32)  # the down's atomic sums (fp32, as the kernel adds)
    n_local = [sum(1 for a in range(tok * top_k, (tok + 1) * top_k) if ids[a] >= 0) for tok in range(t)]
    tile_counts = [[0] * tiles_e for _ in range(t)]
    late = down and tile.late_cast
    arrivals = 0
    for tok in range(t) if down and not late else ():
        if n_local[tok] == 0:
            out[tok] = 0.0
    partials, counters = {}, [0] * grid.counters_numel
    xs = x.double()
    for pid in (cta_order or range(grid.ctas)):
        b_begin, b_end = min(pid, ctas) * total // ctas, min(pid + 1, ctas) * total // ctas
        first_tile = b_begin // nb
        b = b_begin
        while b < b_end:
            tl_ = b // nb
            run_end = min(b_end, (tl_ + 1) * nb)
            q, j = divmod(tl_, tiles_e)
            ex = next(ids[a] for a in range(s) if first[a] and nth[a] == q + 1)
            routes = [a for a in range(s) if ids[a] == ex]
            assert len(routes) <= tile.block_t
            if down:
                rows = [min(j * tile.block_m + r, n - 1) for r in range(tile.block_m)]
            else:
                rows = [(r // half) * n + min(j * half + r % half, n - 1) for r in range(tile.block_m)]
            y = torch.zeros(tile.block_m, tile.block_t, dtype=torch.float64)
            for kb in range(b - tl_ * nb, run_end - tl_ * nb):
                if trace is not None:
                    trace.append((ex, j, kb))
                k0, k1 = kb * 128, min(kk, (kb + 1) * 128)
                for c in range(tile.block_t):
                    r = routes[c if c < len(routes) else 0]
                    y[:, c] += w[ex][rows, k0:k1] @ xs[r if down else r // top_k, k0:k1]
            y = y.float()
            if late:  # this run's share straight into the sums: no partial slots, no count per token and tile
                for c, r in enumerate(routes):
                    live = [j * tile.block_m + m for m in range(tile.block_m) if j * tile.block_m + m < n]
                    sums[r // top_k, live] += y[: len(live), c] * float(d13[ex]) * float(tw.reshape(-1)[r])
                b = run_end
                continue
            p_first = ((tl_ * nb + 1) * ctas - 1) // total
            p_last = ((tl_ + 1) * nb * ctas - 1) // total
            done = p_first == p_last
            if not done:
                slot = pid * grid.slots_per_cta + (tl_ - first_tile)
                assert 0 <= tl_ - first_tile < grid.slots_per_cta and slot not in partials
                partials[slot] = y
                arrived = counters[tl_]
                counters[tl_] += 1
                done = arrived == p_last - p_first
                if done:
                    y = torch.zeros_like(y)
                    for p in range(p_first, p_last + 1):
                        y = y + partials[p * grid.slots_per_cta + (tl_ - p * total // ctas // nb)]
                    counters[tl_] = 0
            if done and down:
                y = y * float(d13[ex])
                for c, r in enumerate(routes):
                    tok = r // top_k
                    live = [j * tile.block_m + m for m in range(tile.block_m) if j * tile.block_m + m < n]
                    sums[tok, live] += y[: len(live), c] * float(tw.reshape(-1)[r])
                    tile_counts[tok][j] += 1
                    if tile_counts[tok][j] == n_local[tok]:  # the last of the token's experts casts the tile
                        assert out[tok, live].isnan().all(), "a token's tile is cast once"
                        out[tok, live] = sums[tok, live].double()
            elif done:
                dec = float(d13[ex])
                gate, up = y[:half].double() * dec, y[half:].double() * dec
                g = gate / (1 + torch.exp(-gate)) if activation == "silu" else \
                    0.5 * gate * (1 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))
                inter = g * up
                for c, r in enumerate(routes):
                    for col in range(half):
                        if j * half + col < n:
                            out[r, j * half + col] = inter[col, c]
            b = run_end
        if late:  # every CTA of the grid arrives once, an empty range too; the last casts every token
            arrivals += 1
            if arrivals == grid.ctas:
                assert out.isnan().all(), "the sums are cast once"
                out = sums.double()
                arrivals = 0  # the last CTA resets the count
    assert not any(counters) and not arrivals, "every counter is back at zero"
    return out


def _ref_inter(x, w13, d13, ti, emap, activation="silu"):
    """The intermediate of format.moe_ref's weight-only form, per route (NaN where no local expert)."""
    w = _weights(w13)
    e, i = w.shape[0], w.shape[1] // 2
    s = ti.numel()
    out = torch.full((s, i), float("nan"), dtype=torch.float64)
    for r, gid in enumerate(ti.reshape(-1).tolist()):
        ex = int(emap[gid]) if emap is not None else gid
        if 0 <= ex < e:
            h_ = w[ex] @ x[r // ti.shape[1]].double() * float(d13[ex])
            gate, up = h_[:i], h_[i:]
            g = gate / (1 + torch.exp(-gate)) if activation == "silu" else \
                0.5 * gate * (1 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))
            out[r] = g * up
    return out


MODEL_CASES = [  # (T, E, top_k, H, I, activation, map, tile, ctas)
    (1, 8, 2, 80, 96, "silu", False, gm.MoeStreamTile(32, 8), 5),
    (3, 8, 4, 336, 176, "gelu_tanh", False, gm.MoeStreamTile(16, 8), 7),
    (5, 60, 2, 256, 96, "silu", True, gm.MoeStreamTile(64, 8), 3),
    (8, 8, 8, 144, 96, "silu", False, gm.MoeStreamTile(32, 8), 64),  # every expert 8 routes, more CTAs than blocks
    (16, 60, 10, 80, 96, "silu", False, gm.MoeStreamTile(32, 16), 11),
    (1, 8, 1, 1040, 96, "silu", False, gm.MoeStreamTile(32, 8), 396),  # 54 blocks for 396 CTAs
    (2, 8, 2, 336, 176, "gelu_tanh", True, gm.MoeStreamTile(16, 8), 100),  # 0-4 experts x 11 tiles x 3 blocks
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_kernel_model_matches_reference(case):
    t, e, k, h, i, act, with_map, tile, ctas = case
    x, w13, d13, _, _, _, ti, emap = _problem(t, e, k, h, i, with_map=with_map)
    got = kernel_model(x, w13, d13, ti, emap, tile, ctas, act)
    want = _ref_inter(x, w13, d13, ti, emap, act)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-6)


DOWN_MODEL_CASES = [  # (T, E, top_k, H, I, map, tile, ctas)
    (1, 8, 2, 80, 96, False, gm.MoeStreamTile(32, 8), 5),
    (3, 60, 4, 176, 336, True, gm.MoeStreamTile(16, 8), 7),
    (8, 8, 8, 96, 144, False, gm.MoeStreamTile(32, 8), 64),
    (16, 60, 10, 80, 256, False, gm.MoeStreamTile(32, 16), 11),
    (1, 8, 1, 1040, 96, False, gm.MoeStreamTile(32, 8), 396),  # a list shorter than the grid
    # the cast by the last CTA: tiles shared by CTAs, a map with tokens that have no local expert, a short list
    (3, 60, 4, 176, 336, True, gm.MoeStreamTile(16, 8, late_cast=True), 7),
    (8, 8, 8, 96, 144, False, gm.MoeStreamTile(32, 8, late_cast=True), 64),
    (16, 60, 10, 80, 256, False, gm.MoeStreamTile(32, 16, late_cast=True), 11),
    (1, 8, 1, 1040, 96, False, gm.MoeStreamTile(32, 8, late_cast=True), 396),
    (4, 16, 1, 80, 96, True, gm.MoeStreamTile(32, 8, late_cast=True), 5),
]


@pytest.mark.parametrize("case", DOWN_MODEL_CASES, ids=str)
def test_down_model_matches_reference(case):
    t, e, k, h, i, with_map, tile, ctas = case
    x, w13, d13, w2, d2, tw, ti, emap = _problem(t, e, k, h, i, with_map=with_map)
    inter = _ref_inter(x, w13, d13, ti, emap).nan_to_num().to(torch.bfloat16)  # other ranks' rows: never read
    got = kernel_model(inter, w2, d2, ti, emap, tile, ctas, tw=tw)
    want = moe_ref(x, w13, d13, w2, d2, tw, ti, expert_map=emap).double() if emap is None else None
    # the down alone: sum over each token's local routes of tw * (inter[route] @ w2[e]^T * dec)
    w = _weights(w2)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for r, gid in enumerate(ti.reshape(-1).tolist()):
        ex = int(emap[gid]) if emap is not None else gid
        if 0 <= ex < e:
            ref[r // k] += float(tw.reshape(-1)[r]) * (w[ex] @ inter[r].double()) * float(d2[ex])
    assert not got.isnan().any(), "every token's row is written"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if want is not None:  # the layer as moe_ref computes it (its intermediate rounded to x's dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_kernel_model_covers_every_block_once_in_any_cta_order():
    import random

    x, w13, d13, _, _, _, ti, _ = _problem(4, 8, 4, 400, 176, seed=3)
    tile, ctas = gm.MoeStreamTile(32, 8), 13
    runs = []
    for seed in range(3):
        order = list(range(ctas))
        random.Random(seed).shuffle(order)
        trace = []
        runs.append(kernel_model(x, w13, d13, ti, None, tile, ctas, cta_order=order, trace=trace))
        experts = sorted({int(v) for v in ti.reshape(-1)})
        grid = gm.moe_stream_grid(ti.numel(), 8, 176, 400, tile, ctas)
        assert sorted(trace) == [(ex, j, kb) for ex in experts for j in range(grid.tiles_e)
                                 for kb in range(grid.blocks_per_row)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


# ------------------------------------------------------------------------------------------------------------
# Compiles: sm_120 (native cvt) and sm_90 (shift decode)
# ------------------------------------------------------------------------------------------------------------
KERNEL = "vllm_nvfp4_sm120.kernels.gluon_moe_decode:_moe_stream_kernel"
_compiled: dict = {}


def compile_tile(tile, arch=120, decode=0, dtype="bf16", has_map=True, even_k=True, activation="silu", down=False):
    key = (tile, arch, decode, dtype, has_map, even_k, activation, down)
    if key not in _compiled:
        sig = dict(gm.MOE_STREAM_SIGNATURE)
        for a in ("x_ptr", "out_ptr"):
            sig[a] = f"*{dtype}"
        consts = dict(DOWN=down, ACTIVATION=activation, HAS_MAP=has_map, ZERO=not down, S_BLOCK=64, DECODE=decode,
                      EVEN_K=even_k, **tile.constexprs)
        _compiled[key] = compile_kernel(KERNEL, sig, consts, arch=arch, num_warps=tile.num_warps,
                                        divisible=gm.MOE_STREAM_DIVISIBLE, gluon=True, maxnreg=tile.max_regs)
    return _compiled[key]


def _words(tile) -> int:
    """Code words one lane decodes per main-loop iteration: (prefetch + 1) steps (the loop is unrolled by its number
    of register buffers) x (rows per lane) x 4 words."""
    return (tile.prefetch + 1) * (tile.block_m // tile.row_warps // 8) * 4


def test_the_dispatch_tiles_are_among_the_compiled_ones():
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.moe import DECODE_STREAM_DOWN_TILES, DECODE_STREAM_GATE_UP_TILES, all_moe_plans

    assert set(DECODE_STREAM_GATE_UP_TILES.values()) <= set(TILES.values())
    downs = {tile for _, _, tile in SWEEP.STREAM_DOWN.values()}  # compiled in their down mode below
    assert set(DECODE_STREAM_DOWN_TILES.values()) <= downs
    for cc in (90, 120):
        plans = all_moe_plans(Capability(cc))
        used = {p.gate_up for p in plans if isinstance(p.gate_up, gm.MoeStreamTile)}
        assert used and used <= set(TILES.values()), cc
        used_downs = {p.stream_down for p in plans if p.stream_down is not None}
        assert used_downs and used_downs <= downs, cc


# (name, mode): the sweep's gate_up and down tiles, each in its mode
JOBS = [(n, False) for n in TILES] + [(n, True) for n in SWEEP.STREAM_DOWN]


def _tile(name, down):
    return SWEEP.STREAM_DOWN[name][2] if down else TILES[name]


@pytest.mark.compile
@pytest.mark.parametrize("name,down", JOBS, ids=str)
def test_sweep_tiles_compile_for_sm120(name, down):
    tile = _tile(name, down)
    rep = compile_tile(tile, down=down).require_no_local().require_smem()
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_sass(r"F2FP\.BF16\.E2M1\.UNPACK_B")
    rep.require_sass(r"HMMA\.16816\.F32\.BF16").require_ptx(r"atom\.global\.gpu\.acq_rel\.add")
    if down:  # the routing-weighted rows added into the token's fp32 sums
        rep.require_ptx(r"red\.global\.gpu\.add\.f32|atom\.global\.gpu\.(relaxed\.)?add\.f32")
    loop = main_loop(rep.sass)
    words = _words(tile)
    # one 16-byte load per row and step for the codes, four per token row and step for the activations (a lane
    # holds the rows of one token of eight)
    assert loop.count(r"LDG\.E.*\.128") == words // 4 + 4 * (tile.prefetch + 1) * tile.block_t // 8, loop.ops
    assert loop.count(r"F2FP\.BF16\.E2M1\.UNPACK_B") == 4 * words, loop.ops
    assert 4 * loop.count(r"F2FP\.BF16\.E4M3\.UNPACK_B") == words, loop.ops
    if tile.max_regs:
        assert rep.registers <= tile.max_regs
    print(rep.summary(), f"main loop {loop.total / words:.1f} instructions per code word")


@pytest.mark.compile
@pytest.mark.parametrize("name,down", JOBS, ids=str)
def test_sweep_tiles_compile_for_sm90_with_the_shift_decode(name, down):
    tile = _tile(name, down)
    rep = compile_tile(tile, arch=90, decode=2, down=down).require_no_local()
    assert not rep.has_ptx("e2m1")
    loop = main_loop(rep.sass)
    words = _words(tile)
    assert loop.count(r"HMUL2\.BF16_V2") == 4 * words, loop.ops
    assert loop.count(r"IMAD\.HI\.U32") == words, loop.ops
    per_word = loop.total / words
    assert per_word < 32, (per_word, loop.ops)  # the Triton gate_up loop: 31.6 with 16 routes
    print(rep.summary(), f"main loop {per_word:.1f} instructions per code word")


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, 0), (90, 2)])
@pytest.mark.parametrize("name", [n for n in TILES if TILES[n].row_pointers])
def test_row_pointers_take_fewer_address_instructions(name, arch, decode):
    """Each load's address is one IMAD.WIDE of the row pointer; without the option, a 32-bit offset is widened and
    added to the base (IMAD.SHL / IMAD.HI or SHF, then a 64-bit add).  The decode and the MMAs are the same, and the
    tile still fits 3 CTAs per SM."""
    from dataclasses import replace

    tile = TILES[name]
    rep = compile_tile(tile, arch=arch, decode=decode).require_no_local()
    plain = compile_tile(replace(tile, row_pointers=False), arch=arch, decode=decode)
    loop, plain_loop = main_loop(rep.sass), main_loop(plain.sass)
    words = _words(tile)
    assert loop.count(r"IMAD\.WIDE.*") and not plain_loop.count(r"IMAD\.WIDE.*"), (loop.ops, plain_loop.ops)
    for op in (r"HMMA.*", r"HMUL2.*", r"F2FP\.BF16\.E2M1.*", r"LDG.*"):
        assert loop.count(op) == plain_loop.count(op), (op, loop.ops, plain_loop.ops)
    assert loop.total <= plain_loop.total - words, (loop.total, plain_loop.total)  # at least 1 per code word
    assert rep.registers <= 168, rep.registers  # 4-warp CTAs: 3 per SM up to 168 registers
    print(rep.summary(), f"{loop.total / words:.1f} instructions per code word against {plain_loop.total / words:.1f}")


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, 0), (90, 2)])
def test_late_cast_ends_a_run_with_its_adds(arch, decode):
    """The down with the cast by the last CTA: one acquire-release atomic (the CTA's arrival) where the tile's
    protocol has the shared tile's count and the per-token count; the same loads, decode and MMAs in the main loop."""
    from dataclasses import replace

    tile = SWEEP.STREAM_DOWN["dns-m32t8-lc"][2]
    late = compile_tile(tile, arch=arch, decode=decode, down=True).require_no_local().require_smem()
    plain = compile_tile(replace(tile, late_cast=False), arch=arch, decode=decode, down=True)
    arrive = r"atom\.global\.gpu\.acq_rel\.add"
    assert len(re.findall(arrive, late.ptx)) == 1 and len(re.findall(arrive, plain.ptx)) >= 2
    fence = r"MEMBAR\.ALL\.GPU"  # the release before a count: once per CTA, after its runs
    assert len(re.findall(fence, late.sass)) == 1 and len(re.findall(fence, plain.sass)) >= 2
    assert late.registers <= plain.registers
    assert late.has_ptx(r"red\.global\.gpu\.add\.f32|atom\.global\.gpu\.(relaxed\.)?add\.f32")
    loop, plain_loop = main_loop(late.sass), main_loop(plain.sass)
    for op in (r"HMMA.*", r"HMUL2.*", r"F2FP\.BF16\.E2M1.*", r"LDG.*", r"LOP3.*", r"IMAD\.HI.*"):
        assert loop.count(op) == plain_loop.count(op), (op, loop.ops, plain_loop.ops)
    print(late.summary(), f"{loop.total} loop instructions;", plain.summary(), f"{plain_loop.total}")


OVERLAP_JOBS = [(n, False) for n in TILES if TILES[n].overlap_runs] + [
    (n, True) for n in SWEEP.STREAM_DOWN if SWEEP.STREAM_DOWN[n][2].overlap_runs]


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, 0), (90, 2)])
@pytest.mark.parametrize("name,down", OVERLAP_JOBS, ids=str)
def test_overlapped_runs_load_one_step_more_outside_the_loop(name, down, arch, decode):
    """With the runs overlapped the main loop is the plain tile's (the same loads, decode and MMAs); outside it the
    kernel has one step's loads more (the next run's first step, issued in the loop over runs before the run's last
    step, besides the first run's before that loop); no local memory, and a capped tile keeps its 3 CTAs per SM."""
    from dataclasses import replace

    tile = _tile(name, down)
    ov = compile_tile(tile, arch=arch, decode=decode, down=down).require_no_local().require_smem()
    plain = compile_tile(replace(tile, overlap_runs=False), arch=arch, decode=decode, down=down)
    loop, plain_loop = main_loop(ov.sass), main_loop(plain.sass)
    for op in (r"HMMA.*", r"HMUL2.*", r"F2FP\.BF16\.E2M1.*", r"LDG.*", r"LOP3.*", r"IMAD\.HI.*"):
        assert loop.count(op) == plain_loop.count(op), (op, loop.ops, plain_loop.ops)
    step_loads = loop.count(r"LDG.*") // 2  # the main loop is two steps
    ldg = lambda rep: len(re.findall(r"\bLDG\.", rep.sass))  # noqa: E731
    assert ldg(ov) == ldg(plain) + step_loads, (ldg(ov), ldg(plain), step_loads)
    if tile.max_regs:
        assert ov.registers <= tile.max_regs <= 168
    print(ov.summary(), f"{ldg(ov)} loads against {ldg(plain)};", plain.summary())


DEEP_JOBS = [n for n in TILES if TILES[n].prefetch == 2]


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, 0), (90, 2)])
@pytest.mark.parametrize("name", DEEP_JOBS)
def test_deep_prefetch_keeps_the_step_and_three_buffers(name, arch, decode):
    """Two steps ahead: the main loop is three steps of the one-step tile's step (the same loads, decode and MMAs
    per step), within the tile's cap and without local memory."""
    from dataclasses import replace

    tile = TILES[name]
    deep = compile_tile(tile, arch=arch, decode=decode).require_no_local().require_smem()
    plain = compile_tile(replace(tile, prefetch=1, max_regs=None), arch=arch, decode=decode)
    loop, plain_loop = main_loop(deep.sass), main_loop(plain.sass)
    for op in (r"HMMA.*", r"HMUL2.*", r"F2FP\.BF16\.E2M1.*", r"LDG.*", r"IMAD\.HI.*"):
        assert 2 * loop.count(op) == 3 * plain_loop.count(op), (op, loop.ops, plain_loop.ops)
    assert loop.count(r"HMMA.*") > 0 and deep.registers <= tile.max_regs
    print(deep.summary(), f"against {plain.registers} registers with one step ahead")


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode,dtype,even_k,activation", [(120, 0, "fp16", False, "gelu_tanh"),
                                                                 (90, 2, "fp16", False, "gelu_tanh"),
                                                                 (90, 1, "bf16", True, "silu")])
def test_other_variants_compile(arch, decode, dtype, even_k, activation):
    compile_tile(gm.MoeStreamTile(32, 8), arch=arch, decode=decode, dtype=dtype, has_map=False,
                 even_k=even_k, activation=activation).require_no_local().require_smem()


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, 0), (90, 2)])
@pytest.mark.parametrize("name", sorted(DECODE_STREAM_GATE_UP_TILES))
def test_table_gate_ups_compile_their_k_tail_without_local_memory(name, arch, decode):
    """H not a multiple of 128 runs the table's streaming gate_ups in their K-tail variant (uncapped).  The
    streaming down's K-tail variant spills under its cap, so the table keeps the Triton down there
    (dispatch/moe.py)."""
    tile = DECODE_STREAM_GATE_UP_TILES[name]
    assert tile.max_regs is None
    compile_tile(tile, arch=arch, decode=decode, even_k=False).require_no_local().require_smem()


# ------------------------------------------------------------------------------------------------------------
# GPU: against moe_ref
# ------------------------------------------------------------------------------------------------------------
GPU_CASES = [  # (T, E, top_k, H, I, activation, map, dtype)
    (4, 8, 1, 2048, 96, "silu", True, torch.bfloat16),  # top-1 over 16 global experts: tokens with no local one
    (1, 8, 1, 1040, 96, "silu", False, torch.bfloat16),
    (2, 60, 4, 2048, 176, "gelu_tanh", False, torch.bfloat16),
    (3, 128, 8, 1040, 704, "silu", True, torch.float16),
    (5, 8, 2, 2048, 96, "silu", False, torch.float16),
    (8, 256, 8, 7168, 256, "silu", False, torch.bfloat16),
    (8, 8, 8, 2048, 176, "gelu_tanh", True, torch.bfloat16),  # every local expert shared by several tokens
    (16, 60, 10, 2048, 96, "silu", False, torch.bfloat16),
]


def _gpu_tiles(t):
    return [n for n, tile in TILES.items() if t <= tile.block_t]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_layer_against_reference(case):
    t, e, k, h, i, act, with_map, dtype = case
    p = _problem(t, e, k, h, i, dtype=dtype, with_map=with_map, device="cuda", ids_dtype=torch.int64 if t == 2
                 else torch.int32)
    x, w13, d13, w2, d2, tw, ti, emap = p
    ref = moe_ref(x, w13, d13, w2, d2, tw, ti, activation=act, expert_map=emap)
    triton_inter = moe_decode_gate_up(x, w13.codes, w13.scales, d13, ti, tile=DOWN_TILE, expert_map=emap,
                                      activation=act)
    local = (emap[ti.long()] if emap is not None else ti).reshape(-1) >= 0
    for name in _gpu_tiles(t):
        tile = TILES[name]
        for down in ("token", "expert"):
            out = moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=tile,
                             down_tile=DOWN_TILE, down=down, expert_map=emap, activation=act)
            assert_moe_close(out, ref)
        inter = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=tile, expert_map=emap, activation=act)
        assert_moe_close(inter[local], triton_inter[local])
    for name, (_, _, dtile) in SWEEP.STREAM_DOWN.items():  # the streaming down after either gate_up
        if t > dtile.block_t:
            continue
        for gate in [DOWN_TILE] + [TILES[n] for n in _gpu_tiles(t)][:1]:
            out = moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate,
                             down_tile=dtile, down="expert", expert_map=emap, activation=act)
            assert_moe_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_late_cast_down_against_reference(case):
    """The streaming down with the cast by the last CTA after the Triton gate_up (which zeroes its sums and count),
    twice in a row: the count is back at zero after each call."""
    t, e, k, h, i, act, with_map, dtype = case
    x, w13, d13, w2, d2, tw, ti, emap = _problem(t, e, k, h, i, dtype=dtype, with_map=with_map, device="cuda")
    ref = moe_ref(x, w13, d13, w2, d2, tw, ti, activation=act, expert_map=emap)
    for name in ("dns-m32t8-lc", "dns-m64t8-rw2-lc", "dns-m32t16-lc", "dns-m32t8-lc-ov", "dns-m64t8-rw2-lc-ov",
                 "dns-m32t8-lc-c4"):
        dtile = SWEEP.STREAM_DOWN[name][2]
        if t > dtile.block_t:
            continue
        ws = torch.full((gm.down_workspace_numel(t, h, dtile),), 7.0, device="cuda")
        for _ in range(2):
            inter = moe_decode_gate_up(x, w13.codes, w13.scales, d13, ti, tile=DOWN_TILE, expert_map=emap,
                                       activation=act, zero=ws)
            out = gm.moe_stream_down(inter, w2.codes, w2.scales, d2, ti, tw, ws, tile=dtile, expert_map=emap)
            assert_moe_close(out, ref)
            assert int(ws[t * h:].view(torch.int32)[0]) == 0, name


@pytest.mark.gpu
def test_gpu_zeroes_the_buffer_reruns_bit_identical_and_replays():
    t, e, k, h, i = 4, 128, 8, 2048, 768
    x, w13, d13, *_, ti, _ = _problem(t, e, k, h, i, device="cuda")
    tile = TILES["gus-m32t8"]
    zero = torch.full((1000,), 3.0, device="cuda")
    first = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=tile, zero=zero)
    assert int(torch.count_nonzero(zero)) == 0
    again = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=tile)
    assert torch.equal(first, again)
    run = gm.prepare_moe_stream_gate_up(t, h, i, e, k, e, "cuda", x.dtype, tile=tile, ctas=tile.ctas("cuda"),
                                        activation="silu", has_map=False, zero_numel=None)
    out = torch.empty_like(first)
    flat = ti.reshape(-1)
    run(x, w13.codes, w13.scales.view(torch.uint8), d13, flat, flat, out)
    assert torch.equal(out, first)
    graph = torch.cuda.CUDAGraph()
    out.zero_()
    with torch.cuda.graph(graph):
        run(x, w13.codes, w13.scales.view(torch.uint8), d13, flat, flat, out)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    assert all(int(torch.count_nonzero(c)) == 0 for c in run.counters.by_stream.values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in TILES if TILES[n].row_pointers])
def test_gpu_row_pointers_change_no_bit(name):
    """The row pointers only compute the same addresses another way: the gate_up's bits are the tile's without
    them, and the tile as the streaming down too (its own mode) matches the reference."""
    from dataclasses import replace

    t, e, k, h, i = 6, 128, 8, 2048, 768
    x, w13, d13, w2, d2, tw, ti, _ = _problem(t, e, k, h, i, device="cuda")
    tile = TILES[name]
    first = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=tile)
    plain = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti,
                                  tile=replace(tile, row_pointers=False))
    assert torch.equal(first, plain)
    out = moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=tile,
                     down_tile=tile, down="expert")
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in TILES if TILES[n].overlap_runs])
@pytest.mark.parametrize("t", [1, 6])
def test_gpu_overlapped_runs_change_no_bit(name, t):
    """The overlapped runs load the same blocks earlier and sum the same partials in the same order: the gate_up's
    bits are the tile's without the option (a CTA with several runs, several experts, a map with other ranks'
    experts)."""
    from dataclasses import replace

    e, k, h, i = 128, 8, 2048, 768
    x, w13, d13, w2, d2, tw, ti, emap = _problem(t, e, k, h, i, device="cuda", with_map=True)
    tile = TILES[name]
    first = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=tile, expert_map=emap)
    plain = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=replace(tile, overlap_runs=False),
                                  expert_map=emap)
    local = emap[ti.long()].reshape(-1) >= 0
    assert torch.equal(first[local], plain[local])


@pytest.mark.gpu
@pytest.mark.parametrize("name", DEEP_JOBS)
@pytest.mark.parametrize("t,h", [(1, 2048), (6, 2048), (3, 7168)])
def test_gpu_deep_prefetch_changes_no_bit(name, t, h):
    """Two steps ahead decodes the same steps in the same order: the gate_up's bits are the one-step tile's (runs of
    1 to many steps: H = 2048 has 16 blocks of 128 per row, H = 7168 56; several experts, other ranks' experts)."""
    from dataclasses import replace

    e, k, i = 128, 8, 768
    x, w13, d13, w2, d2, tw, ti, emap = _problem(t, e, k, h, i, device="cuda", with_map=True)
    tile = TILES[name]
    got = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=tile, expert_map=emap)
    plain = gm.moe_stream_gate_up(x, w13.codes, w13.scales, d13, ti, tile=replace(tile, prefetch=1), expert_map=emap)
    local = emap[ti.long()].reshape(-1) >= 0
    assert torch.equal(got[local], plain[local])
    out = moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=tile,
                     down_tile=DOWN_TILE, down="expert", expert_map=emap)
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti, expert_map=emap))


@pytest.mark.gpu
@pytest.mark.parametrize("down_name", ["dns-m32t8", "dns-m32t8-lc", "dns-m32t8-lc-ov"])
def test_gpu_stream_layer_replays_under_a_graph(down_name):
    t, e, k, h, i = 4, 128, 8, 2048, 768
    x, w13, d13, w2, d2, tw, ti, _ = _problem(t, e, k, h, i, device="cuda")
    ref = moe_ref(x, w13, d13, w2, d2, tw, ti)
    gate, down = TILES["gus-m32t8"], SWEEP.STREAM_DOWN[down_name][2]
    layer = lambda out=None: moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,  # noqa: E731
                                        gate_up_tile=gate, down_tile=down, down="expert", out=out)
    eager = layer()
    assert_moe_close(eager, ref)
    out = torch.zeros_like(eager)
    layer(out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(out)
    for _ in range(3):  # the gate_up kernel re-zeroes the down's sums and counts on every replay
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, rtol=2**-7, atol=1e-3)  # fp32 atomics: the add order may vary

