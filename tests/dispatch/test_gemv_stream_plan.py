"""Tile and grid rules of the streaming decode kernel (dispatch/gemv_stream_plan.py).  The register counts the
rules rest on are checked against real compiles in tests/kernels/test_gemv_stream.py."""

from __future__ import annotations

import pytest

from vllm_nvfp4_sm120.dispatch import gemv_stream_plan as plan
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs


def test_every_tile_has_register_data_for_both_architectures():
    for arch in (9, 12):
        assert set(plan.TILE_REGISTERS[arch]) == set(gs.STREAM_TILES)


@pytest.mark.parametrize("regs,warps,want", [(154, 4, 3), (168, 4, 3), (169, 4, 2), (255, 4, 2), (128, 4, 4),
                                             (154, 8, 1)])
def test_ctas_per_sm(regs, warps, want):
    assert plan.ctas_per_sm(regs, warps) == want


@pytest.mark.parametrize("cc_major,sm", [(9, 132), (12, 170), (12, 188)])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 8, 9, 16])
def test_plan_is_one_wave_of_a_listed_tile(t, cc_major, sm):
    p = plan.stream_plan(t, 5120, 8192, sm, cc_major)
    assert p.tile in gs.STREAM_TILES and p.tile.block_t >= t and p.why
    regs = plan.TILE_REGISTERS[cc_major][p.tile]
    assert p.ctas == plan.ctas_per_sm(regs, p.tile.num_warps) * sm  # one token tile: every CTA resident


def test_two_token_tiles_share_the_wave():
    tile = gs.StreamTile(128, 8, 4, 2)
    one = plan.wave_ctas(tile, 8, 132, 9)
    assert plan.wave_ctas(tile, 16, 132, 9) == one // 2
