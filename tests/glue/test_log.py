"""Per-layer load warnings, once per model: the first layer in full, then one summary line (count, worst layer)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader import utils as loader_utils

import nvfp4_layers as NL
import vllm_nvfp4_sm120.vllm.log as glue_log
from vllm_platform import vllm_config

pytestmark = pytest.mark.usefixtures("registered", "tp_group")

SPREADS = [0.06, 0.10, 0.08, 0.0]  # the fused parts' weight global spread per layer (warns above 5 %)
# what vLLM's process_weights_after_loading reads of the model config for a model without attention or lm_head
MODEL_CONFIG = types.SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization="modelopt",
                                     dtype=torch.bfloat16)


def our_warnings(plugin_log) -> list[str]:
    return [r.getMessage() for r in plugin_log.records
            if r.levelno == logging.WARNING and r.name == glue_log.logger.name]


def end_of_load() -> None:
    """What every vLLM model loader ends a load with (the plugin adds the summary after it)."""
    loader_utils.process_weights_after_loading(torch.nn.Module(), MODEL_CONFIG, torch.device("cpu"))


def test_spread_warning_once_per_model(fake_platform, plugin_log, monkeypatch):
    monkeypatch.setattr(glue_log, "_tallies", {})
    fake_platform((12, 0))
    config = vllm_config()
    with set_current_vllm_config(config):
        for i, spread in enumerate(SPREADS):
            layer = NL.build_layer(NL.quant_config("modelopt", "w4a4"), "gate_up", layer_idx=i)
            prob = NL.problem_for(layer, torch.Generator().manual_seed(i))
            NL.load_checkpoint(layer, "modelopt", prob, part_decs=[1e-4, 1e-4 * (1 + spread)])
            layer.quant_method.process_weights_after_loading(layer)
        end_of_load()
    warnings = our_warnings(plugin_log)
    assert len(warnings) == 2, warnings
    first, summary = warnings
    assert "model.layers.0.mlp.gate_up_proj" in first and "6.0%" in first
    assert "in 3 layers" in summary and "model.layers.1.mlp.gate_up_proj (10.0%)" in summary
    end_of_load()  # the next model counts afresh
    assert len(our_warnings(plugin_log)) == 2


def test_single_layer_gets_no_summary(plugin_log, monkeypatch):
    monkeypatch.setattr(glue_log, "_tallies", {})
    glue_log.warn_layer("a problem", "layer.a", 1.0, "1", "layer %s has a problem", "layer.a")
    glue_log.summarize_layer_warnings()
    assert our_warnings(plugin_log) == [
        "layer layer.a has a problem (other layers with this: one summary line once the model is loaded)"]
