"""The entry point: discovered by vLLM, re-entrant, off with VLLM_NVFP4_SM120=0, inert on another vLLM version."""

from __future__ import annotations

import dataclasses

import pytest
import vllm
import vllm.model_executor.kernels.linear as L
import vllm.plugins
from vllm.config.kernel import KernelConfig
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_nvfp4 as ct
from vllm.platforms import PlatformEnum

import vllm_nvfp4_sm120.vllm.register as plugin
from vllm_nvfp4_sm120.vllm import backend_names, linear


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
    return L._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA][0] is linear.TritonNvFp4LinearKernel


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
    monkeypatch.setattr(plugin, "_warned_version", False)
    plugin.register()
    plugin.register()
    assert not plugin.is_registered()
    assert snapshot() == pristine
    warnings = [r for r in plugin_log.records if "supports vLLM 0.33" in r.getMessage()]
    assert len(warnings) == 1 and version in warnings[0].getMessage()


def test_supported_versions():
    assert plugin.vllm_version_supported("0.33.0") and plugin.vllm_version_supported("0.33.2rc1.dev3")
    assert plugin.vllm_version_supported(vllm.__version__)
