"""The loads probe of the streaming decode kernels (benchmarks/stream_loads_probe.py): on CPU, its expected sums
against a model of the runs its kernels walk (the linear stream-K grid, the MoE list of routed experts), its input
checks, and its compiles for sm_90 and sm_120 (the loads of the kernels it stands for, no MMA, no shuffle in the
loop); on a GPU, its results.  Gluon has no interpreter: the kernels themselves run only on a GPU."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from vllm_nvfp4_sm120.format import random_nvfp4
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs
from vllm_nvfp4_sm120.kernels.gluon_moe_decode import MoeStreamTile, moe_stream_grid

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "stream_loads_probe.py"
_spec = importlib.util.spec_from_file_location("stream_loads_probe", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


# ------------------------------------------------------------------------------------------------------------
# The linear walk
# ------------------------------------------------------------------------------------------------------------
def _runs_model(x, codes, scales, tile, ctas, load_x=True):
    """The probe's result built run by run as its kernel walks the stream-K grid (gluon_gemv_stream's ranges, a
    step's blocks per warp, the last step's surplus warps adding nothing), summed per (token tile, row tile)."""
    t, k = x.shape
    n = codes.shape[0]
    grid = gs.stream_grid(t, n, k, tile, ctas)
    nb, kw = grid.blocks_per_row, tile.num_warps // tile.row_warps
    c = (codes.view(torch.int32) & 0xF).long()
    s = (scales.view(torch.uint8) & 0xF).long()
    xw = (x.view(torch.int32) & 0xF).long()
    tiles = torch.zeros(grid.tiles_t, grid.tiles_m, dtype=torch.int64)
    for tt in range(grid.tiles_t):
        toks = [min(tt * tile.block_t + g, t - 1) for g in range(tile.block_t)]
        for p in range(grid.ctas):
            b, b_end = p * grid.total_blocks // grid.ctas, (p + 1) * grid.total_blocks // grid.ctas
            while b < b_end:
                row_tile = b // nb
                run_end = min(b_end, (row_tile + 1) * nb)
                rows = [min(row_tile * tile.block_m + m, n - 1) for m in range(tile.block_m)]
                for step in range(-(-(run_end - b) // kw)):
                    for w in range(kw):  # the warps of one kw (its row warps) share the block
                        kb = b - row_tile * nb + step * kw + w
                        if row_tile * nb + kb >= run_end:
                            continue  # a surplus warp of the last step
                        tiles[tt, row_tile] += int(c[rows, kb * 16:(kb + 1) * 16].sum())
                        tiles[tt, row_tile] += int(s[rows, kb * 8:(kb + 1) * 8].sum())
                        if load_x:
                            tiles[tt, row_tile] += tile.row_warps * int(xw[toks, kb * 64:(kb + 1) * 64].sum())
                b = run_end
    rows_of = torch.arange(n) // tile.block_m
    toks_of = torch.arange(t) // tile.block_t
    return tiles[toks_of][:, rows_of].float()


@pytest.mark.parametrize("t,n,k,tile,ctas", [
    (1, 100, 512, gs.StreamTile(32, 8), 7),
    (5, 64, 1024, gs.StreamTile(32, 8, max_regs=128), 3),
    (19, 40, 384, gs.StreamTile(32, 16), 5),
    (8, 130, 256, gs.StreamTile(64, 8, 4, 2), 4),
])
@pytest.mark.parametrize("load_x", [True, False])
def test_loads_probe_expected_is_the_sum_of_its_runs(gen, t, n, k, tile, ctas, load_x):
    w = random_nvfp4((n, k), gen=gen)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    want = probe.stream_loads_expected(x, w.codes, w.scales, tile, load_x=load_x)
    assert want.dtype == torch.float32 and want.shape == (t, n)
    torch.testing.assert_close(want, _runs_model(x, w.codes, w.scales, tile, ctas, load_x), rtol=0, atol=0)
    # one code word's low nibble moves its row tile's sums, once for the row and once for each padding row past N
    # (those re-read row N - 1)
    w.codes.view(torch.int32)[n - 1, 0] ^= 1
    moved = probe.stream_loads_expected(x, w.codes, w.scales, tile, load_x=load_x) - want
    pad = (-n) % tile.block_m
    assert moved[:, n - 1].abs().eq(1 + pad).all() and int(moved.ne(0).sum()) == t * (tile.block_m - pad)


def test_loads_probe_expected_of_no_tokens(gen):
    w = random_nvfp4((40, 256), gen=gen)
    none = torch.zeros(0, 256, dtype=torch.bfloat16)
    got = probe.stream_loads_expected(none, w.codes, w.scales, gs.StreamTile(32, 8))
    assert got.shape == (0, 40) and got.dtype == torch.float32


def test_loads_probe_refuses_what_it_cannot_read(gen):
    w = random_nvfp4((64, 512), gen=gen)
    x = torch.randn(2, 512).to(torch.bfloat16)
    tile = gs.StreamTile(32, 8)
    with pytest.raises(ValueError, match="K = 320 must be a multiple of 128"):
        probe.stream_loads_expected(torch.zeros(2, 320, dtype=torch.bfloat16), w.codes[:, :160], w.scales[:, :20], tile)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        probe.stream_loads_expected(x.half(), w.codes, w.scales, tile)
    with pytest.raises(ValueError, match=r"scales: expected shape \[64, 32\]"):
        probe.stream_loads_expected(x, w.codes, w.scales[:, :16], tile)
    with pytest.raises(ValueError, match="contiguous"):
        probe.stream_loads_expected(torch.zeros(512, 2, dtype=torch.bfloat16).t(), w.codes, w.scales, tile)
    with pytest.raises(ValueError, match="one-step loop"):
        probe.stream_loads_expected(x, w.codes, w.scales, gs.StreamTile(32, 8, max_regs=168, prefetch=2))


def _require_the_streaming_loads(rep, tile, load_x: bool):
    """No stack or local memory, and a main loop of two steps (two register buffers) with the streaming kernels'
    loads: per step one 16-byte code load and one 2-byte scale load per row of a lane, and the lane's activations
    (block_t / 8 tokens x 64 bytes) in 16-byte loads; no MMA, no shuffle; on sm_90 at 8 tokens, fewer instructions per
    code word than the streaming kernel's lightest decode probe."""
    from vllm_nvfp4_sm120.kernels.sass_stats import main_loop

    rep.require_no_local()
    assert rep.stack_bytes == 0, rep.summary()
    loop = main_loop(rep.sass, mma=r"LDG\.E\.128")
    rows_per_lane = tile.block_m // tile.row_warps // 8
    assert loop.count(r"LDG\.E\.128") == 2 * rows_per_lane, loop.ops
    assert loop.count(r"LDG\.E\.U16") == 2 * rows_per_lane, loop.ops
    assert loop.count(r"LDG\.E\.EL\.128") == (2 * 4 * tile.block_t // 8 if load_x else 0), loop.ops
    assert loop.count(r"[HO]MMA.*") == 0 and loop.count(r"SHFL.*") == 0, loop.ops
    if rep.arch == 90 and tile.block_t == 8:  # cheaper than the lightest decode probe (DECODE_RAW: 10.5 per word)
        assert loop.total / (2 * rows_per_lane * 4) < 10.5, loop.ops


def _probe_variants():
    """(tile, load_x, sums): the three variants on the planned tile at T <= 8, the checked one at T = 16."""
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan

    t8, t16 = stream_plan(8, 0, 0, 132, 9).tile, stream_plan(16, 0, 0, 132, 9).tile
    return [(t8, True, True), (t8, False, True), (t8, True, False), (t16, True, True)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("tile,load_x,sums", _probe_variants(), ids=str)
def test_loads_probe_compiles_to_the_plans_loads(arch, tile, load_x, sums):
    """The probe's loop issues the planned tile's loads (activations left out where asked) and no MMA, in the
    planned tile's register cap without stack; the sums variant keeps the cross-CTA count, the other has none."""
    from vllm_nvfp4_sm120.kernels.aot import compile_kernel

    consts = dict(LOAD_X=load_x, SUMS=sums, BLOCK_M=tile.block_m, BLOCK_T=tile.block_t, WARPS=tile.num_warps,
                  ROW_WARPS=tile.row_warps)
    rep = compile_kernel(f"{_PATH}:_stream_loads_kernel", probe.LOADS_SIGNATURE, consts, arch=arch,
                         num_warps=tile.num_warps, divisible=probe.LOADS_DIVISIBLE, gluon=True, maxnreg=tile.max_regs)
    _require_the_streaming_loads(rep, tile, load_x)
    assert bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", rep.ptx)) == sums


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,k", [(0, 64, 256), (1, 5120, 5120), (7, 1000, 2048), (16, 300, 1024), (20, 96, 512)])
@pytest.mark.parametrize("load_x", [True, False])
def test_loads_probe_on_the_gpu(t, n, k, load_x):
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(t * n)
    w = random_nvfp4((n, k), gen=gen, device="cuda")
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16).cuda()
    plan = stream_plan(t, n, k, sm, torch.cuda.get_device_capability()[0])
    for ctas in (plan.ctas, 3, -(-n // plan.tile.block_m)):  # the one-wave grid, a small one, one CTA per row tile
        ws = probe.workspace_for(t, n, k, plan.tile, ctas, "cuda")
        for _ in range(2):  # the counters are back to zero after a call: a second call on the workspace is right
            got = probe.stream_loads(x, w.codes, w.scales, tile=plan.tile, ctas=ctas, load_x=load_x, workspace=ws)
            torch.testing.assert_close(got, probe.stream_loads_expected(x, w.codes, w.scales, plan.tile, load_x),
                                       rtol=0, atol=0)
        assert int(ws.counters.abs().sum()) == 0


# ------------------------------------------------------------------------------------------------------------
# The MoE walk
# ------------------------------------------------------------------------------------------------------------
def _moe_walk_model(x, codes, scales, topk_ids, tile, ctas, down, load_x=True):
    """The MoE probe's result built run by run as its kernel walks the list of (routed expert, row tile, 128-k block):
    the stream-K split over the grid (clamped to the list's length), each run's columns (the expert's routes, then
    its first route again), a step's blocks per warp, the last step's surplus warps adding nothing."""
    e, rows, kh = codes.shape
    k, (t, top_k) = 2 * kh, topk_ids.shape
    n = rows if down else rows // 2
    grid = moe_stream_grid(t * top_k, e, n, k, tile, ctas, down=down)
    nb, kw, half = grid.blocks_per_row, tile.num_warps // tile.row_warps, tile.block_m // 2
    flat = topk_ids.reshape(-1).tolist()
    experts = list(dict.fromkeys(i for i in flat if 0 <= i < e))
    total = len(experts) * grid.tiles_e * nb
    c = (codes.view(torch.int32) & 0xF).long()
    s = (scales.view(torch.uint8) & 0xF).long()
    xw = (x.view(torch.int32) & 0xF).long()
    sums = torch.zeros(len(experts) * grid.tiles_e, dtype=torch.int64)
    live = max(1, min(grid.ctas, total))
    for p in range(grid.ctas):
        b, b_end = min(p, live) * total // live, min(p + 1, live) * total // live
        while b < b_end:
            lt = b // nb
            run_end = min(b_end, (lt + 1) * nb)
            q, j = divmod(lt, grid.tiles_e)
            routes = [r for r, i in enumerate(flat) if i == experts[q]]
            acts = [r if down else r // top_k for r in routes]
            cols = [acts[m] if m < len(acts) else acts[0] for m in range(tile.block_t)]
            if down:
                rws = [min(j * tile.block_m + r, n - 1) for r in range(tile.block_m)]
            else:
                rws = [g * n + min(j * half + r, n - 1) for g in (0, 1) for r in range(half)]
            for step in range(-(-(run_end - b) // kw)):
                for w in range(kw):
                    kb = b - lt * nb + step * kw + w
                    if lt * nb + kb >= run_end:
                        continue
                    sums[lt] += int(c[experts[q], rws, kb * 16:(kb + 1) * 16].sum())
                    sums[lt] += int(s[experts[q], rws, kb * 8:(kb + 1) * 8].sum())
                    if load_x:
                        sums[lt] += tile.row_warps * int(xw[cols, kb * 64:(kb + 1) * 64].sum())
            b = run_end
    return sums.float()


def _moe_case(gen, t, e, top_k, h, i, down, device="cpu"):
    """A bank (the gate_up's [E, 2I, H] or the down's [E, H, I]), its activations and a routing of distinct experts
    per token."""
    rows, k = (h, i) if down else (2 * i, h)
    w = random_nvfp4((e * rows, k), gen=gen)
    codes, scales = w.codes.view(e, rows, k // 2), w.scales.view(e, rows, k // 16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(torch.int32)
    x = torch.randn(t * top_k if down else t, k, generator=gen).to(torch.bfloat16)
    return [v.to(device) for v in (x, codes, scales, ids.reshape(t, top_k))]


MOE_CASES = [  # (t, e, top_k, h, i, tile, ctas)
    (1, 8, 2, 256, 128, MoeStreamTile(32, 8), 5),
    (3, 8, 2, 384, 128, MoeStreamTile(32, 8), 64),
    (8, 60, 4, 256, 256, MoeStreamTile(64, 8, 4, 2), 7),
    (5, 16, 8, 512, 384, MoeStreamTile(16, 8, ctas_per_sm=4), 3),
]


@pytest.mark.parametrize("t,e,top_k,h,i,tile,ctas", MOE_CASES)
@pytest.mark.parametrize("down", [False, True])
@pytest.mark.parametrize("load_x", [True, False])
def test_moe_loads_probe_expected_is_the_sum_of_its_runs(gen, t, e, top_k, h, i, tile, ctas, down, load_x):
    x, codes, scales, ids = _moe_case(gen, t, e, top_k, h, i, down)
    want = probe.moe_stream_loads_expected(x, codes, scales, ids, tile, down, load_x=load_x)
    torch.testing.assert_close(want, _moe_walk_model(x, codes, scales, ids, tile, ctas, down, load_x), rtol=0,
                               atol=0)
    # a nibble of a routed expert's first row moves the sums of its list tile 0 (and nothing of another expert)
    first = int(ids[0, 0])
    codes.view(torch.int32)[first, 0, 0] ^= 1
    moved = probe.moe_stream_loads_expected(x, codes, scales, ids, tile, down, load_x=load_x) - want
    assert int(moved.ne(0).sum()) == 1 and float(moved[0].abs()) == 1


def test_moe_loads_probe_refuses_what_it_cannot_read(gen):
    x, codes, scales, ids = _moe_case(gen, 2, 8, 2, 256, 128, False)
    tile = MoeStreamTile(32, 8)
    with pytest.raises(ValueError, match="K = 192 must be a multiple of 128"):
        probe.moe_stream_loads_expected(x[:, :192], codes[:, :, :96].contiguous(), scales[:, :, :12].contiguous(),
                                        ids, tile, False)
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32"):
        probe.moe_stream_loads_expected(x, codes, scales, ids.long(), tile, False)
    with pytest.raises(ValueError, match=r"x: expected shape \[4, 256\]"):  # the down's activations: one per route
        probe.moe_stream_loads_expected(x, codes, scales, ids, tile, True)
    with pytest.raises(ValueError, match="T = 9 tokens exceed the tile's 8"):
        nine = (x[:1].expand(9, -1).contiguous(), codes, scales, ids[:1].expand(9, -1).contiguous())
        probe.moe_stream_loads_expected(*nine, tile, False)
    with pytest.raises(ValueError, match="one-step loop"):
        probe.moe_stream_loads_expected(x, codes, scales, ids, MoeStreamTile(32, 8, overlap_runs=True), False)


def _table_moe_tiles():
    from vllm_nvfp4_sm120.dispatch.moe import DECODE_STREAM_DOWN_TILES, DECODE_STREAM_GATE_UP_TILES

    return ([(tile, False) for tile in DECODE_STREAM_GATE_UP_TILES.values()]
            + [(tile, True) for tile in DECODE_STREAM_DOWN_TILES.values()])


@pytest.mark.compile
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("tile,down", _table_moe_tiles(), ids=str)
def test_moe_loads_probe_compiles_to_the_kernels_loads(arch, tile, down):
    """The probe's walk on the MoE decode table's streaming tiles, in their register budgets without stack: the loop
    issues their loads and no MMA or shuffle."""
    from vllm_nvfp4_sm120.kernels.aot import compile_kernel

    consts = dict(DOWN=down, LOAD_X=True, SUMS=True, S_BLOCK=128, BLOCK_M=tile.block_m, BLOCK_T=tile.block_t,
                  WARPS=tile.num_warps, ROW_WARPS=tile.row_warps)
    rep = compile_kernel(f"{_PATH}:_moe_stream_loads_kernel", probe.MOE_LOADS_SIGNATURE, consts, arch=arch,
                         num_warps=tile.num_warps, divisible=probe.MOE_LOADS_DIVISIBLE, gluon=True,
                         maxnreg=probe.moe_register_cap(tile))
    _require_the_streaming_loads(rep, tile, True)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,top_k,h,i,tile,ctas", MOE_CASES + [
    (8, 128, 8, 2048, 768, MoeStreamTile(64, 8, 4, 2, ctas_per_sm=3), 396),
    (4, 512, 10, 2048, 512, MoeStreamTile(64, 8, 4, 2, max_regs=128, ctas_per_sm=4, late_cast=True), 528),
])
@pytest.mark.parametrize("down", [False, True])
def test_moe_loads_probe_on_the_gpu(t, e, top_k, h, i, tile, ctas, down):
    gen = torch.Generator().manual_seed(t * e + h)
    x, codes, scales, ids = _moe_case(gen, t, e, top_k, h, i, down, "cuda")
    want = probe.moe_stream_loads_expected(x, codes, scales, ids, tile, down)
    rows, k = (h, i) if down else (i, h)
    counters = torch.zeros(moe_stream_grid(t * top_k, e, rows, k, tile, ctas, down=down).counters_numel,
                           dtype=torch.int32, device="cuda")
    for _ in range(2):  # the counts return to zero: a second call on them is right
        got = probe.moe_stream_loads(x, codes, scales, ids, tile=tile, ctas=ctas, down=down, counters=counters)
        torch.testing.assert_close(got[:want.numel()], want, rtol=0, atol=0)
    assert int(counters.abs().sum()) == 0
    probe.moe_stream_loads(x, codes, scales, ids, tile=tile, ctas=ctas, down=down, sums=False)  # runs, unchecked
    torch.cuda.synchronize()
