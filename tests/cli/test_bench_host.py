"""``python -m vllm_nvfp4_sm120.bench host [--cold]``: its arguments; timings only on a GPU (no timed tests)."""

import pytest
import torch

from vllm_nvfp4_sm120 import bench, bench_host


def test_parser_has_host_and_cold():
    args = bench.build_parser().parse_args(["host", "--cold", "--sizes", "1,8", "--json", "x.json"])
    assert args.func is bench_host.run and args.cold and args.sizes == "1,8" and args.json == "x.json"
    assert args.jobs == bench_host.COLD_JOBS > 1  # the parallel phase runs by default
    assert args.timeout + bench_host.WARM_TIMEOUT_S + bench_host.PARALLEL_TIMEOUT_S <= 210


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_says_so(capsys):
    assert bench.main(["host"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err



def test_rows_are_timed_in_interleaved_rounds(monkeypatch):
    # Every round times each candidate once, in order; a candidate that raises is a row that did not run; a ratio is
    # the median of the per-round ratios (a host that slows down between rounds moves both sides of it).
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench_host, "kernels_per_call", lambda fn: 1.0)
    order = []
    rows = bench_host._Rows()
    rows.add("a", lambda: order.append("a"))
    rows.add("broken", lambda: 1 / 0)
    rows.add("b", lambda: order.append("b"), count=False)
    order.clear()
    rows.measure(calls=2, rounds=3)
    assert order == ["a", "a", "b", "b"] * 3
    a, broken, b = rows.rows
    assert broken["host_us"] is None and "ZeroDivisionError" in broken["note"]
    assert len(a["round_us"]) == 3 and a["host_us"] > 0 and a["kernels"] == 1.0 and b["kernels"] is None
    assert bench_host._ratio(a, a) == 1.0 and bench_host._ratio(broken, a) is None
    a["round_us"], b["round_us"] = [1.0, 2.0, 4.0], [2.0, 4.0, 8.0]  # b twice a in every round
    assert bench_host._ratio(b, a) == 2.0
