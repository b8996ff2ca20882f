"""Vendor route requirements (``dispatch/vendor.py``): the load-time refusals of the cuBLAS, b12x and FlashInfer
W4A16 routes on the CPU, and their clean refusal at run time where the routes cannot run (this CPU, the H200)."""

import importlib.util

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import vendor as V
from vllm_nvfp4_sm120.dispatch.hw import NO_GPU, Capability
from vllm_nvfp4_sm120.dispatch.linear import LinearKernel
from vllm_nvfp4_sm120.dispatch.registry import LINEAR_KERNELS, run_flashinfer_w4a16
from vllm_nvfp4_sm120.format import make_linear
from vllm_nvfp4_sm120.kernels import fp4_routes as R

SM120, SM121, SM100, SM90, SM89 = Capability(120), Capability(121), Capability(100), Capability(90), Capability(89)
# The H200 image has no FlashInfer: tests of its probes run where it is installed (the dev machine, sm_120 boxes).
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")
REAL = [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600), (57344, 8192), (8192, 28672)]


# ---------------------------------------------------------------------------------------------------------------
# Load-time refusal


@pytest.mark.parametrize("n,k", REAL)
def test_cublas_accepts_real_shapes(n, k):
    for cap in (SM120, SM121, SM100):
        assert V.cublas_refusal(cap, n, k, cuda_version="12.8") is None


@pytest.mark.parametrize(
    "cap,n,k,cuda,match",
    [
        (SM90, 4096, 4096, "13.0", r"need sm_100 or sm_120, this GPU is sm_90"),
        (SM89, 4096, 4096, "13.0", r"sm_89"),
        (SM120, 4096, 4096, "12.6", r"CUDA >= 12.8"),
        (SM120, 4096, 4112, "13.0", r"K = 4112 is not a multiple of 32"),
        (SM120, 4104, 4096, "13.0", r"N = 4104 is not a multiple of 16"),
    ],
)
def test_cublas_refusals(cap, n, k, cuda, match):
    import re

    reason = V.cublas_refusal(cap, n, k, cuda_version=cuda)
    assert reason is not None and re.search(match, reason), reason


@needs_flashinfer
@pytest.mark.parametrize("n,k", REAL + [(4104, 4112), (24, 48)])
def test_b12x_accepts(n, k):
    assert V.b12x_refusal(SM120, n, k, cuda_version="12.9") is None
    assert V.b12x_refusal(SM121, n, k, cuda_version="13.0") is None


@pytest.mark.parametrize(
    "cap,n,k,cuda,match",
    [
        (SM100, 4096, 4096, "13.0", r"sm_120/sm_121 only, this GPU is sm_100"),
        (SM90, 4096, 4096, "13.0", r"sm_90"),
        (SM120, 4100, 4096, "13.0", r"N = 4100 is not a multiple of 8"),
        (SM120, 4096, 4104, "13.0", r"K = 4104 is not a multiple of 16"),
        pytest.param(SM120, 4096, 4096, "12.8", r"CUDA >= 12.9 .*found CUDA 12.8", marks=needs_flashinfer),
    ],
)
def test_b12x_refusals(cap, n, k, cuda, match):
    import re

    reason = V.b12x_refusal(cap, n, k, cuda_version=cuda)
    assert reason is not None and re.search(match, reason), reason


def test_refusal_without_a_gpu():
    for refuse in (V.cublas_refusal, V.b12x_refusal, V.flashinfer_w4a16_refusal):
        assert refuse(NO_GPU, 4096, 4096) == "needs a CUDA device"
    assert V.refusal("cublas", NO_GPU, 4096, 4096) == "needs a CUDA device"
    assert V.refusal("triton", NO_GPU, 4096, 4096) is None  # our routes need no vendor library


def test_auto_routes():
    assert V.auto_routes(SM120, w4a4=True) == ("triton",) and V.auto_routes(None, w4a4=True) == ("triton",)
    assert V.auto_routes(SM90, w4a4=False) == ("w4a16",)


@needs_flashinfer
def test_b12x_uses_flashinfer_cuda_probe():
    # Without an override the check uses FlashInfer's own probe (nvcc, else torch's CUDA): a version string.
    version = V.flashinfer_cuda_version()
    assert version[0].isdigit()
    from packaging.version import Version

    reason = V.b12x_refusal(SM120, 4096, 4096)
    assert (reason is None) == (Version(version) >= Version("12.9")), reason


def test_flashinfer_missing_is_a_refusal(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flashinfer(name, *args, **kw):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ImportError("No module named 'flashinfer'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    for reason in (V.b12x_refusal(SM120, 4096, 4096, cuda_version="13.0"),
                   V.flashinfer_w4a16_refusal(SM120, 4096, 4096)):
        assert reason is not None and "flashinfer is not importable" in reason


@needs_flashinfer
@pytest.mark.parametrize("backend", R.W4A16_BACKENDS)
@pytest.mark.parametrize("n,k", REAL)
def test_w4a16_accepts_real_shapes(backend, n, k):
    reason = V.flashinfer_w4a16_refusal(SM120, n, k, backend=backend)
    if backend == "cudnn":
        from flashinfer.gemm.gemm_base import CUDNN_AVAILABLE

        assert (reason is None) == CUDNN_AVAILABLE, reason
    else:
        assert reason is None, reason


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cap=SM90), r"does not support sm_90"),
        (dict(backend="cute-dsl-native", cap=SM100), r"does not support sm_100"),
        (dict(n=4128), r"N = 4128 is not a multiple of 64"),
        (dict(act_dtype=torch.float16), r"bfloat16 activations only"),
        (dict(backend="marlin"), r"not one of"),
        (dict(k=4104), r"K = 4104"),
    ],
)
def test_w4a16_refusals(kw, match):
    import re

    args = dict(cap=SM120, n=4096, k=4096, backend="cute-dsl", act_dtype=torch.bfloat16) | kw
    reason = V.flashinfer_w4a16_refusal(args["cap"], args["n"], args["k"], backend=args["backend"],
                                        act_dtype=args["act_dtype"])
    assert reason is not None and re.search(match, reason), reason


# ---------------------------------------------------------------------------------------------------------------
# Run time


def _w4a4_args(t, n, k, gen, device="cpu"):
    p = make_linear(n, k, gen=gen)
    x = (torch.randn(t, k, generator=gen) * 2).to(torch.bfloat16)
    alpha = (p.input_gs.dec * p.weight_gs.dec).reshape(1).to(torch.float32)
    return (x.to(device), p, p.codes.to(device), p.scales.to(device), p.input_gs.enc.reshape(1).to(device),
            alpha.to(device))


def _refuses_here():
    """Where the vendor routes cannot run: this CPU machine, or a GPU that is not sm_120 (the H200)."""
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 12


@pytest.mark.skipif(not _refuses_here(), reason="this GPU runs the vendor routes")
@pytest.mark.parametrize("route", ["cublas", "b12x", "flashinfer_w4a16"])
def test_routes_refuse_cleanly_off_sm120(route, gen):
    """Through the launchers the dispatch runs: the launcher refuses CPU tensors, the requirement other GPUs."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, p, codes, scales, enc, alpha = _w4a4_args(4, 64, 128, gen, dev)
    dec_rows = p.dec_rows.to(dev)
    expected = r"needs CUDA tensors" if dev == "cpu" else r"sm_\d+"
    with pytest.raises(R.Fp4RouteUnavailable, match=expected):
        if route == "cublas":
            w, sw = R.prepare_cublas_weight(codes, scales)
            LINEAR_KERNELS[LinearKernel.W4A4_CUBLAS](x, w, scales, dec_rows, sw, enc, alpha, None)
        elif route == "b12x":
            w, sw = R.prepare_b12x_weight(codes, scales)
            LINEAR_KERNELS[LinearKernel.W4A4_B12X](x, w, scales, dec_rows, sw, enc, alpha, None)
        else:
            run_flashinfer_w4a16(x, codes, scales, alpha, None, 64, "cute-dsl")


@pytest.mark.gpu
def test_refusal_reason_on_this_gpu():
    cap = torch.cuda.get_device_capability()
    if cap[0] == 12:
        pytest.skip("sm_120: the routes are usable here")
    cap = Capability(cap[0] * 10 + cap[1])
    assert V.cublas_refusal(cap, 4096, 4096) is not None or cap.major == 10
    assert V.b12x_refusal(cap, 4096, 4096) is not None
    assert V.flashinfer_w4a16_refusal(cap, 4096, 4096) is not None
