"""The README's two commands are the ones CI runs, and the environment CI built is the pinned one."""

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in readme
    install, run = TEST_COMMAND.rsplit(" && ", 1)
    assert install in ci and run in ci


def test_readme_main_command_runs_selftest():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"pip install [^\n]*&& [^\n]*vllm-nvfp4-sm120 selftest", readme)


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="checks the CI environment only")
def test_ci_has_the_pinned_stack():
    versions = {p: importlib.metadata.version(p) for p in ("vllm", "torch", "triton", "flashinfer-python")}
    assert versions["vllm"] == "0.33.0", versions
    assert versions["triton"].startswith("3.8."), versions
    import vllm  # noqa: F401  (a broken install must fail CI, not skip the vLLM cross-checks)
