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


@pytest.fixture
def fake_gemlite_kernel(monkeypatch):
    """A stand-in for gemlite as its source defines the interface: ``gemlite.helper.A16W4_NVFP`` builds a layer
    from our codes, scales and encode global, and ``gemm_splitK_MX_kernel.best_config`` names the split-K of its last
    call.  The layer returns ``state["output"](x, codes, scales, dec)``: gemlite's own split-K arithmetic
    (``peers.gemlite_split_k_ref``) unless a test sets another.  Returns that state."""
    import sys
    import types

    from vllm_nvfp4_sm120.peers import gemlite_split_k_ref

    state = {"split_k": 2, "block_k": 64}
    state["output"] = lambda x, codes, scales, dec: gemlite_split_k_ref(
        x, codes, scales, dec, split_k=state["split_k"], block_k=state["block_k"])

    class A16W4_NVFP:
        def __init__(self, device="cuda:0", dtype=None):
            pass

        def from_packed_weights(self, weight_packed, bias=None, scales=None, meta_scale=None):
            dec = float((1.0 / meta_scale).to(torch.float32))
            return lambda x: state["output"](x, weight_packed, scales, dec)

    class _Kernel:
        @property
        def best_config(self):
            return types.SimpleNamespace(kwargs={"SPLIT_K": state["split_k"], "BLOCK_SIZE_K": state["block_k"]})

    modules = {name: types.ModuleType(name) for name in
               ("gemlite", "gemlite.helper", "gemlite.triton_kernels", "gemlite.triton_kernels.gemm_splitK_kernels")}
    modules["gemlite.helper"].A16W4_NVFP = A16W4_NVFP
    modules["gemlite.triton_kernels.gemm_splitK_kernels"].gemm_splitK_MX_kernel = _Kernel()
    modules["gemlite"].helper = modules["gemlite.helper"]
    modules["gemlite"].triton_kernels = modules["gemlite.triton_kernels"]
    modules["gemlite.triton_kernels"].gemm_splitK_kernels = modules["gemlite.triton_kernels.gemm_splitK_kernels"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return state
