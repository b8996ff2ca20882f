"""The ``vllm.general_plugins`` entry point: hook our NVFP4 linear kernels into vLLM 0.33.

vLLM calls :func:`register` in every process (API server, engine core, each worker) before any model is built.
It is re-entrant (a second call changes nothing), refuses any vLLM other than 0.33.x with one warning, and is
switched off by ``VLLM_NVFP4_SM120=0``.  vLLM has no public registry for NVFP4 kernels, so the hooks are small
patches of private names, each recorded so :func:`unregister` can undo it:

1. our kernel classes go in front of vLLM's CUDA NVFP4 list (``_POSSIBLE_NVFP4_KERNELS``): auto picks them on
   sm_12x for W4A4 layers (``register_linear_kernel`` appends behind the always-true emulation kernel);
2. our backend names are appended to the ``LinearBackend`` Literal (``--linear-backend``,
   ``linear_backend_per_quant``);
3. ``init_nvfp4_linear_kernel`` is replaced where vLLM defines and imported it, to resolve our names (and reach
   W4A16 checkpoints, where vLLM forces Marlin);
4. ModelOpt's and compressed-tensors' weight processing first keep a copy of the per-part weight globals that
   they are about to merge (:mod:`.scale_policy`), for layers whose kernel is ours.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

ENV_SWITCH = "VLLM_NVFP4_SM120"
SUPPORTED_VLLM = (0, 33)
_MARK = "__nvfp4_sm120_original__"

_undo: list[Callable[[], None]] = []
_warned_version = False


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.nvfp4_sm120")


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
            _logger().warning(
                "vllm-nvfp4-sm120 supports vLLM %d.%d.x only, found %s: the plugin is not active.",
                *SUPPORTED_VLLM, vllm.__version__,
            )
        return
    if is_registered():
        return
    try:
        _install_linear()
        from .moe import register_moe

        register_moe()
    except BaseException:
        unregister()
        raise


def unregister() -> None:
    """Undo every change :func:`register` made (tests; a process never needs it)."""
    from .moe import unregister_moe

    unregister_moe()
    while _undo:
        _undo.pop()()


def _set(obj, name: str, value) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    _undo.append(lambda: setattr(obj, name, old))


def original_init_nvfp4_linear_kernel() -> Callable:
    """vLLM's own ``init_nvfp4_linear_kernel`` (ours wraps it)."""
    from vllm.model_executor.kernels import linear as L

    fn = L.init_nvfp4_linear_kernel
    return getattr(fn, _MARK, fn)


def _install_linear() -> None:
    import vllm.model_executor.kernels.linear as L
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_nvfp4 as ct
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.platforms import PlatformEnum

    from . import backend_names, linear, scale_policy

    # 1. our classes first in the CUDA NVFP4 list, in preference order
    lst = L._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CUDA, [])
    saved = list(lst)
    lst[:0] = [c for c in linear.KERNEL_CLASSES if c not in lst]
    _undo.append(lambda: lst.__setitem__(slice(None), saved))

    # 2. backend names
    if backend_names.extend_literal(backend_names.LINEAR_BACKEND, linear.BACKEND_NAMES):
        _undo.append(lambda: backend_names.restore(backend_names.LINEAR_BACKEND))

    # 3. init_nvfp4_linear_kernel, in its module and wherever it was imported by name
    original = L.init_nvfp4_linear_kernel

    @functools.wraps(original)
    def init_nvfp4_linear_kernel(use_a16: bool = False):
        return linear.select_nvfp4_linear_kernel(use_a16)

    setattr(init_nvfp4_linear_kernel, _MARK, original)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.split(".")[0] == "vllm" and getattr(mod, "__dict__", {}).get("init_nvfp4_linear_kernel") is original:
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

    ct_process = ct.CompressedTensorsW4A4Fp4.process_weights_after_loading

    @functools.wraps(ct_process)
    def ct_process_weights_after_loading(self, layer):
        if ours(self.kernel) and getattr(layer, "weight_global_scale", None) is not None:
            scale_policy.capture_part_globals(layer, enc=layer.weight_global_scale.data)
        return ct_process(self, layer)

    _set(ct.CompressedTensorsW4A4Fp4, "process_weights_after_loading", ct_process_weights_after_loading)
