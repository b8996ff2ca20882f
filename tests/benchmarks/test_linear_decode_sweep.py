"""The H200 sweep script's host-side parts (benchmarks/linear_decode_sweep.py), on CPU: the read-only ceiling
kernel in the interpreter, the candidate lists and the summary table, so a device run cannot fail on them; and the
loads probe beside it (benchmarks/stream_loads_probe.py): its expected sums against a model of its runs, its input
checks, its compiles for sm_90 and sm_120, and (on a GPU) its result."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from vllm_nvfp4_sm120.format import random_nvfp4
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_decode_sweep.py"
_spec = importlib.util.spec_from_file_location("linear_decode_sweep", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)
probe = importlib.import_module("stream_loads_probe")  # beside the sweep, which puts its folder on the path


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("words", [w for w, _ in sweep.READ_ONLY_WIDTHS])
@pytest.mark.parametrize("n,k,block_m,split", [(37, 1024, 32, 1), (64, 512, 16, 3), (5, 256, 64, 2)])
def test_read_only_kernel_reads_every_byte(gen, n, k, block_m, split, words):
    w = random_nvfp4((n, k), gen=gen)
    out = torch.empty(-(-n // block_m) * split, dtype=torch.int32)
    got = sweep.xor_words(sweep.read_only(w.codes, w.scales, out, block_m=block_m, block_w=words, split=split))
    assert got == sweep.read_only_expected(w.codes, w.scales, block_m)
    w.codes[n // 2, 3] ^= 1  # one flipped bit anywhere changes the result
    got2 = sweep.xor_words(sweep.read_only(w.codes, w.scales, out, block_m=block_m, block_w=words, split=split))
    assert got2 == got ^ (1 << 24)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("n,k,block_m,block_w,split", [(37, 1024, 16, 32, 1), (64, 512, 32, 32, 3),
                                                       (200, 2048, 64, 64, 2)])
def test_read_only_tma_kernel_reads_every_byte(gen, n, k, block_m, block_w, split):
    w = random_nvfp4((n, k), gen=gen)
    out = torch.empty(-(-n // block_m) * split, dtype=torch.int32)
    got = sweep.xor_words(sweep.read_only_tma(w.codes, w.scales, out, block_m, block_w, split, num_stages=2))
    assert got == sweep.read_only_expected(w.codes, w.scales, 1)  # rows past N are TMA's zeros
    w.scales.view(torch.uint8)[n - 1, -1] ^= 1  # the last scale byte counts too
    got2 = sweep.xor_words(sweep.read_only_tma(w.codes, w.scales, out, block_m, block_w, split, num_stages=2))
    assert got2 == got ^ (1 << 24)


@pytest.mark.parametrize("cc_major", [9, 12])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16])
def test_candidates(t, cc_major):
    specs = sweep.stream_specs(t, 132, cc_major)
    names = [name for name, _ in specs]
    assert len(names) == len(set(names)) and names[0] == "stream-plan"
    loads = {name: spec for name, spec in specs if spec[0] == "loads"}
    streams = [(name, spec) for name, spec in specs if name not in loads]
    for name, spec in streams:
        kind, tile, ctas, decode = spec
        assert kind == "stream" and ctas >= 1
        # the timing probes (nothing to check) are named as such; every other candidate is checked
        probes = {"stream-plan-nodecode": gs.DECODE_COPY, "stream-plan-raw": gs.DECODE_RAW}
        assert (decode in gs.PROBE_DECODE_NAMES) == (name in probes) == sweep.is_probe(spec)
        assert decode == probes[name] if name in probes else decode in gs.DECODE_NAMES
        assert (tile in gs.STREAM_TILES or tile in sweep.SPILL_PROBE_TILES or tile in gs.DEEP_PREFETCH_TILES
                or tile in sweep.WIDE_STEP_TILES)
    # every listed tile of the token block is a candidate, on its one-wave grid
    block_t = 8 if t <= 8 else 16
    tiles = {tile: ctas for name, (_, tile, ctas, _) in streams
             if (name == "stream-plan" or name == sweep.stream_name(tile)) and tile in gs.STREAM_TILES}
    assert set(tiles) == {tile for tile in gs.STREAM_TILES if tile.block_t == block_t}
    assert all(ctas == sweep.wave_ctas(tile, t, 132, cc_major) for tile, ctas in tiles.items())
    # the spill probes: every one of the token block, each on the grid its register cap makes one wave
    probes = {tile: ctas for name, (_, tile, ctas, _) in streams if name.endswith("-spill")}
    assert set(probes) == {tile for tile in sweep.SPILL_PROBE_TILES if tile.block_t == block_t} and probes
    tiles_t = -(-t // block_t)
    assert all(ctas == 65536 // (tile.max_regs * 32 * tile.num_warps) * 132 // tiles_t for tile, ctas in probes.items())
    # the two-steps-ahead tiles of the token block, likewise on their caps' grids
    deep = {tile: ctas for name, (_, tile, ctas, _) in streams if name.endswith("pf2")}
    assert set(deep) == {tile for tile in gs.DEEP_PREFETCH_TILES if tile.block_t == block_t} and deep
    assert all(ctas == sweep.capped_wave_ctas(tile, t, 132) for tile, ctas in deep.items())
    assert sweep.selected("stream-plan", ["plan"]) and not sweep.selected("gemlite", ["stream"])
    exact = ["stream-plan$"]
    assert sweep.selected("stream-plan", exact) and not sweep.selected("stream-plan-2waves", exact)
    # the 8-warp tiles at T <= 8, on their caps' grids (2 CTAs of 8 warps per SM)
    wide = {tile: ctas for name, (_, tile, ctas, _) in streams if "w8r1" in name}
    assert set(wide) == (set(sweep.WIDE_STEP_TILES) if t <= 8 else set())
    assert all(ctas == 2 * 132 for ctas in wide.values())
    # the probes run the planned tile on the planned grid
    for name in ("stream-plan-nodecode", "stream-plan-raw"):
        assert specs[names.index(name)][1][1:3] == specs[0][1][1:3]
    # the loads probe: the planned tile and grid; with and without the activations, checked; without the sums, not
    assert {name: spec[1:] for name, spec in loads.items()} == {
        "stream-plan-loads": specs[0][1][1:3] + (True, True),
        "stream-plan-loads-nox": specs[0][1][1:3] + (False, True),
        "stream-plan-loads-nosum": specs[0][1][1:3] + (True, False)}
    assert [sweep.is_probe(spec) for spec in loads.values()] == [False, False, True]


def test_summary_table():
    rows = [sweep._row("qwen3-32b", "qkv", 10240, 5120, 1, name, us * 1e-6, 29_491_200, 4.4,
                       ("stream", gs.StreamTile(128, 8, 4, 2), 396, gs.DECODE_SHIFT) if name.startswith("stream")
                       else None)
            for name, us in (("stream-plan", 9.0), ("stream-64x8w4r1", 10.0), ("gluon-today", 16.0),
                             ("cublas-bf16", 28.0), ("gemlite (default)", 20.0), ("read-only (rows 32, split 1)", 8.0),
                             ("read-only-tma (rows 64, words 32, stages 3, split 2)", 7.0))]
    text = sweep.summary({"rows": rows, "dram_read_tbs": 4.4, "failures": ["x: wrong"]})
    assert "qwen3-32b/qkv" in text and "(3.11)" in text and "FAILED" in text
    assert "3.69" in text and "4.21" in text  # the pointer and TMA read ceilings, each in its column
    assert rows[0]["tile"] and rows[0]["decode"] == "shift"
    # a timing probe, however fast, is never the best streaming candidate
    tile = gs.StreamTile(128, 8, 4, 2)
    fast = [sweep._row("qwen3-32b", "qkv", 10240, 5120, 1, "stream-plan-raw", 1e-6, 29_491_200, 4.4,
                       ("stream", tile, 396, gs.DECODE_RAW)),
            sweep._row("qwen3-32b", "qkv", 10240, 5120, 1, "stream-plan-loads", 1e-6, 29_491_200, 4.4,
                       ("loads", tile, 396, True, True))]
    text = sweep.summary({"rows": rows + fast, "dram_read_tbs": 4.4, "failures": []})
    assert "plan" in text.splitlines()[2].split()[2] and "(3.11)" in text
    assert fast[1]["decode"] == "loads only"


# ------------------------------------------------------------------------------------------------------------
# The loads probe (benchmarks/stream_loads_probe.py)
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
    from vllm_nvfp4_sm120.kernels.sass_stats import main_loop

    consts = dict(LOAD_X=load_x, SUMS=sums, BLOCK_M=tile.block_m, BLOCK_T=tile.block_t, WARPS=tile.num_warps,
                  ROW_WARPS=tile.row_warps)
    rep = compile_kernel(f"{Path(probe.__file__)}:_stream_loads_kernel", probe.LOADS_SIGNATURE, consts, arch=arch,
                         num_warps=tile.num_warps, divisible=probe.LOADS_DIVISIBLE, gluon=True, maxnreg=tile.max_regs)
    rep.require_no_local()
    assert rep.stack_bytes == 0, rep.summary()
    loop = main_loop(rep.sass, mma=r"LDG\.E\.128")
    rows_per_lane = tile.block_m // tile.row_warps // 8
    # two steps per iteration (two register buffers): per step, one 16-byte code load and one 2-byte scale load per
    # row of a lane, and the lane's activations (BLOCK_T / 8 tokens x 64 bytes) in 16-byte loads
    assert loop.count(r"LDG\.E\.128") == 2 * rows_per_lane, loop.ops
    assert loop.count(r"LDG\.E\.U16") == 2 * rows_per_lane, loop.ops
    assert loop.count(r"LDG\.E\.EL\.128") == (2 * 4 * tile.block_t // 8 if load_x else 0), loop.ops
    assert loop.count(r"[HO]MMA.*") == 0 and loop.count(r"SHFL.*") == 0, loop.ops
    assert bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", rep.ptx)) == sums


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,k", [(1, 5120, 5120), (7, 1000, 2048), (16, 300, 1024), (20, 96, 512)])
@pytest.mark.parametrize("load_x", [True, False])
def test_loads_probe_on_the_gpu(t, n, k, load_x):
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(t * n)
    w = random_nvfp4((n, k), gen=gen, device="cuda")
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16).cuda()
    plan = stream_plan(t, n, k, sm, torch.cuda.get_device_capability()[0])
    for ctas in (plan.ctas, 3):
        ws = probe.workspace_for(t, n, k, plan.tile, ctas, "cuda")
        for _ in range(2):  # the counters are back to zero after a call: a second call on the workspace is right
            got = probe.stream_loads(x, w.codes, w.scales, tile=plan.tile, ctas=ctas, load_x=load_x, workspace=ws)
            torch.testing.assert_close(got, probe.stream_loads_expected(x, w.codes, w.scales, plan.tile, load_x),
                                       rtol=0, atol=0)
        assert int(ws.counters.abs().sum()) == 0
