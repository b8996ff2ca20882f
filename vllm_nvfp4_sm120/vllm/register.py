"""The ``vllm.general_plugins`` entry point: every hook of our NVFP4 kernels into vLLM 0.33, and one undo log.

vLLM calls :func:`register` in every process (API server, engine core, each worker) before any model is built.
It is re-entrant (a second call changes nothing), refuses any vLLM other than 0.33.x with one warning, and is
switched off by ``VLLM_NVFP4_SM120=0``.  vLLM has no public registry for NVFP4 kernels or MoE backends, so the
hooks are small patches of private names, each recorded so :func:`unregister` can undo it:

Linears (:mod:`.linear`)

1. our kernel classes go in front of vLLM's CUDA NVFP4 list (``_POSSIBLE_NVFP4_KERNELS``): auto picks them on
   sm_12x for W4A4 layers (``register_linear_kernel`` appends behind the always-true emulation kernel);
2. our backend names are appended to the ``LinearBackend`` Literal (``--linear-backend``,
   ``linear_backend_per_quant``);
3. ``init_nvfp4_linear_kernel`` is replaced where vLLM defines and imported it, to resolve our names
   (:func:`select_nvfp4_linear_kernel`; it also reaches W4A16 checkpoints, where vLLM forces Marlin);
4. ModelOpt's and compressed-tensors' weight processing first keep a copy of the per-part weight globals that
   they are about to merge (:mod:`.scale_policy`), for layers whose kernel is ours; ModelOpt's NVFP4 weight
   creation refuses a per-rank K that no NVFP4 kernel serves with one line naming the layer and the TP size.

MoE experts (:mod:`.moe`), for ModelOpt's and compressed-tensors' NVFP4 MoE methods

5. our name is appended to the ``MoEBackend`` Literal (``--moe-backend nvfp4_sm120``);
6. ``select_nvfp4_moe_backend``, where those two modules imported it, takes our experts unless
   ``Sm120NvFp4Experts.refusal`` says why not; a name we cannot honour logs why and falls back to vLLM's choice;
7. their ``process_weights_after_loading`` and ``get_fused_moe_quant_config``, for layers whose experts are ours,
   become ``Sm120NvFp4Experts.prepare_layer`` and ``Sm120NvFp4Experts.quant_config``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

ENV_SWITCH = "VLLM_NVFP4_SM120"
SUPPORTED_VLLM = (0, 33)

_undo: list[Callable[[], None]] = []
_warned_version = False


def disabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


def vllm_version_supported(version: str) -> bool:
    try:
        return tuple(int(p) for p in version.split(".")[:2]) == SUPPORTED_VLLM
    except ValueError:
        return False


def is_registered() -> bool:
    return bool(_undo)


def register() -> None:
    """Entry point (``vllm.general_plugins``); safe to call any number of times."""
    global _warned_version
    if disabled_by_env():
        return
    import vllm

    if not vllm_version_supported(vllm.__version__):
        if not _warned_version:
            _warned_version = True
            from .log import logger

            logger.warning(
                "vllm-nvfp4-sm120 supports vLLM %d.%d.x only, found %s: the plugin is not active.",
                *SUPPORTED_VLLM, vllm.__version__,
            )
        return
    if is_registered():
        return
    try:
        _install_linear()
        _install_moe()
    except BaseException:
        unregister()
        raise


def unregister() -> None:
    """Undo every change :func:`register` made, newest first (tests; a process never needs it)."""
    while _undo:
        _undo.pop()()


def _set(obj, name: str, value) -> None:
    """``obj.name = value`` (a module's or a class's own attribute), recorded for :func:`unregister`."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    _undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))


def _extend_backend_literal(spec, names) -> None:
    from . import backend_names

    if backend_names.extend_literal(spec, names):
        _undo.append(lambda: backend_names.restore(spec))


# ---- linears -------------------------------------------------------------------------------------------------------

def _install_linear() -> None:
    import vllm.model_executor.kernels.linear as L
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_nvfp4 as ct
    from vllm.platforms import PlatformEnum

    from . import backend_names, linear, scale_policy

    # 1. our classes first in the CUDA NVFP4 list, in preference order
    lst = L._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CUDA, [])
    saved = list(lst)
    lst[:0] = [c for c in linear.KERNEL_CLASSES if c not in lst]
    _undo.append(lambda: lst.__setitem__(slice(None), saved))

    # 2. backend names
    _extend_backend_literal(backend_names.LINEAR_BACKEND, linear.BACKEND_NAMES)

    # 3. init_nvfp4_linear_kernel, in its module and wherever it was imported by name
    original = L.init_nvfp4_linear_kernel

    @functools.wraps(original)
    def init_nvfp4_linear_kernel(use_a16: bool = False):
        return select_nvfp4_linear_kernel(use_a16)

    setattr(init_nvfp4_linear_kernel, linear.ORIGINAL_INIT_ATTR, original)
    for mod_name, mod in list(sys.modules.items()):
        imported = getattr(mod, "__dict__", {}).get("init_nvfp4_linear_kernel")  # sys.modules may hold None
        if mod_name.split(".")[0] == "vllm" and imported is original:
            _set(mod, "init_nvfp4_linear_kernel", init_nvfp4_linear_kernel)

    # 4. per-part weight globals, captured before vLLM merges them
    def ours(kernel) -> bool:
        return isinstance(kernel, linear.Sm120NvFp4LinearKernel)

    process = modelopt.KNvfp4Static.process

    @functools.wraps(process)
    def modelopt_process(self, layer, role):
        scale_2 = getattr(layer, "weight_scale_2", None)
        if role is modelopt.WEIGHT and scale_2 is not None and ours(getattr(layer.quant_method, "kernel", None)):
            scale_policy.capture_part_globals(layer, dec=scale_2.data)
        return process(self, layer, role)

    _set(modelopt.KNvfp4Static, "process", modelopt_process)

    # 4b. a per-rank K that no NVFP4 kernel serves: our one-line refusal instead of ModelOpt's generic one
    create = modelopt.KNvfp4Static.create_weights

    @functools.wraps(create)
    def modelopt_create_weights(self, layer, role, ctx, shapes, wl):
        if role is modelopt.WEIGHT:
            linear.refuse_unservable_shard(layer, shapes.input_size_per_partition)
        return create(self, layer, role, ctx, shapes, wl)

    _set(modelopt.KNvfp4Static, "create_weights", modelopt_create_weights)

    ct_process = ct.CompressedTensorsW4A4Fp4.process_weights_after_loading

    @functools.wraps(ct_process)
    def ct_process_weights_after_loading(self, layer):
        if ours(self.kernel) and getattr(layer, "weight_global_scale", None) is not None:
            scale_policy.capture_part_globals(layer, enc=layer.weight_global_scale.data)
        return ct_process(self, layer)

    _set(ct.CompressedTensorsW4A4Fp4, "process_weights_after_loading", ct_process_weights_after_loading)


def _candidates(backend: str, use_a16: bool) -> list[type]:
    """Our classes a backend name stands for, in the order they are tried."""
    from ..dispatch import vendor
    from . import linear
    from .platform import current_capability

    if backend == linear.AUTO_BACKEND:
        return [linear.BY_ROUTE[r] for r in vendor.auto_routes(current_capability(), w4a4=not use_a16)]
    return [linear.BY_BACKEND[backend]]


def _selection_refusal(cls, use_a16: bool) -> str | None:
    import vllm.envs as envs
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

    if cls.__name__ in envs.VLLM_DISABLED_KERNELS:
        return "disabled by VLLM_DISABLED_KERNELS"
    if use_a16 and cls.w4a4:
        return "its prefill GEMM needs activation scales; this is a W4A16 checkpoint"
    for ok, why in (cls.is_supported(), cls.can_implement(NvFp4LinearLayerConfig())):
        if not ok:
            return why
    return None


def select_nvfp4_linear_kernel(use_a16: bool = False):
    """Drop-in for vLLM's ``init_nvfp4_linear_kernel``: our names here, everything else to vLLM."""
    import vllm.envs as envs
    from vllm.model_executor.kernels import linear as L
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

    from . import linear
    from .log import log_once

    quantization = "nvfp4_w4a16" if use_a16 else "nvfp4_w4a4"
    backend = L._get_linear_backend(quantization=quantization)
    if envs.VLLM_BATCH_INVARIANT or backend not in linear.BACKEND_NAMES:
        return linear.vllm_init_nvfp4_linear_kernel()(use_a16)
    tried = _candidates(backend, use_a16)
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
    return linear.fallback_kernel(use_a16, exclude=tuple(tried))


# ---- MoE experts ---------------------------------------------------------------------------------------------------

def _install_moe() -> None:
    import vllm.model_executor.layers.fused_moe.oracle.nvfp4 as oracle
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as ct,
    )

    from . import backend_names
    from .moe import BACKEND_NAMES
    from .scale_policy import COMPRESSED_TENSORS, MODELOPT

    _extend_backend_literal(backend_names.MOE_BACKEND, BACKEND_NAMES)

    original = oracle.select_nvfp4_moe_backend
    for fmt, module, method_cls in ((MODELOPT, modelopt, modelopt.ModelOptNvFp4FusedMoE),
                                    (COMPRESSED_TENSORS, ct, ct.CompressedTensorsW4A4Nvfp4MoEMethod)):
        if module.select_nvfp4_moe_backend is not original:
            raise RuntimeError(f"{module.__name__}.select_nvfp4_moe_backend is not vLLM's: another plugin patched it")
        _set(module, "select_nvfp4_moe_backend", _moe_select(fmt, original))
        _set(method_cls, "process_weights_after_loading",
             _moe_process(fmt, module, method_cls.process_weights_after_loading))
        _set(method_cls, "get_fused_moe_quant_config", _moe_quant_config(method_cls.get_fused_moe_quant_config))


def _moe_select(fmt: str, original: Callable) -> Callable:
    from .log import log_once
    from .moe import BACKEND_NAME, BACKEND_NAMES, Sm120NvFp4Experts

    @functools.wraps(original)
    def select_nvfp4_moe_backend(config, weight_key, activation_key):
        acts = "W4A16" if activation_key is None else "W4A4"
        why = Sm120NvFp4Experts.refusal(config, weight_key, activation_key)
        if why is None:
            how = "named" if config.moe_backend in BACKEND_NAMES else "auto"
            log_once("info", (fmt, acts, how),
                     "nvfp4_sm120: NVFP4 MoE layers (%s %s) use %s (%s)",
                     fmt, acts, Sm120NvFp4Experts.__name__,
                     "--moe-backend " + BACKEND_NAME if how == "named" else "automatic on sm_12x")
            return Sm120NvFp4Experts.backend_slot, Sm120NvFp4Experts
        if config.moe_backend not in BACKEND_NAMES:
            return original(config, weight_key, activation_key)
        log_once("warning", (fmt, acts, why),
                 "nvfp4_sm120: --moe-backend %s cannot take %s %s MoE layers (%s); using vLLM's automatic choice",
                 BACKEND_NAME, fmt, acts, why)
        # vLLM does not know our name: run its automatic selection for this layer.
        config.moe_backend = "auto"
        try:
            return original(config, weight_key, activation_key)
        finally:
            config.moe_backend = BACKEND_NAME

    return select_nvfp4_moe_backend


def _moe_process(fmt: str, module, original: Callable) -> Callable:
    from .moe import Sm120NvFp4Experts
    from .scale_policy import MODELOPT

    @functools.wraps(original)
    def process_weights_after_loading(self, layer):
        if not Sm120NvFp4Experts.serves(self):
            return original(self, layer)
        if fmt == MODELOPT and module.is_weights_pre_processed():
            return original(self, layer)  # vLLM's pre-processed (TRTLLM) weights: vLLM explains the error
        return Sm120NvFp4Experts.prepare_layer(self, layer, fmt)

    return process_weights_after_loading


def _moe_quant_config(original: Callable) -> Callable:
    from .moe import Sm120NvFp4Experts

    @functools.wraps(original)
    def get_fused_moe_quant_config(self, layer):
        if not Sm120NvFp4Experts.serves(self):
            return original(self, layer)
        return Sm120NvFp4Experts.quant_config(layer, w4a4=not self.use_a16)

    return get_fused_moe_quant_config
