"""What a vendor route needs from this machine; where vLLM picks our kernels by itself, and which of our routes
``nvfp4_sm120`` stands for.

Modelled on FlashInfer's ``@backend_requirement``: one requirement function per backend, next to the others, all
with the same form ``<route>_refusal(cap, n, k, ...) -> str | None`` (None: the route can serve an ``[N, K]``
weight on ``cap``'s GPU; else why not, in words a user can act on).  :data:`REFUSALS` maps each vendor route to its
function; :func:`refusal` asks it for any route (ours need nothing) and :func:`require` raises
:class:`~vllm_nvfp4_sm120.kernels.fp4_routes.Fp4RouteUnavailable` with the reason.  The glue asks at load time (a
layer that cannot be served falls back to vLLM's selection with one log line), the registry's launchers before
each run.

FlashInfer is optional and imported lazily; its CUDA toolkit probe runs once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..kernels import fp4_routes
from ..kernels.fp4_routes import W4A16_BACKENDS, Fp4RouteUnavailable
from .hw import Capability, Family, capability_of
from .linear import Route

B12X_MIN_CUDA = "12.9"  # flashinfer.gemm.gemm_base._MIN_B12X_CUDA_VERSION for NVFP4 (used if that name moves)
# FlashInfer 0.7.2's @supported_compute_capability lists, checked before importing it (it may not be installed);
# its own is_backend_supported is asked again after the import.
B12X_CCS = (120, 121)
W4A16_CCS = {"cute-dsl": (100, 103, 107, 110, 120, 121), "cudnn": (100, 103, 107, 110, 120, 121),
             "cute-dsl-native": (120, 121)}

# Where vLLM's automatic selection takes our kernels (W4A4 linears, MoE experts of W4A4 checkpoints); on other GPUs,
# and for W4A16 checkpoints, by name only.
AUTO_FAMILIES = (Family.SM120,)
# The routes ``--linear-backend nvfp4_sm120`` stands for, tried in order, per family (W4A4 layers); W4A16 layers
# have one route.  Route triton everywhere: the vendor routes are opt-in by name until they are measured on sm_120.
AUTO_W4A4_ROUTES: dict[Family, tuple[Route, ...]] = {Family.SM120: (Route.TRITON,)}
AUTO_W4A4_DEFAULT: tuple[Route, ...] = (Route.TRITON,)
AUTO_W4A16_ROUTES: tuple[Route, ...] = (Route.W4A16,)


def chosen_automatically(cap: Capability | None) -> bool:
    """Whether vLLM's own selection may pick our kernels on ``cap``'s GPU (None: not a CUDA GPU)."""
    return cap is not None and cap.family in AUTO_FAMILIES


def auto_routes(cap: Capability | None, w4a4: bool) -> tuple[Route, ...]:
    """Our routes for ``--linear-backend nvfp4_sm120`` on ``cap``'s GPU, in the order they are tried."""
    if not w4a4:
        return AUTO_W4A16_ROUTES
    return AUTO_W4A4_ROUTES.get(cap.family, AUTO_W4A4_DEFAULT) if cap is not None else AUTO_W4A4_DEFAULT


def _no_gpu(cap: Capability) -> str | None:
    return "needs a CUDA device" if cap.cc is None else None


# ---------------------------------------------------------------------------------------------------------------
# cuBLAS: torch._scaled_mm on float4_e2m1fn_x2


def cublas_refusal(cap: Capability, n: int, k: int, *, cuda_version: str | None = None) -> str | None:
    """Why the cuBLAS NVFP4 route cannot serve an ``[N, K]`` weight on ``cap`` (None: it can).

    cuBLASLt block-scaled FP4 (CUDA >= 12.8) exists on sm_100/sm_103 and sm_120/sm_121 only.  torch._scaled_mm
    asserts K/2 % 16 == 0 on the FP4 operands and N % 16 == 0 on the weight; we refuse those instead of padding
    (every checkpoint shape we ship satisfies them).
    """
    if reason := _no_gpu(cap):
        return reason
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype"
    if cap.major not in (10, 12):
        return f"cuBLAS NVFP4 GEMMs need sm_100 or sm_120, this GPU is {cap.name}"
    version = torch.version.cuda if cuda_version is None else cuda_version
    if version is None or tuple(int(p) for p in version.split(".")[:2]) < (12, 8):
        return f"cuBLAS NVFP4 needs a CUDA >= 12.8 build of torch, got CUDA {version}"
    if k % 32:
        return f"K = {k} is not a multiple of 32 (torch._scaled_mm: the packed FP4 K/2 must be a multiple of 16)"
    if n % 16:
        return f"N = {n} is not a multiple of 16 (torch._scaled_mm)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer


def _flashinfer_reason() -> str | None:
    try:
        fp4_routes.flashinfer()
    except Fp4RouteUnavailable as err:
        return str(err)
    return None


@functools.cache
def flashinfer_cuda_version() -> str:
    """FlashInfer's own CUDA toolkit probe (nvcc, else torch.version.cuda), once per process: it runs nvcc."""
    from flashinfer.jit.cpp_ext import get_cuda_version

    return str(get_cuda_version())


def _b12x_min_cuda():
    from packaging.version import Version

    try:
        from flashinfer.gemm.gemm_base import _MIN_B12X_CUDA_VERSION

        return Version(str(_MIN_B12X_CUDA_VERSION))
    except ImportError:
        return Version(B12X_MIN_CUDA)


def b12x_refusal(cap: Capability, n: int, k: int, *, cuda_version: str | None = None) -> str | None:
    """Why FlashInfer ``mm_fp4(backend="b12x")`` cannot serve an ``[N, K]`` weight (None: it can).

    N % 8 != 0 is refused: FlashInfer returns wrong output there even with N padded.  K only needs % 16 (the
    NVFP4 block); we pad K and N to 32 like vLLM.  ``cuda_version`` overrides FlashInfer's toolkit probe (tests).
    """
    from packaging.version import Version

    if reason := _no_gpu(cap):
        return reason
    if k % 16:
        return f"K = {k} is not a multiple of 16 (one NVFP4 scale per 16 elements)"
    if n % 8:
        return f"N = {n} is not a multiple of 8: FlashInfer's b12x GEMM returns wrong output there"
    if cap.cc not in B12X_CCS:
        return f"FlashInfer b12x runs on sm_120/sm_121 only, this GPU is {cap.name}"
    if reason := _flashinfer_reason():
        return reason
    fi = fp4_routes.flashinfer()
    if not fi.mm_fp4.is_backend_supported("b12x", cap.cc):
        return f"flashinfer {getattr(fi, '__version__', '?')} does not support b12x on {cap.name}"
    version = cuda_version if cuda_version is not None else flashinfer_cuda_version()
    need = _b12x_min_cuda()
    if Version(version) < need:
        return f"FlashInfer b12x NVFP4 needs CUDA >= {need} (FlashInfer's probe found CUDA {version})"
    try:
        from flashinfer.cute_dsl.availability import is_cute_dsl_available
    except ImportError:
        return "FlashInfer b12x needs CuTe DSL (nvidia-cutlass-dsl), which is not importable"
    if not is_cute_dsl_available():
        return "FlashInfer b12x needs CuTe DSL (nvidia-cutlass-dsl), which is not available"
    return None


def flashinfer_w4a16_refusal(
    cap: Capability,
    n: int,
    k: int,
    *,
    backend: str = "cute-dsl",
    act_dtype: torch.dtype = torch.bfloat16,
) -> str | None:
    """Why ``mm_bf16_fp4(backend=...)`` cannot serve an ``[N, K]`` weight with ``act_dtype`` activations."""
    if reason := _no_gpu(cap):
        return reason
    if backend not in W4A16_BACKENDS:
        return f"backend {backend!r} is not one of {W4A16_BACKENDS}"
    if act_dtype != torch.bfloat16:
        return f"FlashInfer mm_bf16_fp4 takes bfloat16 activations only, got {act_dtype}"
    if k % 16:
        return f"K = {k} is not a multiple of 16"
    if backend == "cute-dsl" and cap.major == 12 and n % 64:
        return f"N = {n} is not a multiple of 64 (cute-dsl weight packing on sm_12x)"
    if backend == "cute-dsl-native" and n * k >= 2**31:
        return f"N x K = {n * k} >= 2^31 (cute-dsl-native)"
    if cap.cc not in W4A16_CCS[backend]:
        return f"FlashInfer mm_bf16_fp4 backend {backend!r} does not support {cap.name}"
    if reason := _flashinfer_reason():
        return reason
    fi = fp4_routes.flashinfer()
    if not hasattr(fi, "mm_bf16_fp4"):
        return f"flashinfer {getattr(fi, '__version__', '?')} has no mm_bf16_fp4"
    if not fi.mm_bf16_fp4.is_backend_supported(backend, cap.cc):
        return f"FlashInfer mm_bf16_fp4 backend {backend!r} does not support {cap.name}"
    if backend == "cudnn":
        from flashinfer.gemm.gemm_base import CUDNN_AVAILABLE

        if not CUDNN_AVAILABLE:
            return "FlashInfer mm_bf16_fp4 backend 'cudnn' needs the cuDNN frontend, which is not importable"
    return None


# ---------------------------------------------------------------------------------------------------------------
# By route

REFUSALS: dict[Route, Callable[..., str | None]] = {
    Route.CUBLAS: cublas_refusal,
    Route.B12X: b12x_refusal,
    Route.FLASHINFER_W4A16: flashinfer_w4a16_refusal,
}


def refusal(route: Route | str, cap: Capability, n: int, k: int, **kw) -> str | None:
    """Why ``route`` cannot serve an ``[N, K]`` weight on ``cap`` (None: it can, or it needs no vendor library)."""
    check = REFUSALS.get(route)
    return None if check is None else check(cap, n, k, **kw)


def require(route: Route | str, t: torch.Tensor, n: int, k: int, **kw) -> None:
    """Raise :class:`Fp4RouteUnavailable` unless ``route`` can serve ``[N, K]`` on the GPU that holds ``t``."""
    if reason := refusal(route, capability_of(t.device), n, k, **kw):
        raise Fp4RouteUnavailable(f"{route}: {reason}")
