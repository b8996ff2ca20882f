"""The H200 sweep script's host-side parts (benchmarks/linear_decode_sweep.py), on CPU: the read-only ceiling
kernel in the interpreter, the candidate lists and the summary table, so a device run cannot fail on them (the loads
probe the sweep times has its own tests: test_stream_loads_probe.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from vllm_nvfp4_sm120.format import random_nvfp4
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_decode_sweep.py"
_spec = importlib.util.spec_from_file_location("linear_decode_sweep", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


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
        assert kind == "stream" and (ctas >= 1 or (name == "stream-plan-rowtiles" and ctas == sweep.ROW_TILE_GRID))
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
        "stream-plan-loads-nosum": specs[0][1][1:3] + (True, False),
        "stream-plan-loads-rowtiles": (specs[0][1][1], sweep.ROW_TILE_GRID, True, True)}
    assert [sweep.is_probe(spec) for spec in loads.values()] == [False, False, True, False]
    # the plan's tile on one CTA per row tile: each CTA's range is exactly its row tile, so no tile is shared
    rowtiles = specs[names.index("stream-plan-rowtiles")][1]
    assert rowtiles[1:] == (specs[0][1][1], sweep.ROW_TILE_GRID, specs[0][1][3])
    for n, k in ((5120, 25600), (51200, 5120), (100, 256)):
        ctas = sweep.grid_ctas(rowtiles[2], n, rowtiles[1])
        grid = gs.stream_grid(t, n, k, rowtiles[1], ctas)
        assert ctas == grid.tiles_m == -(-n // rowtiles[1].block_m) and sweep.grid_ctas(7, n, rowtiles[1]) == 7
        assert all(p * grid.total_blocks // ctas == p * grid.blocks_per_row for p in range(ctas + 1))


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


def test_ladder_table():
    tile = gs.StreamTile(32, 8, max_regs=128)
    specs = {"stream-plan": ("stream", tile, 528, gs.DECODE_SHIFT),
             "stream-plan-raw": ("stream", tile, 528, gs.DECODE_RAW),
             "stream-plan-loads": ("loads", tile, 528, True, True),
             "stream-plan-rowtiles": ("stream", tile, sweep.ROW_TILE_GRID, gs.DECODE_SHIFT),
             "read-only (rows 32, split 1)": None}
    rows = [sweep._row("qwen3-32b", "down", 5120, 25600, 8, name, us * 1e-6, 73_728_000, 4.0, specs[name])
            for name, us in (("stream-plan", 30.0), ("stream-plan-raw", 25.0), ("stream-plan-loads", 20.0),
                             ("stream-plan-rowtiles", 24.0), ("read-only (rows 32, split 1)", 19.2))]
    text = sweep.ladder({"rows": rows})
    line = text.splitlines()[-1].split()
    assert line[:2] == ["qwen3-32b/down", "8"]
    assert line[2:] == ["0.61", "-", "0.74", "0.92", "-", "-", "0.77", "-", "0.96"]
    assert rows[3]["ctas"] == 160  # the row-tile grid resolved on the layer: 5120 rows / 32
    assert sweep.ladder({"rows": [rows[0], rows[4]]}) == ""  # no probe ran: no ladder

