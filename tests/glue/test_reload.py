"""Reloading weights in place (RL weight sync: vLLM's layerwise reload) into layers on our kernels.

vLLM's ``reload_weights(is_checkpoint_format=True)`` puts each layer back on its created (checkpoint) shapes, runs
the weight loaders again, then ``process_weights_after_loading``, and copies the processed tensors into the ones
the layer held (CUDA graphs keep their pointers).  The routes that replace the weight at load (b12x padding) or
keep load-time copies (per-row globals, swizzled scales) must then compute what a fresh load of the new weights
computes.

Two modes skip that step and are refused (``vllm/load_modes.py``): a kernel-format reload
(``is_checkpoint_format=False`` copies parameters only, leaving our derived buffers stale) raises before it touches
a tensor, and the weight-cache IPC loader (``--load-format ipc_cache`` and its ``vllm preload`` daemon) gets vLLM's
kernels at selection.
"""

from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
)

import fp4_routes_stub
import nvfp4_layers as NL
import vllm_nvfp4_sm120.vllm.log as glue_log_state
from vllm_nvfp4_sm120.vllm import linear as ours
from vllm_nvfp4_sm120.vllm import load_modes
from vllm_platform import fake_cuda, vllm_config

pytestmark = pytest.mark.usefixtures("registered", "tp_group")

# (format, activation, layer kind, --linear-backend)
CASES = [
    ("modelopt", "w4a4", "qkv", "auto"),
    ("ct", "w4a4", "gate_up", "auto"),
    ("modelopt", "w4a4", "qkv", "nvfp4_sm120_cublas"),
    ("modelopt", "w4a4", "gate_up", "nvfp4_sm120_b12x"),
    ("modelopt", "w4a16", "gate_up", "nvfp4_sm120"),
    ("ct", "w4a16", "qkv", "nvfp4_sm120_w4a16"),
]
SHARDS = {"qkv": ["q", "k", "v"], "gate_up": [0, 1], "down": [None]}


def load_through_loaders(layer, fmt: str, kind: str, prob) -> None:
    """The checkpoint's per-part tensors through each parameter's weight loader, as ``model.load_weights`` does."""
    names = (("weight", "weight_scale", "weight_scale_2", "input_scale") if fmt == "modelopt"
             else ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"))
    codes, scales, glob, act = names
    row = 0
    for shard, width, part in zip(SHARDS[kind], layer.logical_widths, prob.part_globals):
        per_part = {
            codes: prob.codes[row:row + width],
            scales: prob.scales[row:row + width],
            glob: (part.dec if fmt == "modelopt" else part.enc).reshape(()),
            act: prob.input_gs.dec.reshape(()) if fmt == "modelopt" else prob.input_gs.enc.reshape(()),
        }
        for name, tensor in per_part.items():
            param = getattr(layer, name, None)
            if param is None:
                continue  # W4A16: no activation scale
            args = (param, tensor.clone()) if shard is None else (param, tensor.clone(), shard)
            param.weight_loader(*args)
        row += width


def build_loaded(fmt, act, kind, prob_seed):
    layer = NL.build_layer(NL.quant_config(fmt, act), kind)
    record_metadata_for_reloading(layer)  # vLLM records this when it creates the model
    prob = NL.problem_for(layer, torch.Generator().manual_seed(prob_seed))
    load_through_loaders(layer, fmt, kind, prob)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_reload_matches_fresh_load(case):
    fmt, act, kind, backend = case
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, (12, 0))
        fp4_routes_stub.install(mp)
        config = vllm_config(linear_backend=backend)
        with set_current_vllm_config(config):
            layer = build_loaded(fmt, act, kind, prob_seed=1)
            fresh = build_loaded(fmt, act, kind, prob_seed=2)
            kernel = NL.kernel_of(layer)
            assert isinstance(kernel, ours.Sm120NvFp4LinearKernel) and kernel._fallback is None
            held = {name: t.data_ptr() for name, t in [*layer.named_parameters(), *layer.named_buffers()]}

            initialize_layerwise_reload(layer)
            prob = NL.problem_for(layer, torch.Generator().manual_seed(2))
            load_through_loaders(layer, fmt, kind, prob)
            finalize_layerwise_reload(layer, config.model_config)

    now = {name: t.data_ptr() for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
    assert now == held, "reloading keeps every tensor the layer held (CUDA graphs point at them)"
    for name, t in [*fresh.named_parameters(), *fresh.named_buffers()]:
        torch.testing.assert_close(getattr(layer, name), t, rtol=0, atol=0, msg=name)
    k = NL.HIDDEN if kind != "down" else NL.INTERMEDIATE
    for t in (3, 40):  # the W4A16 kernel at decode sizes, the route's prefill GEMM above
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        torch.testing.assert_close(NL.kernel_of(layer).apply_weights(layer, x),
                                   NL.kernel_of(fresh).apply_weights(fresh, x), rtol=0, atol=0)


# ---- refused modes -------------------------------------------------------------------------------------------------

# What a kernel-format reload from a weights iterator reads of the config (no loader, no LoRA).
KERNEL_FORMAT_CONFIG = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization="modelopt_fp4"),
                                             load_config=None, lora_config=None)


@pytest.fixture
def glue_log(plugin_log, monkeypatch):
    monkeypatch.setattr(glue_log_state, "_logged", set())  # every test sees its own once-per-choice lines
    return plugin_log


@contextlib.contextmanager
def _loaded_and_fresh(backend: str):
    """On a faked sm_120 with ``--linear-backend backend``: ``(config, layer, fresh)``, a loaded ModelOpt W4A4 gate_up
    layer and one loaded from other weights (what a reload would bring)."""
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, (12, 0))
        fp4_routes_stub.install(mp)
        config = vllm_config(linear_backend=backend)
        with set_current_vllm_config(config):
            yield (config, build_loaded("modelopt", "w4a4", "gate_up", prob_seed=1),
                   build_loaded("modelopt", "w4a4", "gate_up", prob_seed=2))


@pytest.mark.parametrize("backend", ["auto", "nvfp4_sm120_b12x", "nvfp4_sm120_w4a16"])
def test_kernel_format_reload_refused_before_touching_a_tensor(backend, glue_log):
    import vllm.model_executor.model_loader.reload.inplace as inplace

    with _loaded_and_fresh(backend) as (config, layer, fresh):
        route = NL.kernel_of(layer).route
        before = {name: t.clone() for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
        weights = iter([(name, t.data) for name, t in fresh.named_parameters()])
        with pytest.raises(ValueError, match=rf"is_checkpoint_format=False\) cannot update layer "
                                             rf"{layer.prefix} \(linear route {route} "):
            inplace.reload_weights(config, layer, weights, None, is_checkpoint_format=False)
    assert next(weights, None) is not None, "refused before reading the weights"
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        torch.testing.assert_close(t, before[name], rtol=0, atol=0, msg=name)
    errors = [r.getMessage() for r in glue_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "Reload in checkpoint format (is_checkpoint_format=True)" in errors[0], errors


@pytest.mark.parametrize("backend", ["auto", "nvfp4_sm120_w4a16"])
def test_why_kernel_format_reload_is_refused(backend):
    """What vLLM's kernel-format reload would do without the refusal: the parameters are new, the per-row globals
    the route derived at load are the old weights' (so the refusal stays needed while this holds)."""
    import vllm.model_executor.model_loader.reload.inplace as inplace

    with _loaded_and_fresh(backend) as (config, layer, fresh):
        old_rows = getattr(layer, ours._W_DEC_ROWS).clone()
        weights = [(name, t.data) for name, t in fresh.named_parameters()]
        inplace.reload_weights.__wrapped__(KERNEL_FORMAT_CONFIG, layer, iter(weights), None,
                                           is_checkpoint_format=False)
    for name, t in fresh.named_parameters():
        torch.testing.assert_close(getattr(layer, name), t, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(getattr(layer, ours._W_DEC_ROWS), old_rows, rtol=0, atol=0)
    assert not torch.equal(getattr(layer, ours._W_DEC_ROWS), getattr(fresh, ours._W_DEC_ROWS))


def test_kernel_format_reload_of_other_layers_reaches_vllm():
    """Only layers on our kernels are refused: vLLM copies the kernel-format tensors into anything else."""
    import vllm.model_executor.model_loader.reload.inplace as inplace

    assert inplace.reload_weights.__wrapped__ is not inplace.reload_weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    new = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        inplace.reload_weights(KERNEL_FORMAT_CONFIG, model, iter([("0.weight", new)]), None, is_checkpoint_format=False)
    torch.testing.assert_close(model[0].weight.data, new, rtol=0, atol=0)


@pytest.mark.parametrize("side", ["engine", "daemon"])
@pytest.mark.parametrize("backend", ["auto", "nvfp4_sm120_b12x", "nvfp4_sm120_flashinfer_w4a16"])
def test_weight_cache_ipc_load_uses_vllm_kernels(backend, side, glue_log):
    """Both sides of the IPC loader pick vLLM's kernel, so the daemon exports the layout the engine's kernel reads."""
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, (12, 0))
        fp4_routes_stub.install(mp)
        config = vllm_config(linear_backend=backend)
        if side == "engine":
            config.load_config.load_format = load_modes.IPC_LOAD_FORMAT
        marked = load_modes.loading_for_weight_cache() if side == "daemon" else contextlib.nullcontext()
        with set_current_vllm_config(config), marked:
            kernels = [NL.kernel_of(NL.build_layer(NL.quant_config("modelopt", "w4a4"), kind))
                       for kind in ("qkv", "gate_up")]
    assert not any(isinstance(k, ours.KERNEL_CLASSES) for k in kernels), kernels
    mode = "--load-format ipc_cache" if side == "engine" else "the weight cache daemon (vllm preload)"
    warnings = [r.getMessage() for r in glue_log.records
                if r.levelno == logging.WARNING and "weight-cache IPC loader" in r.getMessage()]
    assert warnings == [f"nvfp4_sm120: NVFP4 W4A4 linears: the weight-cache IPC loader ({mode}) maps pre-processed "
                        f"weights without the load step our kernels need; these layers use vLLM's "
                        f"{type(kernels[0]).__name__} instead"]


def test_ordinary_load_keeps_our_kernels():
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, (12, 0))
        with set_current_vllm_config(vllm_config(linear_backend="auto")):
            kernel = NL.kernel_of(NL.build_layer(NL.quant_config("modelopt", "w4a4"), "qkv"))
    assert isinstance(kernel, ours.KERNEL_CLASSES)


def test_weight_cache_daemon_marks_its_load():
    """The daemon builds and loads its model inside ``WeightCacheDaemon.get_model``; the mark ends with it."""
    from vllm.model_executor.model_loader.weight_cache.daemon import WeightCacheDaemon

    seen = []

    class Stop(Exception):
        pass

    class Probe:  # what get_model reads first
        @property
        def vllm_config(self):
            seen.append(load_modes.weight_cache_mode())
            raise Stop

    with pytest.raises(Stop):
        WeightCacheDaemon.get_model(Probe())
    assert seen == ["the weight cache daemon (vllm preload)"]
    assert load_modes.weight_cache_mode() is None
