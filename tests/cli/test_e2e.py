"""``bench --e2e`` on CPU: both arms in their own processes with vLLM's engine replaced by a stub at the boundary
(``e2e_stub.StubEngine``), the comparison, the table, the JSON, ``--plot`` without matplotlib, and the refusal where
vLLM cannot serve."""

import json
import os
from pathlib import Path

import pytest
import torch
from cli_common import one_line_error
from cli_common import run_cli as run

from vllm_nvfp4_sm120 import bench, e2e

STUB = "e2e_stub:StubEngine"
HERE = Path(__file__).resolve().parent


@pytest.fixture
def stub_path(monkeypatch):
    """The arm processes import the stub from this folder."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def test_first_difference():
    assert e2e.first_difference("abc", "abc") is None
    assert e2e.first_difference("abcd", "abXd") == 2
    assert e2e.first_difference("abc", "abcdef") == 3


def test_both_arms_run_in_their_own_processes(stub_path):
    result = e2e.run_e2e("/nonexistent/ckpt", engine=STUB, prompt_tokens=(1024, 4096), concurrency=(1, 4),
                         decode_tokens=16, repeats=2)
    ours, theirs = result["arms"]["ours"], result["arms"]["vllm"]
    assert "error" not in ours and "error" not in theirs, result["arms"]
    assert (ours["plugin_switch"], ours["backend"]) == ("1", "nvfp4_sm120")
    assert (theirs["plugin_switch"], theirs["backend"]) == ("0", "auto")
    assert len({ours["pid"], theirs["pid"], os.getpid()}) == 3
    assert result["options"]["max_model_len"] == 4096 + 64 + 64
    # The stub: prefill 1 vs 2 us per token (+ no decode at max_tokens = 1), decode 10 vs 15 ms per step.
    assert ours["ttft_ms"] == pytest.approx({1024: 1.024, 4096: 4.096})
    assert theirs["ttft_ms"] == pytest.approx({1024: 2.048, 4096: 8.192})
    assert ours["decode_tok_s"] == pytest.approx({1: 100.0, 4: 400.0})
    cmp_ = result["compare"]
    assert cmp_["ttft_speedup"] == pytest.approx({1024: 2.0, 4096: 2.0})
    assert cmp_["decode_speedup"] == pytest.approx({1: 1.5, 4: 1.5})
    assert [o["first_difference"] for o in cmp_["outputs"]] == [None, 7, None, None]
    table = e2e.format_e2e(result)
    assert "TTFT, 4096 prompt tokens" in table and "2.00x" in table and "decode, 4 requests" in table
    assert "3 of 4 identical" in table and "first difference at character 7" in table


def test_a_failing_arm_is_reported(stub_path):
    result = e2e.run_e2e("/x", engine="e2e_stub:NoSuchEngine", prompt_tokens=(8,), concurrency=(1,),
                         decode_tokens=4, repeats=1)
    assert "compare" not in result
    assert "AttributeError" in result["arms"]["ours"]["error"]
    assert "arm ours failed" in e2e.format_e2e(result)


def test_cli_table_json_and_plot_skipped_without_matplotlib(tiny, capsys, stub_path, monkeypatch, tmp_path):
    monkeypatch.setattr(e2e, "serving_problem", lambda: None)  # the stub serves anywhere
    monkeypatch.setattr(bench, "require_matplotlib", lambda: None)
    out_json = tmp_path / "e2e.json"
    code, out, err = run(capsys, "bench", "--e2e", "--checkpoint", tiny[("modelopt", "w4a4")], "--e2e-engine", STUB,
                         "--prompt-tokens", "64", "--concurrency", "2", "--decode-tokens", "8", "--e2e-repeats", "1",
                         "--json", out_json, "--plot", tmp_path / "e2e.png")
    assert code == 0, err
    assert "e2e.png skipped: matplotlib is not installed" in err and not (tmp_path / "e2e.png").exists()
    assert "TTFT, 64 prompt tokens" in out and "decode, 2 requests" in out
    data = json.loads(out_json.read_text())
    assert set(data["arms"]) == {"ours", "vllm"} and data["compare"]["outputs"][1]["first_difference"] == 7


def test_cli_plot_with_matplotlib(tiny, capsys, stub_path, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(e2e, "serving_problem", lambda: None)
    png = tmp_path / "e2e.png"
    code, out, err = run(capsys, "bench", "--e2e", "--checkpoint", tiny[("modelopt", "w4a4")], "--e2e-engine", STUB,
                         "--prompt-tokens", "64", "--concurrency", "1", "--decode-tokens", "4", "--e2e-repeats", "1",
                         "--plot", png)
    assert code == 0 and png.stat().st_size > 0 and f"plot written to {png}" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is visible")
def test_e2e_refuses_without_a_gpu(tiny, capsys):
    line = one_line_error(*run(capsys, "bench", "--e2e", "--checkpoint", tiny[("modelopt", "w4a4")]))
    assert line == "error: bench --e2e needs a GPU vLLM can serve on: no CUDA GPU is visible"


@pytest.mark.parametrize("argv,message", [
    ([], "bench --e2e needs --checkpoint DIR"),
    (["--checkpoint", "CKPT", "--concurrency", "0"], "--concurrency: expected a comma list of positive integers"),
    (["--checkpoint", "CKPT", "--decode-tokens", "1"], "--decode-tokens: at least 2"),
    (["--checkpoint", "/nonexistent"], "/nonexistent: not a directory"),
])
def test_e2e_bad_arguments(tiny, capsys, argv, message):
    argv = [str(tiny[("modelopt", "w4a4")]) if a == "CKPT" else a for a in argv]
    line = one_line_error(*run(capsys, "bench", "--e2e", *argv))
    assert message in line


def test_bench_without_e2e_still_compares(capsys, monkeypatch):
    called = []
    monkeypatch.setattr(bench, "run_compare", lambda args: called.append(args) or {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "format_bench_table", lambda result: "TABLE")
    code, out, _ = run(capsys, "bench", "--models", "qwen3-32b")
    assert code == 0 and called and out.strip() == "TABLE"
