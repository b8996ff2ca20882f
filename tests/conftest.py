"""Shared fixtures and markers.

``gpu``: needs a CUDA GPU (any); ``sm120``: needs compute capability 12.x.  Both skip cleanly without one.
Without CUDA, ``TRITON_INTERPRET=1`` is set so Triton kernels run in the interpreter on CPU tensors (fp16
dots only: bf16 ``tl.dot`` and NVFP4 ``dot_scaled`` are wrong in the interpreter).
Every test gets its own TRITON_CACHE_DIR so stale or concurrent cache entries cannot mask a result.
"""

import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter (it must be set before any kernel module is imported).
# The sm_120 compile harness drops it again in its compiler subprocess.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda_cc() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    cc = _cuda_cc()
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    no_sm120 = pytest.mark.skip(reason=f"needs an sm_120 GPU (this machine: {'no GPU' if cc is None else f'sm_{cc[0]}{cc[1]}'})")
    for item in items:
        if item.get_closest_marker("sm120") and (cc is None or cc[0] != 12):
            item.add_marker(no_sm120)
        elif item.get_closest_marker("gpu") and cc is None:
            item.add_marker(no_gpu)


@pytest.fixture(autouse=True)
def _triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))


@pytest.fixture
def gen():
    """A seeded CPU generator: fresh random data per test, reproducible per run."""
    return torch.Generator().manual_seed(1234)
