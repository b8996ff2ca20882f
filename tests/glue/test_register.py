"""The entry point: discovered by vLLM, re-entrant, off with VLLM_NVFP4_SM120=0, inert on another vLLM version,
and harmless when vLLM lacks a name it patches (one warning, nothing of ours left)."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import re
from pathlib import Path

import pytest
import vllm
import vllm.model_executor.kernels.linear as L
import vllm.plugins
import vllm.envs as envs
import vllm.model_executor.layers.fused_moe.oracle.nvfp4 as oracle
from vllm.config import set_current_vllm_config
from vllm.config.kernel import KernelConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    compressed_tensors_moe_w4a4_nvfp4 as ct_moe,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_nvfp4 as ct
from vllm.model_executor.model_loader import base_loader
from vllm.model_executor.model_loader import utils as loader_utils
from vllm.model_executor.model_loader.reload import inplace as reload_inplace
from vllm.model_executor.model_loader.weight_cache.daemon import WeightCacheDaemon
from vllm.platforms import PlatformEnum

import vllm_nvfp4_sm120
import vllm_nvfp4_sm120.vllm.register as plugin
from vllm_nvfp4_sm120.vllm import backend_names, linear, moe
from vllm_platform import vllm_config

MOE_METHODS = (modelopt.ModelOptNvFp4FusedMoE, ct_moe.CompressedTensorsW4A4Nvfp4MoEMethod)


def snapshot() -> dict:
    """Everything register() may touch, by identity."""
    return {
        "cuda_list": tuple(L._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]),
        "init": L.init_nvfp4_linear_kernel,
        "init_modelopt": modelopt.init_nvfp4_linear_kernel,
        "init_ct": ct.init_nvfp4_linear_kernel,
        "modelopt_process": modelopt.KNvfp4Static.process,
        "ct_process": ct.CompressedTensorsW4A4Fp4.process_weights_after_loading,
        "literal": backend_names.accepted_names(backend_names.LINEAR_BACKEND),
        "field": {f.name: f.type for f in dataclasses.fields(KernelConfig)}["linear_backend"],
        "moe_literal": backend_names.accepted_names(backend_names.MOE_BACKEND),
        "moe_field": {f.name: f.type for f in dataclasses.fields(KernelConfig)}["moe_backend"],
        "spec_moe_field": {f.name: f.type for f in dataclasses.fields(SpeculativeConfig)}["moe_backend"],
        "moe_select": (oracle.select_nvfp4_moe_backend, modelopt.select_nvfp4_moe_backend,
                       ct_moe.select_nvfp4_moe_backend),
        "moe_methods": tuple((vars(c).get("process_weights_after_loading"), vars(c).get("get_fused_moe_quant_config"))
                             for c in MOE_METHODS),
        "load_end": (loader_utils.process_weights_after_loading, base_loader.process_weights_after_loading),
        "load_modes": (reload_inplace.reload_weights, vars(WeightCacheDaemon)["get_model"]),
    }


@pytest.fixture
def pristine():
    """vLLM as it is without the plugin; the session's registration state is put back afterwards."""
    was, version = plugin.is_registered(), vllm.__version__
    plugin.unregister()
    state = snapshot()
    yield state
    plugin.unregister()
    if was:
        # This teardown runs before the test's monkeypatch undoes the switch or the faked version.
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(plugin.ENV_SWITCH, raising=False)
            mp.setattr(vllm, "__version__", version)
            plugin.register()
        assert plugin.is_registered()


def _ours_installed() -> bool:
    return L._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA][0] is linear.Sm120TritonNvFp4LinearKernel


def test_pristine_vllm_has_nothing_of_ours(pristine):
    assert not set(linear.KERNEL_CLASSES) & set(pristine["cuda_list"])
    assert not set(linear.BACKEND_NAMES) & set(pristine["literal"])
    assert not hasattr(pristine["init"], "__nvfp4_sm120_original__")


def test_entry_point_loaded_by_vllm(pristine, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert plugin.is_registered() and _ours_installed()
    assert set(linear.BACKEND_NAMES) <= set(backend_names.accepted_names(backend_names.LINEAR_BACKEND))


def test_register_twice_changes_nothing(pristine):
    plugin.register()
    first = snapshot()
    assert first != pristine
    plugin.register()
    second = snapshot()
    assert second.keys() == first.keys()
    for key in first:
        assert second[key] is first[key] or second[key] == first[key], key
    assert first["cuda_list"][: len(linear.KERNEL_CLASSES)] == linear.KERNEL_CLASSES
    assert first["cuda_list"][len(linear.KERNEL_CLASSES):] == pristine["cuda_list"]


def test_unregister_restores_vllm(pristine):
    plugin.register()
    plugin.unregister()
    after = snapshot()
    for key in pristine:
        assert after[key] == pristine[key], key
    with pytest.raises(Exception, match="linear_backend"):
        KernelConfig(linear_backend="nvfp4_sm120")


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_disabled_by_env(pristine, monkeypatch, value):
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    plugin.register()
    assert not plugin.is_registered()
    assert snapshot() == pristine


@pytest.mark.parametrize("version", ["0.34.0", "0.32.1", "1.33.0", "dev"])
def test_other_vllm_version_leaves_vllm_untouched(pristine, monkeypatch, plugin_log, version):
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setattr(plugin, "_warned", set())
    plugin.register()
    plugin.register()
    assert not plugin.is_registered()
    assert snapshot() == pristine
    warnings = [r for r in plugin_log.records if "supports vLLM 0.33" in r.getMessage()]
    assert len(warnings) == 1 and version in warnings[0].getMessage()


def test_supported_versions():
    assert plugin.vllm_version_supported("0.33.0") and plugin.vllm_version_supported("0.33.2rc1.dev3")
    assert plugin.vllm_version_supported(vllm.__version__)


# ---- a vLLM that lacks (or changed) a name the plugin patches ------------------------------------------------------

def _take_away(mp: pytest.MonkeyPatch, name: str) -> None:
    """``name`` (a ``register.VLLM_NAMES`` entry) missing from vLLM, as a release that renamed it would be."""
    module_name, _, attrs = name.partition(":")
    *path, last = attrs.split(".")
    obj = importlib.import_module(module_name)
    for a in path:
        obj = getattr(obj, a)
    if isinstance(obj, enum.EnumMeta):  # an enum member cannot be deleted: the enum without it
        parent = importlib.import_module(module_name)
        mp.setattr(parent, path[-1], enum.Enum(path[-1], [m for m in obj.__members__ if m != last]))
        return
    for owner in getattr(obj, "__mro__", (obj,)):  # wherever the class hierarchy defines it
        if last in vars(owner):
            mp.delattr(owner, last)


def _vllm_selection_is_vllms() -> None:
    """vLLM as without the plugin: its own linear kernel on a faked sm_120, our names rejected."""
    assert not hasattr(L.init_nvfp4_linear_kernel, linear.ORIGINAL_INIT_ATTR)
    with pytest.MonkeyPatch.context() as mp:
        from vllm_platform import fake_cuda

        fake_cuda(mp, (12, 0))
        with set_current_vllm_config(vllm_config()):
            kernel = L.init_nvfp4_linear_kernel(False)
    assert not isinstance(kernel, linear.Sm120NvFp4LinearKernel)
    for field in ("linear_backend", "moe_backend"):
        with pytest.raises(Exception, match=field):
            KernelConfig(**{field: "nvfp4_sm120"})


def _inactive_warnings(plugin_log) -> list[str]:
    return [r.getMessage() for r in plugin_log.records
            if r.levelno == logging.WARNING and "cannot hook into vLLM" in r.getMessage()]


@pytest.mark.parametrize("name", plugin.VLLM_NAMES)
def test_missing_vllm_name_leaves_vllm_untouched(pristine, monkeypatch, plugin_log, name):
    monkeypatch.setattr(plugin, "_warned", set())
    with pytest.MonkeyPatch.context() as mp:
        _take_away(mp, name)
        plugin.register()  # must not raise
        plugin.register()
        assert not plugin.is_registered()
    assert snapshot() == pristine
    [warning] = _inactive_warnings(plugin_log)
    assert vllm.__version__ in warning and name in warning and plugin.ENV_SWITCH in warning
    _vllm_selection_is_vllms()


@pytest.mark.parametrize("name, value", [
    ("vllm.config.kernel:LinearBackend", str),  # no longer a Literal
    ("vllm.config.kernel:MoEBackend", "auto"),
    ("vllm.model_executor.kernels.linear:_POSSIBLE_NVFP4_KERNELS", []),  # no longer a dict per platform
    ("vllm.model_executor.kernels.linear:_get_linear_backend", None),
])
def test_changed_vllm_name_leaves_vllm_untouched(pristine, monkeypatch, plugin_log, name, value):
    monkeypatch.setattr(plugin, "_warned", set())
    module_name, _, attr = name.partition(":")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.import_module(module_name), attr, value)
        plugin.register()
        assert not plugin.is_registered()
    assert snapshot() == pristine
    [warning] = _inactive_warnings(plugin_log)
    assert name in warning
    _vllm_selection_is_vllms()


def test_error_midway_undoes_every_patch(pristine, monkeypatch, plugin_log):
    """The linear patches are in place when the MoE ones fail: all of them are undone."""
    monkeypatch.setattr(plugin, "_warned", set())

    def broken():
        assert plugin.is_registered(), "the linear patches are installed first"
        raise RuntimeError("MoE patch failed")

    monkeypatch.setattr(plugin, "_install_moe", broken)
    plugin.register()
    assert not plugin.is_registered()
    assert snapshot() == pristine
    [warning] = _inactive_warnings(plugin_log)
    assert "RuntimeError: MoE patch failed" in warning
    monkeypatch.undo()
    _vllm_selection_is_vllms()


def test_register_unregister_register_is_symmetric(pristine):
    plugin.register()
    first = snapshot()
    plugin.unregister()
    assert snapshot() == pristine
    plugin.register()
    again = snapshot()
    for key in first:
        assert again[key] == first[key] or key in ("init", "init_modelopt", "init_ct", "modelopt_process",
                                                   "ct_process", "moe_select", "moe_methods", "load_end",
                                                   "load_modes"), key
    assert KernelConfig(linear_backend="nvfp4_sm120").linear_backend == "nvfp4_sm120"
    assert KernelConfig(moe_backend="nvfp4_sm120").moe_backend == "nvfp4_sm120"
    plugin.unregister()
    assert snapshot() == pristine


def test_another_plugins_moe_selection_is_chained(pristine, monkeypatch, plugin_log):
    """A selection another plugin installed first keeps answering for every layer our experts do not take."""
    monkeypatch.setattr(plugin, "_warned", set())
    calls = []

    def theirs(config, weight_key, activation_key):
        calls.append(config.moe_backend)
        return "their backend", None

    with pytest.MonkeyPatch.context() as mp:  # undone here, not after the fixture's re-registration
        mp.setattr(modelopt, "select_nvfp4_moe_backend", theirs)
        plugin.register()
        assert plugin.is_registered()
        chained = [r.getMessage() for r in plugin_log.records if "already replaced" in r.getMessage()]
        assert len(chained) == 1 and "modelopt" in chained[0]

        class Config:
            moe_backend = "cutlass"  # names another backend: our experts decline

        assert modelopt.select_nvfp4_moe_backend(Config(), None, None) == ("their backend", None)
        assert calls == ["cutlass"]
        plugin.unregister()
        assert modelopt.select_nvfp4_moe_backend is theirs


# ---- what vLLM knows of the plugin ---------------------------------------------------------------------------------

def test_env_vars_known_to_vllm(pristine, monkeypatch):
    plugin.register()
    assert set(plugin.ENV_VARS) <= set(envs.environment_variables)
    monkeypatch.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
    assert envs.VLLM_NVFP4_SM120_DISABLE_GLUON == "1"
    # vLLM's torch.compile cache key hashes every registered variable outside its own ignore list
    assert envs.compile_factors()["VLLM_NVFP4_SM120_DISABLE_GLUON"] == "1"
    plugin.unregister()
    assert not set(plugin.ENV_VARS) & set(envs.environment_variables)


def test_env_vars_known_while_plugin_off(pristine, monkeypatch):
    """``VLLM_NVFP4_SM120=0`` must not trip vLLM's unknown-variable check (an error with
    ``--fail-on-environ-validation``)."""
    from vllm.platforms.interface import Platform

    monkeypatch.setenv(plugin.ENV_SWITCH, "0")
    plugin.register()
    assert not plugin.is_registered()
    Platform.validate_environ(hard_fail=True)
    assert envs.compile_factors()[plugin.ENV_SWITCH] == "0"


def test_every_env_var_of_the_package_is_registered():
    root = Path(vllm_nvfp4_sm120.__file__).parent
    used = {m for f in root.rglob("*.py") for m in re.findall(r"\bVLLM_NVFP4_SM120\w*", f.read_text())}
    assert used == set(plugin.ENV_VARS), "list new variables in register.ENV_VARS"


def test_class_names_unique_against_vllm():
    """``VLLM_DISABLED_KERNELS`` and vLLM's logs name kernels by class name: ours must not be any of vLLM's."""
    root = Path(vllm.__file__).parent
    vllm_classes = {m for f in root.rglob("*.py")
                    for m in re.findall(r"^\s*class\s+(\w+)", f.read_text(errors="replace"), re.M)}
    assert len(vllm_classes) > 1000 and "B12xNvFp4LinearKernel" in vllm_classes
    ours = {c.__name__ for c in (*linear.KERNEL_CLASSES, linear.Sm120NvFp4LinearKernel, moe.Sm120NvFp4Experts)}
    assert not ours & vllm_classes
