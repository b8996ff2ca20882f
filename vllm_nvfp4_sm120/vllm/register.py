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

Loading

8. the model loaders' ``process_weights_after_loading(model, ...)`` is followed by one summary line per per-layer
   warning (count and worst layer) instead of one line per layer;
9. the load modes that skip our load step (:mod:`.load_modes`): ``reload_weights``, where vLLM defines and imported
   it, refuses a kernel-format reload of a model with linears on our routes before it touches a tensor; the
   weight cache daemon's ``WeightCacheDaemon.get_model`` marks its load, so that selection there and under
   ``--load-format ipc_cache`` hands NVFP4 layers to vLLM's kernels.

Every private name the hooks need is listed in :data:`VLLM_NAMES` and checked before anything changes; any error
while patching undoes what was installed and leaves vLLM as it is (one warning).  The plugin's environment
variables are registered with vLLM (:data:`ENV_VARS`).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

ENV_SWITCH = "VLLM_NVFP4_SM120"
SUPPORTED_VLLM = (0, 33)

# The plugin's environment variables, registered in ``vllm.envs.environment_variables`` so vLLM knows them: its
# unknown-variable check (``--fail-on-environ-validation`` turns it into an error) passes, Ray copies them to the
# workers, ``collect_env`` reports them, and vLLM's torch.compile cache key (``envs.compile_factors``, every
# registered variable outside its own ignore list) changes with them.  They are registered even while the plugin
# is off, since the off switch itself is one of them.  ``tests/glue/test_register.py`` checks that every
# ``VLLM_NVFP4_SM120*`` name in the package is listed here.
ENV_VARS: tuple[str, ...] = (
    ENV_SWITCH,  # "0" turns the plugin off
    "VLLM_NVFP4_SM120_DISABLE_GLUON",  # kernels/gluon_compat.py
    "VLLM_NVFP4_SM120_CONFIG_DIR",  # dispatch/configs.py
    "VLLM_NVFP4_SM120_FI_W4A16_BACKEND",  # vllm/linear.py
    "VLLM_NVFP4_SM120_DECODE",  # vllm/numerics.py: the batch numerics policy
    "VLLM_NVFP4_SM120_GUARD",  # vllm/numerics.py: the load-time numerics guard
)

# Every vLLM name the plugin patches or calls later, as "module:attribute[.attribute]".  Registration resolves them
# all before it changes anything: a vLLM release that renames one leaves the plugin inactive with one warning
# naming it, instead of failing in the middle of the patches or while a model loads.
_LINEAR = "vllm.model_executor.kernels.linear"
_MODELOPT = "vllm.model_executor.layers.quantization.modelopt"
_CT_LINEAR = "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4"
_CT_MOE = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
           "compressed_tensors_moe_w4a4_nvfp4")
_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"
_RELOAD = "vllm.model_executor.model_loader.reload.inplace"
_DAEMON = "vllm.model_executor.model_loader.weight_cache.daemon"
VLLM_NAMES: tuple[str, ...] = (
    f"{_LINEAR}:_POSSIBLE_NVFP4_KERNELS",
    f"{_LINEAR}:init_nvfp4_linear_kernel",
    f"{_LINEAR}:_get_linear_backend",
    "vllm.model_executor.kernels.linear.nvfp4.base:NvFp4LinearKernel",
    "vllm.model_executor.kernels.linear.nvfp4.base:NvFp4LinearLayerConfig",
    "vllm.config.kernel:LinearBackend",
    "vllm.config.kernel:MoEBackend",
    f"{_MODELOPT}:KNvfp4Static.process",
    f"{_MODELOPT}:KNvfp4Static.create_weights",
    f"{_MODELOPT}:WEIGHT",
    f"{_MODELOPT}:is_weights_pre_processed",
    f"{_MODELOPT}:select_nvfp4_moe_backend",
    f"{_MODELOPT}:ModelOptNvFp4FusedMoE.process_weights_after_loading",
    f"{_MODELOPT}:ModelOptNvFp4FusedMoE.get_fused_moe_quant_config",
    f"{_CT_LINEAR}:CompressedTensorsW4A4Fp4.process_weights_after_loading",
    f"{_CT_MOE}:select_nvfp4_moe_backend",
    f"{_CT_MOE}:CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading",
    f"{_CT_MOE}:CompressedTensorsW4A4Nvfp4MoEMethod.get_fused_moe_quant_config",
    f"{_ORACLE}:select_nvfp4_moe_backend",
    f"{_ORACLE}:make_nvfp4_moe_kernel",
    f"{_ORACLE}:NvFp4MoeBackend.EMULATION",
    f"{_RELOAD}:reload_weights",
    f"{_DAEMON}:WeightCacheDaemon.get_model",
)

_undo: list[Callable[[], None]] = []  # the patches, newest last
_env_undo: list[Callable[[], None]] = []  # the environment variables (kept while the plugin is inactive)
_warned: set[str] = set()  # one warning per reason and process


class IncompatibleVllm(Exception):
    """A name the plugin needs is missing from this vLLM, or is not what the plugin expects."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name = name


def disabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


def vllm_version_supported(version: str) -> bool:
    try:
        return tuple(int(p) for p in version.split(".")[:2]) == SUPPORTED_VLLM
    except ValueError:
        return False


def is_registered() -> bool:
    return bool(_undo)


def _warn_once(reason: str, msg: str, *args) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    from .log import logger

    logger.warning(msg, *args)


def register() -> None:
    """Entry point (``vllm.general_plugins``); safe to call any number of times, never raises into vLLM.

    Any error while patching undoes every patch made so far and leaves the plugin inactive with one warning:
    vLLM then runs exactly as without the plugin.
    """
    import vllm

    _register_env_vars()
    if disabled_by_env():
        if "off" not in _warned:
            _warned.add("off")
            from .log import logger

            logger.info("vllm-nvfp4-sm120 is off (%s=0): vLLM runs without it, and --linear-backend / "
                        "--moe-backend reject its nvfp4_sm120* names as invalid choices.", ENV_SWITCH)
        return
    if not vllm_version_supported(vllm.__version__):
        _warn_once(
            "version", "vllm-nvfp4-sm120 supports vLLM %d.%d.x only, found %s: the plugin is not active.",
            *SUPPORTED_VLLM, vllm.__version__,
        )
        return
    if is_registered():
        return
    try:
        check_vllm_names()
        _install_linear()
        _install_moe()
        _install_load_summary()
        _install_load_modes()
    except BaseException as exc:
        _undo_patches()
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: not ours to swallow
        name = str(exc) if isinstance(exc, IncompatibleVllm) else f"{type(exc).__name__}: {exc}"
        _warn_once(
            f"failed: {name}",
            "vllm-nvfp4-sm120 cannot hook into vLLM %s (%s); the plugin is not active and vLLM's own kernels "
            "serve every layer (its backend names are not accepted). A vllm-nvfp4-sm120 release for this vLLM "
            "fixes it; %s=0 silences this.",
            vllm.__version__, name, ENV_SWITCH,
        )
        return
    from . import linear
    from .log import logger
    from .moe import BACKEND_NAMES as MOE_NAMES

    logger.info(
        "vllm-nvfp4-sm120 active: NVFP4 layers on sm_12x use its kernels; --linear-backend also accepts %s, "
        "--moe-backend also accepts %s; %s=0 turns the plugin off (then those names are invalid choices).",
        "|".join(linear.BACKEND_NAMES), "|".join(MOE_NAMES), ENV_SWITCH,
    )


def unregister() -> None:
    """Undo every change :func:`register` made, newest first (tests; a process never needs it)."""
    _undo_patches()
    _run_undo(_env_undo)


def _run_undo(steps: list[Callable[[], None]]) -> None:
    """Run and drop ``steps`` newest first; a failing step does not stop the others (logged once)."""
    while steps:
        step = steps.pop()
        try:
            step()
        except Exception as exc:  # noqa: BLE001  (never raise into vLLM)
            _warn_once(f"undo: {exc}", "vllm-nvfp4-sm120: undoing a patch failed (%s: %s)", type(exc).__name__, exc)


def _undo_patches() -> None:
    _run_undo(_undo)


def resolve_vllm_name(name: str):
    """The object a :data:`VLLM_NAMES` entry names; :class:`IncompatibleVllm` naming it if it is missing."""
    module_name, _, attrs = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise IncompatibleVllm(name, f"cannot import {module_name} ({exc})") from exc
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise IncompatibleVllm(name, "not found")
        obj = getattr(obj, attr)
    return obj


def check_vllm_names() -> None:
    """Every name the plugin needs exists and has the kind the plugin expects (:class:`IncompatibleVllm` if not)."""
    from vllm.platforms import PlatformEnum

    from . import backend_names

    for name in VLLM_NAMES:
        obj = resolve_vllm_name(name)
        attr = name.rpartition(":")[2]
        if attr == "_POSSIBLE_NVFP4_KERNELS":
            if not (isinstance(obj, dict) and isinstance(obj.get(PlatformEnum.CUDA, []), list)):
                raise IncompatibleVllm(name, f"expected a dict of lists per platform, found {type(obj).__name__}")
        elif attr.endswith("Backend"):
            try:
                backend_names.literal_names(obj)
            except TypeError as exc:
                raise IncompatibleVllm(name, str(exc)) from exc
        elif attr not in ("WEIGHT", "NvFp4MoeBackend.EMULATION") and not callable(obj):
            raise IncompatibleVllm(name, f"expected a callable, found {type(obj).__name__}")


def _register_env_vars() -> None:
    """Add :data:`ENV_VARS` to vLLM's known variables (once; undone by :func:`unregister`)."""
    if _env_undo:
        return
    try:
        import vllm.envs as envs

        known = envs.environment_variables
        if not isinstance(known, dict):
            return
        for name in ENV_VARS:
            if name not in known:
                known[name] = functools.partial(os.environ.get, name)
                _env_undo.append(functools.partial(known.pop, name, None))
    except Exception as exc:  # noqa: BLE001  (a vLLM without the registry: the variables still work)
        _run_undo(_env_undo)
        _warn_once("envs", "vllm-nvfp4-sm120: could not register its environment variables with vLLM (%s: %s)",
                   type(exc).__name__, exc)


def _set(obj, name: str, value) -> None:
    """``obj.name = value`` (a module's or a class's own attribute), recorded for :func:`unregister`."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    _undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))


def _extend_backend_literal(spec, names) -> None:
    from . import backend_names

    undo = backend_names.extend_literal(spec, names)
    if undo is not None:
        _undo.append(undo)


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
    """Drop-in for vLLM's ``init_nvfp4_linear_kernel``: our names here, everything else to vLLM; vLLM's kernels
    when the weight-cache IPC loader skips our load step (:mod:`.load_modes`)."""
    from . import linear
    from .load_modes import log_weight_cache_refusal, weight_cache_mode

    kernel = _select_nvfp4_linear_kernel(use_a16)
    if isinstance(kernel, linear.KERNEL_CLASSES) and (mode := weight_cache_mode()) is not None:
        kernel = linear.fallback_kernel(use_a16, exclude=linear.KERNEL_CLASSES)
        log_weight_cache_refusal(f"NVFP4 {'W4A16' if use_a16 else 'W4A4'} linears", mode, type(kernel).__name__)
    return kernel


def _select_nvfp4_linear_kernel(use_a16: bool):
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


# ---- the end of a model's weight processing ------------------------------------------------------------------------

_LOADER_UTILS = "vllm.model_executor.model_loader.utils"


def _install_load_summary() -> None:
    """After vLLM's ``process_weights_after_loading(model, ...)`` (every loader ends a load with it): one summary
    line per per-layer warning (:func:`.log.summarize_layer_warnings`).  Optional: a vLLM without that function
    only loses the summary lines (each problem's first layer is still logged), so it is not in VLLM_NAMES."""
    from .log import summarize_layer_warnings

    utils = importlib.import_module(_LOADER_UTILS)
    original = getattr(utils, "process_weights_after_loading", None)
    if not callable(original):
        return

    @functools.wraps(original)
    def process_weights_after_loading(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            summarize_layer_warnings()

    for mod_name, mod in list(sys.modules.items()):
        imported = getattr(mod, "__dict__", {}).get("process_weights_after_loading")
        if mod_name.split(".")[0] == "vllm" and imported is original:
            _set(mod, "process_weights_after_loading", process_weights_after_loading)


# ---- load modes that skip our load step ------------------------------------------------------------------------------

def _install_load_modes() -> None:
    """Kernel-format reloads of our linears refused (where ``reload_weights`` is defined and imported by name); the
    weight cache daemon's load marked, so that its selection matches an ``--load-format ipc_cache`` engine's
    (vLLM's kernels)."""
    from .load_modes import loading_for_weight_cache, refuse_kernel_format_reload

    inplace = importlib.import_module(_RELOAD)
    original = inplace.reload_weights

    @functools.wraps(original)
    def reload_weights(vllm_config, model, weights_iterator, weights_path, is_checkpoint_format):
        if not is_checkpoint_format:
            refuse_kernel_format_reload(model)
        return original(vllm_config, model, weights_iterator, weights_path, is_checkpoint_format)

    for mod_name, mod in list(sys.modules.items()):
        imported = getattr(mod, "__dict__", {}).get("reload_weights")
        if mod_name.split(".")[0] == "vllm" and imported is original:
            _set(mod, "reload_weights", reload_weights)

    daemon = importlib.import_module(_DAEMON).WeightCacheDaemon
    get_model = daemon.get_model

    @functools.wraps(get_model)
    def daemon_get_model(self):
        with loading_for_weight_cache():
            return get_model(self)

    _set(daemon, "get_model", daemon_get_model)


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

    for fmt, module, method_cls in ((MODELOPT, modelopt, modelopt.ModelOptNvFp4FusedMoE),
                                    (COMPRESSED_TENSORS, ct, ct.CompressedTensorsW4A4Nvfp4MoEMethod)):
        # Another plugin may have replaced the selection first.  We chain to whatever is there: ours answers for
        # the layers our experts take and hands every other layer to it, so both plugins keep working (stepping
        # aside would silently drop our experts; raising would stop vLLM).  Which plugin wins a layer both want
        # depends on their load order, hence the warning.
        current = module.select_nvfp4_moe_backend
        if current is not oracle.select_nvfp4_moe_backend:
            _warn_once(
                f"chained: {module.__name__}",
                "vllm-nvfp4-sm120: %s.select_nvfp4_moe_backend was already replaced (by %s.%s, another plugin?); "
                "ours takes the NVFP4 MoE layers its experts serve and hands every other layer to it",
                module.__name__, getattr(current, "__module__", "?"), getattr(current, "__qualname__", current),
            )
        _set(module, "select_nvfp4_moe_backend", _moe_select(fmt, current))
        _set(method_cls, "process_weights_after_loading",
             _moe_process(fmt, module, method_cls.process_weights_after_loading))
        _set(method_cls, "get_fused_moe_quant_config", _moe_quant_config(method_cls.get_fused_moe_quant_config))


def _moe_select(fmt: str, original: Callable) -> Callable:
    from .load_modes import log_weight_cache_refusal, weight_cache_mode
    from .log import log_once
    from .moe import BACKEND_NAME, BACKEND_NAMES, Sm120NvFp4Experts

    @functools.wraps(original)
    def select_nvfp4_moe_backend(config, weight_key, activation_key):
        acts = "W4A16" if activation_key is None else "W4A4"
        why = Sm120NvFp4Experts.refusal(config, weight_key, activation_key)
        if why is None and (mode := weight_cache_mode()) is not None:
            log_weight_cache_refusal(f"NVFP4 MoE layers ({fmt} {acts})", mode, "automatic MoE backend choice")
            return vllm_choice(config, weight_key, activation_key)
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
        return vllm_choice(config, weight_key, activation_key)

    def vllm_choice(config, weight_key, activation_key):
        if config.moe_backend not in BACKEND_NAMES:
            return original(config, weight_key, activation_key)
        # vLLM does not know our name: run its automatic selection for this layer.
        saved, config.moe_backend = config.moe_backend, "auto"
        try:
            return original(config, weight_key, activation_key)
        finally:
            config.moe_backend = saved

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
