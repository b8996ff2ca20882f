"""The two vLLM load modes that skip our kernels' load step, and how the plugin refuses them.

Every linear route derives tensors at load and keeps them as buffers (per-row weight globals, swizzled scales; b12x
pads the codes, the ``flashinfer_w4a16`` route keeps FlashInfer's prepared weight and N), and keeps Python-side
state (a fallback kernel).  Two vLLM 0.33 paths put weights into a layer without running that step:

* ``reload_weights(is_checkpoint_format=False)`` (kernel-format reload) copies the given tensors into the
  layer's *parameters* only and does not call ``process_weights_after_loading``: a linear's derived buffers would
  keep the old weights' globals and scales.  :func:`refuse_kernel_format_reload` raises before any tensor is
  touched.  Our MoE experts keep every tensor they read as a parameter (their quant config holds the parameters
  themselves), so a kernel-format reload updates them like vLLM's own experts and is not refused.
* the weight-cache IPC loader (``--load-format ipc_cache``, fed by a ``vllm preload`` daemon) maps the daemon's
  processed tensors and skips the quant methods' tensor work, so our load step never runs in the engine.  In this
  mode, in the engine and in the daemon alike (:func:`loading_for_weight_cache`), selection hands NVFP4 linears and
  MoE layers to vLLM's own kernels, so both processes lay the tensors out the same way.

Checkpoint-format reloads (the RL weight-sync path) rerun the load step and are supported.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from .log import layer_name, log_once

IPC_LOAD_FORMAT = "ipc_cache"  # vLLM's LoadConfig.load_format of the weight-cache IPC loader

_for_weight_cache: contextvars.ContextVar[bool] = contextvars.ContextVar("nvfp4_sm120_for_weight_cache",
                                                                         default=False)


@contextlib.contextmanager
def loading_for_weight_cache() -> Iterator[None]:
    """The ``vllm preload`` daemon builds and loads the model it will serve to IPC engines inside this."""
    token = _for_weight_cache.set(True)
    try:
        yield
    finally:
        _for_weight_cache.reset(token)


def weight_cache_mode() -> str | None:
    """Which side of the weight-cache IPC loader this load is on, or None when it is an ordinary load."""
    if _for_weight_cache.get():
        return "the weight cache daemon (vllm preload)"
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and getattr(config.load_config, "load_format", None) == IPC_LOAD_FORMAT:
        return f"--load-format {IPC_LOAD_FORMAT}"
    return None


def log_weight_cache_refusal(what: str, mode: str, fallback: str) -> None:
    log_once(
        "warning", ("weight cache", what),
        "nvfp4_sm120: %s: the weight-cache IPC loader (%s) maps pre-processed weights without the load step "
        "our kernels need; these layers use vLLM's %s instead",
        what, mode, fallback,
    )


def linears_on_our_routes(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(module name, route) for every linear whose load step is one of our routes' (not a fallback's)."""
    from .linear import Sm120NvFp4LinearKernel

    found = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "kernel", None)
        if isinstance(kernel, Sm120NvFp4LinearKernel) and kernel._fallback is None:
            found.append((name or layer_name(module), f"linear route {kernel.route} ({kernel.backend_name})"))
    return found


def refuse_kernel_format_reload(model: torch.nn.Module) -> None:
    """ValueError (and one error line) when a kernel-format reload would leave a linear of ours stale."""
    found = linears_on_our_routes(model)
    if not found:
        return
    name, what = found[0]
    msg = (f"nvfp4_sm120: reload_weights(is_checkpoint_format=False) cannot update layer {name} ({what}) and "
           f"{len(found) - 1} more: a kernel-format reload copies parameters only, and our linear routes keep "
           "buffers derived at load (per-row globals, swizzled scales, FlashInfer's alpha) that it would leave "
           "stale. Nothing was changed. Reload in checkpoint format (is_checkpoint_format=True), or serve the "
           "linears on vLLM's kernels (e.g. --linear-backend flashinfer_cutlass, or VLLM_NVFP4_SM120=0).")
    log_once("error", ("kernel-format reload",), "%s", msg)
    raise ValueError(msg)
