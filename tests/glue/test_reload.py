"""Reloading weights in place (RL weight sync: vLLM's layerwise reload) into layers on our kernels.

vLLM's ``reload_weights(is_checkpoint_format=True)`` puts each layer back on its created (checkpoint) shapes, runs
the weight loaders again, then ``process_weights_after_loading``, and copies the processed tensors into the ones
the layer held (CUDA graphs keep their pointers).  The routes that replace the weight at load (b12x padding) or
keep load-time copies (per-row globals, swizzled scales) must then compute what a fresh load of the new weights
computes.
"""

from __future__ import annotations

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
from vllm_nvfp4_sm120.vllm import linear as ours
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
