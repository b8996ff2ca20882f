"""The overlap probe's trace reading (benchmarks/moe_decode_overlap.py), on CPU: which kernels it pairs and the
overlap it reports, so a device run cannot fail on them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_BENCH))  # the probe imports moe_decode_sweep as a sibling module
_spec = importlib.util.spec_from_file_location("moe_decode_overlap", _BENCH / "moe_decode_overlap.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

GATE, DOWN, ZERO = "_moe_decode_gate_up_kernel", "_moe_decode_down_expert_kernel", "void at::native::fill_kernel"


def _trace(*events):
    """A chrome trace as ``torch.profiler`` exports it: kernels with ``ts`` / ``dur`` in µs, other events beside."""
    evs = [{"cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in events]
    evs.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 3.0})
    evs.append({"cat": "kernel", "name": GATE, "ts": 99.0})  # an incomplete record (no duration) is skipped
    return {"traceEvents": evs}


def test_overlap_of_a_dependent_launch_and_the_gap_of_a_plain_one():
    # Out of order in the file, as the profiler may write them; a fill kernel between two layers.
    spans = probe.kernel_spans(_trace((DOWN, 20.0, 8.0), (GATE, 10.0, 12.0), (ZERO, 35.0, 1.0), (GATE, 40.0, 10.0),
                                      (DOWN, 51.5, 5.0)))
    assert [s[0] for s in spans] == [GATE, DOWN, ZERO, GATE, DOWN]
    got = probe.layer_overlaps(spans, "moe_decode_gate_up", "moe_decode_down")
    assert got == [
        {"gate_up_us": 12.0, "down_us": 8.0, "overlap_us": 2.0, "span_us": 18.0},  # down started 2 µs before the end
        {"gate_up_us": 10.0, "down_us": 5.0, "overlap_us": -1.5, "span_us": 16.5},  # a 1.5 µs gap
    ]


def test_a_gate_up_kernel_without_its_down_is_not_paired():
    # A lost down record: the first gate_up is skipped, not paired with the next layer's down.
    spans = probe.kernel_spans(_trace((GATE, 0.0, 5.0), (GATE, 10.0, 5.0), (DOWN, 16.0, 2.0)))
    got = probe.layer_overlaps(spans, "moe_decode_gate_up", "moe_decode_down")
    assert got == [{"gate_up_us": 5.0, "down_us": 2.0, "overlap_us": -1.0, "span_us": 8.0}]


def test_the_probe_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main(["--pairs", "qwen3-30b-a3b:1:gu-n16k256-kw4-st3-shift+exp-n64k256-w2-st2-shift"])
