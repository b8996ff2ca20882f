"""vLLM NVFP4 linear kernel classes, one thin class per route of ``dispatch.linear``.

Every class but one calls the same torch custom op, ``torch.ops.nvfp4_sm120.linear`` (``dispatch/ops.py``), with its
route; the op picks the kernel per call from T (W4A16 kernel on the same weight at decode sizes, the route's W4A4
GEMM for prefill).  The classes only prepare the layer once at load time: a ``[N]`` weight decode global per row
(:mod:`.scale_policy`), a 128x4-swizzled copy of the block scales for the cuBLAS and b12x routes, and the b12x
padding.  The codes are never copied.  A route that cannot take a layer (``dispatch.vendor``) hands it, with one
log line, to the kernel vLLM's selection picks without it.

The exception is the comparison route ``flashinfer_w4a16`` (:class:`Sm120FlashInferW4A16NvFp4LinearKernel`): FlashInfer
``mm_bf16_fp4`` at every T on the weight as FlashInfer prepares it (``cute-dsl`` repacks the codes), through its
own op ``torch.ops.nvfp4_sm120.flashinfer_w4a16``.  It replaces the layer's tensors by FlashInfer's, so there is
still one copy of the weight, and it is opt-in by name only.

How vLLM reaches these classes (our classes in front of its CUDA NVFP4 list, our backend names) is installed by
:mod:`.register`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.utils import replace_parameter

from ..dispatch import linear as dispatch_linear
from ..dispatch import ops as _ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.linear / .flashinfer_w4a16)
from ..dispatch import guard, vendor
from ..dispatch.hw import Capability, capability_of
from ..dispatch.shards import shard_refusal
from ..dispatch.linear import AUTO_BACKEND, ROUTE_PREFILL, Route, backend_name
from ..format import check_tensor
from . import scale_policy
from .log import layer_name, log_once
from . import numerics
from .numerics import apply_numerics_policy
from .platform import current_capability

# The load-time tensors a route derives from the checkpoint's are *persistent* buffers: vLLM's in-place weight
# reload (RL weight sync) copies the reprocessed values of parameters and persistent buffers into the tensors the
# layer held, and skips non-persistent buffers, which would keep the old weights' globals and scales.
_W_DEC_ROWS = "_nvfp4_sm120_w_dec_rows"
_W_SCALES_SWIZZLED = "_nvfp4_sm120_w_scales_swizzled"
# Route flashinfer_w4a16: its weight global (FlashInfer's alpha, [1] fp32) and N (the repacked weight hides it).
_FI_ALPHA = "_nvfp4_sm120_fi_alpha"
_FI_N = "_nvfp4_sm120_fi_n"
FI_W4A16_BACKEND_ENV = "VLLM_NVFP4_SM120_FI_W4A16_BACKEND"
FI_W4A16_DEFAULT_BACKEND = "cute-dsl"
# Where register.py keeps vLLM's own init_nvfp4_linear_kernel on the function that replaces it.
ORIGINAL_INIT_ATTR = "__nvfp4_sm120_original__"


def requested_backends() -> set[str]:
    """Every linear backend name the current vLLM config asks for (global and per quantization)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return set()
    kc = config.kernel_config
    return {kc.linear_backend, *(kc.linear_backend_per_quant or {}).values()}


def _capability_of(layer: torch.nn.Module) -> Capability:
    """What the vendor requirements take: vLLM's view of the GPU, else the weight's (non-CUDA) device."""
    return current_capability() or capability_of(layer.weight.device)


def refuse_unservable_shard(layer: torch.nn.Module, k_per_rank: int) -> None:
    """Raise at load when this rank's K cannot be served by any NVFP4 kernel (``dispatch.shards``).

    A ``ValueError``, not a fallback: no NVFP4 kernel takes a K that is not whole 16-blocks, so vLLM's next kernel
    would serve wrong block scales or fail at the first forward.  Every rank has the same K, so every rank raises.
    """
    full = getattr(layer, "input_size", None) or k_per_rank
    tp = getattr(layer, "tp_size", 1) if k_per_rank != full else 1
    if (why := shard_refusal(layer_name(layer), "K", full, k_per_rank, tp)) is not None:
        raise ValueError(why)


def layer_is_w4a4(layer: torch.nn.Module) -> bool:
    """W4A4 layers carry vLLM's activation globals; W4A16 checkpoints (and weight-only fallbacks) do not."""
    return getattr(layer, "input_global_scale_inv", None) is not None and getattr(layer, "alpha", None) is not None


class _OtherRank:
    """The guard's verdict when this rank's check passed and another tensor-parallel rank's failed."""

    key = ("linear", "another rank")

    @staticmethod
    def describe() -> str:
        return "a kernel of this layer failed the check on another tensor-parallel rank's GPU"


OTHER_RANK_FAILED = _OtherRank()


class Sm120NvFp4LinearKernel(NvFp4LinearKernel):
    """Base of our NVFP4 linear kernels; a subclass names its :attr:`route`, the rest derives from it."""

    route: ClassVar[Route]
    backend_name: ClassVar[str]  # --linear-backend
    w4a4: ClassVar[bool]  # the route's prefill GEMM quantizes activations: needs a W4A4 checkpoint

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        cls.backend_name = backend_name(cls.route)
        cls.w4a4 = ROUTE_PREFILL[cls.route].w4a4

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
        cap = Capability(compute_capability) if compute_capability is not None else current_capability()
        if cap is None:
            return False, "needs a CUDA GPU"
        if cls.route not in dispatch_linear.TABLE.get(cap.family, {}):
            return False, f"route {str(cls.route)!r} has no kernels for {cap.name}"
        if vendor.chosen_automatically(cap) or cls.is_named():
            return True, None
        return False, f"runs on {cap.name} only when named (--linear-backend {cls.backend_name} or {AUTO_BACKEND})"

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None  # every layer config; a layer's shape and scales are checked at load (layer_refusal)

    def layer_refusal(self, layer: torch.nn.Module, n: int, k: int, w4a4: bool) -> str | None:
        """Why this route cannot take this particular layer (shape, scales), found at load time."""
        if self.w4a4 and not w4a4:
            return "the route's prefill GEMM needs activation scales, and this is a W4A16 layer"
        return None

    # ---- load ----------------------------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w4a4 = layer_is_w4a4(layer)
        kind = f"{type(layer).__name__} {'W4A4' if w4a4 else 'W4A16'}"
        refuse_unservable_shard(layer, layer.weight.shape[-1] * 2)
        apply_numerics_policy()
        n, k = self._check_layer(layer)
        if (why := self.layer_refusal(layer, n, k, w4a4)) is not None:
            self._fall_back(layer, w4a4, exclude=(type(self),))
            log_once(
                "warning", (kind, self.route, "fallback", why),
                "nvfp4_sm120: route %s cannot take NVFP4 %s layers (first: %s): %s; using %s instead",
                self.route, kind, layer_name(layer), why, type(self._fallback).__name__,
            )
            self._fallback.process_weights_after_loading(layer)
            return
        if (failed := self._guard(layer, n, k)) is not None:
            # Our routes share their small-T kernels: past a failed check, vLLM's own kernels serve the layer.
            self._fall_back(layer, w4a4, exclude=KERNEL_CLASSES)
            log_once(
                "error", ("guard", failed.key),
                "nvfp4_sm120: numerics guard: layer %s: %s; the layer runs vLLM's %s instead "
                "(VLLM_NVFP4_SM120_GUARD=strict fails the load)",
                layer_name(layer), failed.describe(), type(self._fallback).__name__,
            )
            self._fallback.process_weights_after_loading(layer)
            return
        self._prepare_layer(layer, w4a4)
        log_once("info", (kind, self.route, type(self).__name__),
                  "nvfp4_sm120: NVFP4 %s layers use %s (route %s)", kind, type(self).__name__, self.route)

    def _fall_back(self, layer: torch.nn.Module, w4a4: bool, exclude: tuple[type, ...]) -> None:
        self._fallback = fallback_kernel(use_a16=not w4a4, exclude=exclude)
        scale_policy.drop_part_globals(layer)

    def _guard(self, layer: torch.nn.Module, n: int, k: int) -> guard.GuardResult | _OtherRank | None:
        """The first plan of this layer's shape that fails the numerics guard on this GPU (``dispatch/guard.py``),
        or None.  Runs on a synthetic problem of the layer's shape, before the layer is prepared, so a failure
        leaves the checkpoint's tensors as they were for vLLM's kernel."""
        mode, device = numerics.guard_mode(), layer.weight.device
        if not guard.should_run(mode, device, numerics.FORCE_GUARD):
            return None
        try:
            results = guard.guard_linear(self.route, n, k, activation_dtype(layer), device, mode=mode, force=True)
        except guard.NumericsGuardError as e:
            raise guard.NumericsGuardError(f"NVFP4 layer {layer_name(layer)}: {e}") from None
        failed = next((r for r in results if not r.ok), None)
        # Every rank takes the fallback if any rank's GPU failed the check (the same layers on every rank).
        (any_failed,) = numerics.max_over_ranks([int(failed is not None)])
        return failed if failed is not None else OTHER_RANK_FAILED if any_failed else None

    @staticmethod
    def _check_layer(layer: torch.nn.Module) -> tuple[int, int]:
        name = layer_name(layer)
        w = check_tensor(f"{name}.weight", layer.weight, dtype=torch.uint8, ndim=2)
        n, k = w.shape[0], w.shape[1] * 2
        check_tensor(f"{name}.weight_scale", layer.weight_scale, dtype=torch.float8_e4m3fn, shape=(n, k // 16))
        return n, k

    def _prepare_layer(self, layer: torch.nn.Module, w4a4: bool) -> None:
        """What the op needs next to the checkpoint's tensors: the per-row decode globals, the route's layout."""
        layer.register_buffer(_W_DEC_ROWS, scale_policy.weight_dec_rows(layer, w4a4=w4a4))
        layer.register_buffer(_W_SCALES_SWIZZLED, self._prepare_weight(layer))

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


class Sm120TritonNvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """Our Triton W4A4 GEMM for prefill (native FP4 MMA on sm_120), W4A16 kernel at decode sizes."""

    route = Route.TRITON


class Sm120CublasNvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """cuBLAS block-scaled FP4 GEMM (``torch._scaled_mm``) for prefill; needs swizzled weight scales."""

    route = Route.CUBLAS

    def layer_refusal(self, layer, n, k, w4a4):
        if (why := super().layer_refusal(layer, n, k, w4a4)) is not None:
            return why
        return vendor.cublas_refusal(_capability_of(layer), n, k)

    def _prepare_weight(self, layer):
        from ..kernels.fp4_routes import prepare_cublas_weight

        codes, scales_swizzled = prepare_cublas_weight(layer.weight.data, layer.weight_scale.data)
        assert codes is layer.weight.data or codes.data_ptr() == layer.weight.data_ptr(), "cuBLAS keeps the codes"
        return scales_swizzled


class Sm120B12xNvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """FlashInfer b12x FP4 GEMM for prefill; the codes are padded to multiples of 32 in place."""

    route = Route.B12X

    def layer_refusal(self, layer, n, k, w4a4):
        if (why := super().layer_refusal(layer, n, k, w4a4)) is not None:
            return why
        return vendor.b12x_refusal(_capability_of(layer), n, k)

    def _prepare_weight(self, layer):
        from ..kernels.fp4_routes import prepare_b12x_weight

        # Replaces the codes by their padded version (no second copy); the linear scales stay, unpadded, for the
        # W4A16 kernel that serves small T (the op slices the first N rows and K columns).
        codes, scales_swizzled = prepare_b12x_weight(layer.weight.data, layer.weight_scale.data)
        replace_parameter(layer, "weight", codes)
        return scales_swizzled


class Sm120W4A16NvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """Weight-only: our W4A16 GEMV/GEMM at every T; each fused part keeps its own global.  Opt-in by name."""

    route = Route.W4A16


def activation_dtype(layer: torch.nn.Module) -> torch.dtype:
    """The dtype the layer's activations will have: vLLM builds linears with ``params_dtype`` = the model dtype."""
    return getattr(layer, "params_dtype", None) or torch.get_default_dtype()


class Sm120FlashInferW4A16NvFp4LinearKernel(Sm120NvFp4LinearKernel):
    """FlashInfer ``mm_bf16_fp4`` at every T on the weight FlashInfer prepares (weight-only).  Opt-in by name.

    A comparison option, not a default: ``cute-dsl`` (the default backend) repacks the codes, so the layer then
    holds FlashInfer's tensors instead of the checkpoint's (``cudnn`` keeps the codes and re-lays the scales,
    ``cute-dsl-native`` keeps the codes and swizzles the scales).  ``VLLM_NVFP4_SM120_FI_W4A16_BACKEND`` picks the
    backend.  One weight global per tensor: fused layers whose parts differ are refused (route ``w4a16`` applies
    each part's own).
    """

    route = Route.FLASHINFER_W4A16

    def __init__(self, config: NvFp4LinearLayerConfig) -> None:
        super().__init__(config)
        self.fi_backend = os.environ.get(FI_W4A16_BACKEND_ENV, "").strip() or FI_W4A16_DEFAULT_BACKEND

    def layer_refusal(self, layer, n, k, w4a4):
        from ..kernels.fp4_routes import W4A16_BACKENDS

        if self.fi_backend not in W4A16_BACKENDS:
            return f"{FI_W4A16_BACKEND_ENV}={self.fi_backend!r} is not one of {W4A16_BACKENDS}"
        parts = scale_policy.part_globals(layer)
        if parts is not None and parts.spread() > 0:
            # No layer-specific numbers here: the reason keys the once-per-layer-kind log line.
            return ("its fused parts have different weight global scales and mm_bf16_fp4 takes one per weight "
                    "(route nvfp4_sm120_w4a16 applies each part's own)")
        return vendor.flashinfer_w4a16_refusal(_capability_of(layer), n, k, backend=self.fi_backend,
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
        layer.register_buffer(_FI_ALPHA, alpha)
        setattr(layer, _FI_N, n)

    def _forward(self, layer, x2, bias):
        return torch.ops.nvfp4_sm120.flashinfer_w4a16(
            x2, layer.weight, layer.weight_scale, getattr(layer, _FI_ALPHA), bias, getattr(layer, _FI_N),
            self.fi_backend,
        )


KERNEL_CLASSES: tuple[type[Sm120NvFp4LinearKernel], ...] = (
    Sm120TritonNvFp4LinearKernel,
    Sm120CublasNvFp4LinearKernel,
    Sm120B12xNvFp4LinearKernel,
    Sm120W4A16NvFp4LinearKernel,
    Sm120FlashInferW4A16NvFp4LinearKernel,
)
BY_ROUTE = {cls.route: cls for cls in KERNEL_CLASSES}
BY_BACKEND = {cls.backend_name: cls for cls in KERNEL_CLASSES}
BACKEND_NAMES: tuple[str, ...] = (AUTO_BACKEND, *BY_BACKEND)
assert set(BY_ROUTE) == set(dispatch_linear.ROUTES), "one kernel class per dispatch route"


# ---- vLLM's own choice for a layer one of ours cannot take ---------------------------------------------------------

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


def vllm_init_nvfp4_linear_kernel() -> Callable[[bool], NvFp4LinearKernel]:
    """vLLM's own ``init_nvfp4_linear_kernel`` (register.py replaces it by one that resolves our names)."""
    from vllm.model_executor.kernels import linear as L

    fn = L.init_nvfp4_linear_kernel
    return getattr(fn, ORIGINAL_INIT_ATTR, fn)


def fallback_kernel(use_a16: bool, exclude: tuple[type, ...]) -> NvFp4LinearKernel:
    """vLLM's own choice for the layer with ``exclude`` out of the running.

    Our names are not in vLLM's backend map, so vLLM warns that the name has no kernel for this layer type and
    runs its automatic selection (where our other classes still come first on sm_12x).
    """
    with _hidden(exclude):
        return vllm_init_nvfp4_linear_kernel()(use_a16)
