"""``bench linear --peers gemlite``: the peer's rows beside ours, checked first, and a clean line when it cannot run,
with gemlite and the timer faked at their boundaries (CPU; the real run is on a GPU, see docs/benchmarks.md)."""

from __future__ import annotations

import sys

import pytest

from vllm_nvfp4_sm120 import bench
from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.format import linear_w4a16_ref

H200 = Capability(90, 132, "NVIDIA H200")


@pytest.fixture
def tiny_linear(monkeypatch):
    """One small layer, and a timer that runs the candidate once and reports 10 us per call of it."""
    monkeypatch.setitem(bench.MODELS, "tiny", [("qkv", 96, 512)])

    def time_graph(fn, repeats=20):
        return 1e-5 * len(fn())

    monkeypatch.setattr(bench, "time_graph", time_graph)


def _bench(peers=("gemlite",), kernels=("cublas-bf16",)):
    return bench.bench_linear(["tiny"], [1, 3], 1, list(kernels), peers=list(peers), device="cpu", cap=H200)


def test_the_peers_option():
    args = bench.build_parser().parse_args(["linear"])
    assert args.peers == [] and args.gemlite_autotune == "default"
    args = bench.build_parser().parse_args(["linear", "--peers", "gemlite", "--gemlite-autotune", "fast"])
    assert args.peers == ["gemlite"] and args.gemlite_autotune == "fast"
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["linear", "--peers", "gemlite,marlin"])


def test_gemlite_rows_beside_ours(tiny_linear, fake_gemlite_kernel, capsys):
    rows = _bench()
    peer = [r for r in rows if r.note == "peer"]
    assert [(r.t, r.kernel) for r in peer] == [(1, "gemlite (split 2)"), (3, "gemlite (split 2)")]
    assert all(r.us == pytest.approx(10.0) and r.read_tbs > 0 for r in peer)
    assert [r.kernel for r in rows if r.t == 1] == ["cublas-bf16 (dequantized weight)", "gemlite (split 2)"]
    assert "not timed" not in capsys.readouterr().out


def test_gemlite_absent_is_one_line_and_no_row(tiny_linear, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gemlite", None)
    monkeypatch.setitem(sys.modules, "gemlite.helper", None)
    rows = _bench()
    assert rows and not [r for r in rows if r.note == "peer"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "gemlite" in ln]
    assert len(lines) == 1 and lines[0].startswith("# gemlite: not timed: gemlite not importable")


def test_gemlite_that_misses_our_reference_is_not_timed(tiny_linear, fake_gemlite_kernel, capsys):
    fake_gemlite_kernel["output"] = lambda x, codes, scales, dec: 2 * linear_w4a16_ref(x, codes, scales, dec)
    rows = _bench()
    assert not [r for r in rows if r.note == "peer"]
    out = capsys.readouterr().out
    assert out.count("not timed: differs from our reference beyond its split-K allowance") == 2  # T = 1 and 3


def test_peer_ratios_take_our_fastest_candidate():
    def row(kernel, us, note=""):
        return bench.Row("m", "qkv", 96, 512, 1, kernel, us, 0.0, 0.0, note)

    rows = [row("ours-dispatch (a)", 20.0), row("ours-w4a16 (b)", 16.0, "<- w4a16 route"),
            row("cublas-bf16 (dequantized weight)", 12.0), row("gemlite (split 2)", 32.0, "peer")]
    (r,) = bench.peer_ratios(rows)
    assert (r["ours"], r["peer"], r["x"]) == ("ours-w4a16 (b)", "gemlite (split 2)", 2.0)
    assert bench.peer_ratios(rows[2:]) == []  # no candidate of ours at that shape: no ratio
