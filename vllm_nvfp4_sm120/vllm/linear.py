"""vLLM NVFP4 linear kernel classes, one per route of ``dispatch.linear``, and their selection.

Every class but one calls the same torch custom op, ``torch.ops.nvfp4_sm120.linear`` (``dispatch/ops.py``), with its
route; the op picks the kernel per call from T (W4A16 kernel on the same weight at decode sizes, the route's W4A4
GEMM for prefill).  The classes only prepare the layer once at load time: a ``[N]`` weight decode global per row
(:mod:`.scale_policy`), a 128x4-swizzled copy of the block scales for the cuBLAS and b12x routes, and the b12x
padding.  The codes are never copied.

The exception is the comparison route ``flashinfer_w4a16`` (:class:`FlashInferW4A16NvFp4LinearKernel`): FlashInfer
``mm_bf16_fp4`` at every T on the weight as FlashInfer prepares it (``cute-dsl`` repacks the codes), through its
own op ``torch.ops.nvfp4_sm120.flashinfer_w4a16``.  It replaces the layer's tensors by FlashInfer's, so there is
still one copy of the weight, and it is opt-in by name only.

Selection (installed by :mod:`.register`):

* vLLM's CUDA NVFP4 list gets our classes in front (``insert(0, ...)``), so ``--linear-backend auto`` picks
  :class:`TritonNvFp4LinearKernel` on sm_12x for W4A4 layers; on other GPUs our classes refuse unless named.
* Our backend names (:data:`BACKEND_NAMES`) are resolved by :func:`select_nvfp4_linear_kernel`, which replaces
  ``init_nvfp4_linear_kernel`` where vLLM's NVFP4 schemes imported it.  It also makes our W4A16 kernel reachable
  for W4A16 checkpoints (vLLM forces Marlin there), by name only.  A name that cannot take a layer logs why and
  falls back to vLLM's automatic selection.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.utils import replace_parameter

from ..dispatch import linear as dispatch_linear
from ..format import check_tensor
from . import scale_policy
from .log import log_once


AUTO_BACKEND = "nvfp4_sm120"
# Routes tried, in order, when the user names AUTO_BACKEND (W4A4 layers), per compute-capability major.
AUTO_W4A4_ROUTES: dict[int | None, tuple[str, ...]] = {12: ("triton",), None: ("triton",)}
AUTO_W4A16_ROUTES: tuple[str, ...] = ("w4a16",)

_W_DEC_ROWS = "_nvfp4_sm120_w_dec_rows"
_W_SCALES_SWIZZLED = "_nvfp4_sm120_w_scales_swizzled"
# Route flashinfer_w4a16: its weight global (FlashInfer's alpha, [1] fp32) and N (the repacked weight hides it).
_FI_ALPHA = "_nvfp4_sm120_fi_alpha"
_FI_N = "_nvfp4_sm120_fi_n"
FI_W4A16_BACKEND_ENV = "VLLM_NVFP4_SM120_FI_W4A16_BACKEND"
FI_W4A16_DEFAULT_BACKEND = "cute-dsl"


def _ops():
    from ..dispatch import ops  # registers torch.ops.nvfp4_sm120.linear

    return ops


def current_capability() -> int | None:
    """vLLM's view of the GPU (``DeviceCapability.to_int()``, e.g. 120); imported late so test fakes are seen."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else cap.to_int()


def requested_backends() -> set[str]:
    """Every linear backend name the current vLLM config asks for (global and per quantization)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return set()
    kc = config.kernel_config
    return {kc.linear_backend, *(kc.linear_backend_per_quant or {}).values()}


def _capability_of(layer: torch.nn.Module) -> tuple[int, int] | torch.device:
    """What the fp4_routes refusal functions take: vLLM's view of the GPU, else the weight's (non-CUDA) device."""
    cc = current_capability()
    return (cc // 10, cc % 10) if cc is not None else layer.weight.device


def _route_refusal(route: str, cc: int) -> str | None:
    """Why ``route`` cannot run on compute capability ``cc`` at all (no table rows, a plan without a kernel)."""
    family = dispatch_linear.TABLE.get(cc // 10, {})
    if route not in family:
        return f"route {route!r} has no kernels for sm_{cc}"
    missing = sorted({row.plan.kernel for row in family[route]} - set(_ops().LINEAR_KERNELS))
    if missing:
        return f"route {route!r} plans kernels not provided by dispatch.ops yet: {missing}"
    return None


def _fp4_routes_refusal(needed: tuple[str, ...]) -> str | None:
    """The cuBLAS and b12x routes live in ``kernels/fp4_routes.py``; refuse cleanly while it lacks them."""
    try:
        mod = importlib.import_module("vllm_nvfp4_sm120.kernels.fp4_routes")
    except ImportError as e:
        return f"vllm_nvfp4_sm120.kernels.fp4_routes is not importable ({e})"
    absent = [n for n in needed if not hasattr(mod, n)]
    return f"vllm_nvfp4_sm120.kernels.fp4_routes lacks {absent}" if absent else None


def layer_is_w4a4(layer: torch.nn.Module) -> bool:
    """W4A4 layers carry vLLM's activation globals; W4A16 checkpoints (and weight-only fallbacks) do not."""
    return getattr(layer, "input_global_scale_inv", None) is not None and getattr(layer, "alpha", None) is not None


class Sm120NvFp4LinearKernel(NvFp4LinearKernel):
    """Base of our NVFP4 linear kernels; subclasses fix :attr:`route`."""

    route: ClassVar[str]
    backend_name: ClassVar[str]
    w4a4: ClassVar[bool]  # the route's prefill GEMM quantizes activations: needs a W4A4 checkpoint
    fp4_routes_needs: ClassVar[tuple[str, ...]] = ()  # names it needs from kernels/fp4_routes.py

    def __init__(self, config: NvFp4LinearLayerConfig) -> None:
        super().__init__(config)
        self._fallback: NvFp4LinearKernel | None = None

    # ---- selection ---------------------------------------------------------------------------------------------
    @classmethod
    def is_named(cls) -> bool:
        names = requested_backends()
        return cls.backend_name in names or AUTO_BACKEND in names

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        cc = compute_capability if compute_capability is not None else current_capability()
        if cc is None:
            return False, "needs a CUDA GPU"
        if (why := _route_refusal(cls.route, cc)) is not None:
            return False, why
        if cc // 10 == 12 or cls.is_named():
            return True, None
        return False, f"runs on sm_{cc} only when named (--linear-backend {cls.backend_name} or {AUTO_BACKEND})"

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        why = _fp4_routes_refusal(cls.fp4_routes_needs) if cls.fp4_routes_needs else None
        return why is None, why

    def layer_refusal(self, layer: torch.nn.Module, n: int, k: int, w4a4: bool) -> str | None:
        """Why this route cannot take this particular layer (shape, scales), found at load time."""
        if self.w4a4 and not w4a4:
            return "the route's prefill GEMM needs activation scales, and this is a W4A16 layer"
        return None

    # ---- load ----------------------------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w4a4 = layer_is_w4a4(layer)
        kind = f"{type(layer).__name__} {'W4A4' if w4a4 else 'W4A16'}"
        n, k = self._check_layer(layer)
        if (why := self.layer_refusal(layer, n, k, w4a4)) is not None:
            self._fallback = _fallback_kernel(use_a16=not w4a4, exclude=(type(self),))
            log_once(
                "warning", (kind, self.route, "fallback", why),
                "nvfp4_sm120: route %s cannot take NVFP4 %s layers (first: %s): %s; using %s instead",
                self.route, kind, scale_policy.layer_name(layer), why, type(self._fallback).__name__,
            )
            if hasattr(layer, scale_policy._PARTS_ATTR):
                delattr(layer, scale_policy._PARTS_ATTR)
            self._fallback.process_weights_after_loading(layer)
            return
        self._prepare_layer(layer, w4a4)
        log_once("info", (kind, self.route, type(self).__name__),
                  "nvfp4_sm120: NVFP4 %s layers use %s (route %s)", kind, type(self).__name__, self.route)

    @staticmethod
    def _check_layer(layer: torch.nn.Module) -> tuple[int, int]:
        name = scale_policy.layer_name(layer)
        w = check_tensor(f"{name}.weight", layer.weight, dtype=torch.uint8, ndim=2)
        n, k = w.shape[0], w.shape[1] * 2
        check_tensor(f"{name}.weight_scale", layer.weight_scale, dtype=torch.float8_e4m3fn, shape=(n, k // 16))
        return n, k

    def _prepare_layer(self, layer: torch.nn.Module, w4a4: bool) -> None:
        """What the op needs next to the checkpoint's tensors: the per-row decode globals, the route's layout."""
        layer.register_buffer(_W_DEC_ROWS, scale_policy.weight_dec_rows(layer, w4a4=w4a4), persistent=False)
        layer.register_buffer(_W_SCALES_SWIZZLED, self._prepare_weight(layer), persistent=False)

    def _prepare_weight(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """Route-specific load-time layout; returns the swizzled scale copy (None if the route needs none)."""
        return None

    # ---- forward -------------------------------------------------------------------------------------------------
    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._fallback is not None:
            return self._fallback.apply_weights(layer, x, bias)
        out = self._forward(layer, x.reshape(-1, x.shape[-1]), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _forward(self, layer: torch.nn.Module, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.nvfp4_sm120.linear(
            x2,
            layer.weight,
            layer.weight_scale,
            getattr(layer, _W_DEC_ROWS),
            getattr(layer, _W_SCALES_SWIZZLED),
            getattr(layer, "input_global_scale_inv", None),
            getattr(layer, "alpha", None),
            bias,
            self.route,
        )


class TritonNvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """Our Triton W4A4 GEMM for prefill (native FP4 MMA on sm_120), W4A16 kernel at decode sizes."""

    route, backend_name, w4a4 = "triton", "nvfp4_sm120_triton", True


class CublasNvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """cuBLAS block-scaled FP4 GEMM (``torch._scaled_mm``) for prefill; needs swizzled weight scales."""

    route, backend_name, w4a4 = "cublas", "nvfp4_sm120_cublas", True
    fp4_routes_needs = ("cublas_refusal", "prepare_cublas_weight", "scaled_mm_nvfp4")

    def layer_refusal(self, layer, n, k, w4a4):
        if (why := super().layer_refusal(layer, n, k, w4a4)) is not None:
            return why
        from ..kernels.fp4_routes import cublas_refusal

        return cublas_refusal(_capability_of(layer), n, k)

    def _prepare_weight(self, layer):
        from ..kernels.fp4_routes import prepare_cublas_weight

        codes, scales_swizzled = prepare_cublas_weight(layer.weight.data, layer.weight_scale.data)
        assert codes is layer.weight.data or codes.data_ptr() == layer.weight.data_ptr(), "cuBLAS keeps the codes"
        return scales_swizzled


class B12xNvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """FlashInfer b12x FP4 GEMM for prefill; the codes are padded to multiples of 32 in place."""

    route, backend_name, w4a4 = "b12x", "nvfp4_sm120_b12x", True
    fp4_routes_needs = ("b12x_refusal", "prepare_b12x_weight", "b12x_linear")

    def layer_refusal(self, layer, n, k, w4a4):
        if (why := super().layer_refusal(layer, n, k, w4a4)) is not None:
            return why
        from ..kernels.fp4_routes import b12x_refusal

        return b12x_refusal(_capability_of(layer), n, k)

    def _prepare_weight(self, layer):
        from ..kernels.fp4_routes import prepare_b12x_weight

        # Replaces the codes by their padded version (no second copy); the linear scales stay, unpadded, for the
        # W4A16 kernel that serves small T (the op slices the first N rows and K columns).
        codes, scales_swizzled = prepare_b12x_weight(layer.weight.data, layer.weight_scale.data)
        replace_parameter(layer, "weight", codes)
        return scales_swizzled


class W4A16NvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """Weight-only: our W4A16 GEMV/GEMM at every T; each fused part keeps its own global.  Opt-in by name."""

    route, backend_name, w4a4 = "w4a16", "nvfp4_sm120_w4a16", False


def activation_dtype(layer: torch.nn.Module) -> torch.dtype:
    """The dtype the layer's activations will have: vLLM builds linears with ``params_dtype`` = the model dtype."""
    return getattr(layer, "params_dtype", None) or torch.get_default_dtype()


class FlashInferW4A16NvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """FlashInfer ``mm_bf16_fp4`` at every T on the weight FlashInfer prepares (weight-only).  Opt-in by name.

    A comparison option, not a default: ``cute-dsl`` (the default backend) repacks the codes, so the layer then
    holds FlashInfer's tensors instead of the checkpoint's (``cudnn`` keeps the codes and re-lays the scales,
    ``cute-dsl-native`` keeps the codes and swizzles the scales).  ``VLLM_NVFP4_SM120_FI_W4A16_BACKEND`` picks the
    backend.  One weight global per tensor: fused layers whose parts differ are refused (route ``w4a16`` applies
    each part's own).
    """

    route, backend_name, w4a4 = "flashinfer_w4a16", "nvfp4_sm120_flashinfer_w4a16", False
    fp4_routes_needs = ("W4A16_BACKENDS", "flashinfer_w4a16_refusal", "prepare_flashinfer_w4a16",
                        "flashinfer_w4a16_linear")

    def __init__(self, config: NvFp4LinearLayerConfig) -> None:
        super().__init__(config)
        self.fi_backend = os.environ.get(FI_W4A16_BACKEND_ENV, "").strip() or FI_W4A16_DEFAULT_BACKEND

    def layer_refusal(self, layer, n, k, w4a4):
        from ..kernels.fp4_routes import W4A16_BACKENDS, flashinfer_w4a16_refusal

        if self.fi_backend not in W4A16_BACKENDS:
            return f"{FI_W4A16_BACKEND_ENV}={self.fi_backend!r} is not one of {W4A16_BACKENDS}"
        parts = scale_policy.part_globals(layer)
        if parts is not None and parts.spread() > 0:
            # No layer-specific numbers here: the reason keys the once-per-layer-kind log line.
            return ("its fused parts have different weight global scales and mm_bf16_fp4 takes one per weight "
                    "(route nvfp4_sm120_w4a16 applies each part's own)")
        return flashinfer_w4a16_refusal(_capability_of(layer), n, k, backend=self.fi_backend,
                                        act_dtype=activation_dtype(layer))

    def _prepare_layer(self, layer, w4a4):
        from ..kernels.fp4_routes import prepare_flashinfer_w4a16

        n = layer.weight.shape[0]
        # The refusal checked that the parts share one global, so any row's decode global is the weight's.
        weight_dec = scale_policy.weight_dec_rows(layer, w4a4=w4a4)[:1].clone()
        b, sf, alpha = prepare_flashinfer_w4a16(layer.weight.data, layer.weight_scale.data, weight_dec,
                                                backend=self.fi_backend)
        # Keep only what mm_bf16_fp4 reads, under the checkpoint's names (as vLLM's own FlashInfer W4A16 kernel
        # does): repacked codes replace the checkpoint's (no second copy), re-laid scales replace the linear ones.
        if b.data_ptr() != layer.weight.data_ptr():
            replace_parameter(layer, "weight", b)
        replace_parameter(layer, "weight_scale", sf)
        layer.register_buffer(_FI_ALPHA, alpha, persistent=False)
        setattr(layer, _FI_N, n)

    def _forward(self, layer, x2, bias):
        return torch.ops.nvfp4_sm120.flashinfer_w4a16(
            x2, layer.weight, layer.weight_scale, getattr(layer, _FI_ALPHA), bias, getattr(layer, _FI_N),
            self.fi_backend,
        )


KERNEL_CLASSES: tuple[type[Sm120NvFp4LinearKernel], ...] = (
    TritonNvFp4LinearKernel,
    CublasNvFp4LinearKernel,
    B12xNvFp4LinearKernel,
    W4A16NvFp4LinearKernel,
    FlashInferW4A16NvFp4LinearKernel,
)
BY_ROUTE = {cls.route: cls for cls in KERNEL_CLASSES}
BY_BACKEND = {cls.backend_name: cls for cls in KERNEL_CLASSES}
BACKEND_NAMES: tuple[str, ...] = (AUTO_BACKEND, *BY_BACKEND)
assert set(BY_ROUTE) == set(dispatch_linear.ROUTES), "one kernel class per dispatch route"


# ---- selection by name -------------------------------------------------------------------------------------------

def candidates(backend: str, use_a16: bool, cc: int | None) -> list[type[Sm120NvFp4LinearKernel]]:
    """Our classes a backend name stands for, in the order they are tried."""
    if backend == AUTO_BACKEND:
        routes = AUTO_W4A16_ROUTES if use_a16 else AUTO_W4A4_ROUTES.get(None if cc is None else cc // 10,
                                                                        AUTO_W4A4_ROUTES[None])
        return [BY_ROUTE[r] for r in routes]
    return [BY_BACKEND[backend]]


def _selection_refusal(cls: type[Sm120NvFp4LinearKernel], use_a16: bool) -> str | None:
    import vllm.envs as envs

    if cls.__name__ in envs.VLLM_DISABLED_KERNELS:
        return "disabled by VLLM_DISABLED_KERNELS"
    if use_a16 and cls.w4a4:
        return "its prefill GEMM needs activation scales; this is a W4A16 checkpoint"
    for ok, why in (cls.is_supported(), cls.can_implement(NvFp4LinearLayerConfig())):
        if not ok:
            return why
    return None


@contextlib.contextmanager
def _hidden(classes: tuple[type, ...]) -> Iterator[None]:
    """Take ``classes`` out of vLLM's CUDA NVFP4 list for one selection (model loading is single-threaded)."""
    from vllm.model_executor.kernels import linear as L
    from vllm.platforms import PlatformEnum

    lst = L._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CUDA, [])
    saved = list(lst)
    lst[:] = [c for c in lst if c not in classes]
    try:
        yield
    finally:
        lst[:] = saved


def _vllm_init() -> Callable[[bool], NvFp4LinearKernel]:
    from . import register

    return register.original_init_nvfp4_linear_kernel()


def _fallback_kernel(use_a16: bool, exclude: tuple[type, ...]) -> NvFp4LinearKernel:
    """vLLM's own choice for the layer with ``exclude`` out of the running.

    Our names are not in vLLM's backend map, so vLLM warns that the name has no kernel for this layer type and
    runs its automatic selection (where our other classes still come first on sm_12x).
    """
    with _hidden(exclude):
        return _vllm_init()(use_a16)


def select_nvfp4_linear_kernel(use_a16: bool = False) -> NvFp4LinearKernel:
    """Drop-in for vLLM's ``init_nvfp4_linear_kernel``: our names here, everything else to vLLM."""
    import vllm.envs as envs
    from vllm.model_executor.kernels import linear as L

    quantization = "nvfp4_w4a16" if use_a16 else "nvfp4_w4a4"
    backend = L._get_linear_backend(quantization=quantization)
    if envs.VLLM_BATCH_INVARIANT or backend not in BACKEND_NAMES:
        return _vllm_init()(use_a16)
    tried = candidates(backend, use_a16, current_capability())
    reasons = []
    for cls in tried:
        why = _selection_refusal(cls, use_a16)
        if why is None:
            return cls(NvFp4LinearLayerConfig())
        reasons.append(f"{cls.__name__}: {why}")
    log_once(
        "warning", (quantization, backend, tuple(reasons)),
        "nvfp4_sm120: --linear-backend=%s cannot take %s layers (%s); falling back to vLLM's selection",
        backend, quantization, "; ".join(reasons),
    )
    return _fallback_kernel(use_a16, exclude=tuple(tried))
