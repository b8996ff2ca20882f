"""``bench moe_decode``: the rows built from what is measured, with the layer and the timer faked at their
boundaries (CPU; the real run is on a GPU, see docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from vllm_nvfp4_sm120 import bench
from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.format import NvFp4, moe_ref

H200 = Capability(90, 132, "NVIDIA H200")
COST_US = {"decode": 10.0, "triton": 25.0}  # per layer call, by the plan's implementation


@pytest.fixture
def fake_gpu(monkeypatch):
    """The layer computes the reference and records the plan's cost; ``time_graph`` reports the recorded costs of
    one run of ``fn`` (every copy's call)."""
    calls, spent = [], []

    def layer(x, w13_codes, w13_scales, d13, w2_codes, w2_scales, d2, tw, ti, *, plan, out=None):
        calls.append((plan, x.shape[0]))
        spent.append(COST_US[plan.impl])
        ref = moe_ref(x, NvFp4(w13_codes, w13_scales), d13, NvFp4(w2_codes, w2_scales), d2, tw, ti)
        return ref if out is None else out.copy_(ref)

    def time_graph(fn, repeats=20):
        spent.clear()
        fn()
        return sum(spent) * 1e-6

    monkeypatch.setattr(bench, "time_graph", time_graph)
    monkeypatch.setitem(bench.MOE_SHAPES, "tiny", (256, 256, 64, 2))
    return layer, calls


def test_rows_from_the_measurements(fake_gpu):
    layer, calls = fake_gpu
    tokens = [1, 4, 32, 64]
    rows = bench.bench_moe_decode(["tiny"], tokens, 1.0, 2.0, device="cpu", cap=H200, layer=layer)
    assert [r.t for r in rows] == tokens
    per_call = bench.expert_bytes(256, 256)
    assert per_call == 3 * 256 * 256 * 9 // 16
    for r in rows:
        assert (r.h, r.i, r.e, r.top_k, r.copies) == (256, 256, 64, 2, 2)
        assert r.decode_us == pytest.approx(10.0) and r.today_us == pytest.approx(25.0)
        assert r.speedup == pytest.approx(2.5)
        assert 1 <= r.experts_touched <= min(64, 2 * r.t)
        assert r.floor_us == pytest.approx(r.experts_touched * per_call / 2e12 * 1e6)
        assert r.fraction_of_floor == pytest.approx(r.floor_us / 10.0)
        assert r.rel_err == 0.0  # the fake layer is the reference
        assert "decode" in r.decode_plan and r.today_plan == "sm90/w4a16/0"
    # The table takes the decode plan up to T = 64 below 4 routes per expert (2 at T = 64 here).
    assert [r.table_picks_decode for r in rows] == [True, True, True, True]
    # Per T: one checked call (decode plan), then each plan once per copy in the warm-up run of its graph.
    impls = [p.impl for p, _ in calls]
    assert impls == ["decode", "decode", "decode", "triton", "triton"] * len(tokens)
    table = bench.decode_markdown(rows)
    assert table.count("\n") == len(tokens) + 1 and "| tiny (256, 256, 64, 2) | 64 |" in table


def test_copies_beyond_l2_within_memory():
    # Qwen3-30B-A3B: 8 experts a call (21 MB): 16 copies for 2 GB; DeepSeek-V3: 6.3 GB a bank, so 3 copies.
    assert bench.decode_copies(2048, 768, 128, 8, 2e9) == bench.DECODE_MAX_COPIES
    assert bench.decode_copies(7168, 2048, 256, 8, 2e9) == 3
    assert bench.decode_copies(2048, 768, 128, 8, 1) == 2


def test_the_subcommand_defaults():
    args = bench.build_parser().parse_args(["moe_decode"])
    assert args.tokens == "1,2,4,8,16,32,64" and args.models == ",".join(bench.MOE_SHAPES)
    assert set(bench.MOE_SHAPES) >= {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "qwen3-next-80b-a3b"}
    assert bench.MOE_SHAPES["deepseek-v3"] == (7168, 2048, 256, 8)


def test_no_decode_plan_is_an_error(fake_gpu):
    layer, _ = fake_gpu
    with pytest.raises(ValueError, match="no decode plan"):
        bench.bench_moe_decode(["tiny"], [1], 1.0, 2.0, device="cpu", cap=Capability(80), layer=layer)
