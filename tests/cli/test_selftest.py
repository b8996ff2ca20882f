"""``vllm-nvfp4-sm120 selftest``: no argument crashes it, argument errors come before any check runs, and the
report carries the machine and each failure's whole message."""

import json

import pytest
import torch
from cli_common import one_line_error, run_cli

from vllm_nvfp4_sm120 import selftest

NO_GPU = not torch.cuda.is_available()


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if any check runs."""
    def run(*args, **kwargs):
        raise AssertionError("a check ran although the arguments were refused")
    monkeypatch.setattr(selftest, "run", run)


def test_format_check_and_report(tmp_path, capsys):
    report = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, "selftest", "--only", "format", "--match", "swizzle", "--report", report, "--quiet")
    assert code == 0 and "1 passed, 0 failed" in out and f"report written to {report}" in out
    data = json.loads(report.read_text())
    env = data["environment"]
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["torch_cuda"] == torch.version.cuda
    assert {"triton", "vllm", "flashinfer"} <= env["versions"].keys()
    assert {"version", "nvcc", "source"} == env["cuda_toolkit"].keys()  # the CUDA toolkit FlashInfer would use
    assert isinstance(env["gluon"]["enabled"], bool) and env["gpu"]["available"] == (not NO_GPU)
    if not NO_GPU:
        assert "driver" in env["gpu"] and env["gpu"]["capability"].startswith("sm_")
    assert data["summary"] == {"pass": 1, "fail": 0, "skip": 0}
    [result] = data["results"]
    assert result["status"] == "PASS" and result["message"] is None and result["traceback"] is None


def test_a_failure_keeps_its_whole_message(tmp_path, capsys, monkeypatch):
    def broken():
        raise ValueError("first line\nsecond line with the detail")
    monkeypatch.setattr(selftest, "CHECKS", [("format", "a broken check", broken)])
    report = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, "selftest", "--report", report, "--quiet")
    assert code == 1 and "a broken check" in out and "ValueError: first line" in out
    assert "second line" not in out  # the table keeps one line per check
    [result] = json.loads(report.read_text())["results"]
    assert result["status"] == "FAIL" and result["detail"] == "ValueError: first line"
    assert result["message"] == "ValueError: first line\nsecond line with the detail"
    assert "in broken" in result["traceback"] and "ValueError" in result["traceback"]


def test_no_matching_check_is_an_error(capsys, no_run):
    line = one_line_error(*run_cli(capsys, "selftest", "--match", "zzz"))
    assert "--match 'zzz'" in line and f"none of the {len(selftest.CHECKS)} " in line and "--list" in line


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_report_path_is_checked_before_running(tmp_path, capsys, no_run, where):
    path = tmp_path / "missing" / "r.json" if where == "missing-folder" else tmp_path
    line = one_line_error(*run_cli(capsys, "selftest", "--only", "format", "--report", path))
    assert f"--report {path}" in line and "nothing was run" in line
    assert ("does not exist" if where == "missing-folder" else "is a folder") in line


def test_a_report_that_cannot_be_written_after_the_run_is_one_line(tmp_path, capsys, monkeypatch):
    def write_report(results, path):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(selftest, "write_report", write_report)
    code, out, err = run_cli(capsys, "selftest", "--only", "format", "--match", "swizzle", "--report",
                             tmp_path / "r.json", "--quiet")
    line = one_line_error(code, out, err)
    assert "cannot write it (Permission denied)" in line and "1 passed" in out  # the results were printed


@pytest.mark.skipif(not NO_GPU, reason="checks what a CPU-only machine reports")
def test_only_gpu_without_a_gpu_is_an_error(capsys, no_run):
    line = one_line_error(*run_cli(capsys, "selftest", "--only", "gpu", "--report", ""))
    assert "no CUDA GPU on this machine" in line


@pytest.mark.skipif(not NO_GPU, reason="checks what a CPU-only machine reports")
def test_gpu_checks_skip_with_the_reason_when_not_asked_for(capsys):
    code, out, _ = run_cli(capsys, "selftest", "--match", "vs torch reference", "--report", "", "--quiet")
    assert code == 0 and "0 passed, 0 failed" in out
    assert "could not run here" in out and "no CUDA GPU on this machine" in out


def test_unknown_kind_is_an_error(capsys, no_run):
    line = one_line_error(*run_cli(capsys, "selftest", "--only", "format,gpus", "--report", ""))
    assert "gpus" in line


def test_list_runs_nothing(capsys, no_run):
    code, out, _ = run_cli(capsys, "selftest", "--list", "--only", "compile")
    names = [line.split(None, 1)[1] for line in out.splitlines()]
    assert code == 0 and names == [name for kind, name, _ in selftest.CHECKS if kind == "compile"] and names


@pytest.mark.compile
def test_format_and_compile_checks_pass(tmp_path, capsys):
    """The README's CPU story: references and every sm_120 compile check pass (about 45 s on 2 cores)."""
    code, out, _ = run_cli(capsys, "selftest", "--only", "format,compile", "--report", tmp_path / "r.json", "--quiet")
    assert code == 0, out
    assert " 0 failed" in out and "FAIL" not in out
