"""Checkpoint configs and vLLM linear layers built the way a model builds them (create_weights, then loading).

Shapes are those of one tensor-parallel shard: K = 272 (17 scale blocks: the 128x4 swizzle pads the columns),
fused parts q/k/v = 96/32/32 and gate/up = 80/80 (N not a multiple of 128 or 32).
"""

from __future__ import annotations

import copy

import torch
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

from vllm_nvfp4_sm120.format import GlobalScale, LinearProblem, make_linear
from vllm_nvfp4_sm120.tiny_checkpoint import compressed_tensors_quant_config

HIDDEN = 272
QKV = dict(head_size=32, total_num_heads=3, total_num_kv_heads=1)  # q 96, k 32, v 32
INTERMEDIATE = 80

# hf_quant_config.json of a ModelOpt NVFP4 export (W4A4) and its weight-only variant
MODELOPT_HF_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                     "exclude_modules": ["lm_head"]},
}
MODELOPT_W4A16_HF_QUANT_CONFIG = copy.deepcopy(MODELOPT_HF_QUANT_CONFIG)
MODELOPT_W4A16_HF_QUANT_CONFIG["quantization"]["quant_algo"] = "W4A16_NVFP4"

# config.json "quantization_config" of an llm-compressor NVFP4 export (W4A4: dynamic local activations), the same
# dicts the tiny example checkpoints are written with.
CT_QUANTIZATION_CONFIG = compressed_tensors_quant_config()
CT_W4A16_QUANTIZATION_CONFIG = compressed_tensors_quant_config(w4a16=True)

CONFIGS = {
    ("modelopt", "w4a4"): MODELOPT_HF_QUANT_CONFIG,
    ("modelopt", "w4a16"): MODELOPT_W4A16_HF_QUANT_CONFIG,
    ("ct", "w4a4"): CT_QUANTIZATION_CONFIG,
    ("ct", "w4a16"): CT_W4A16_QUANTIZATION_CONFIG,
}


def quant_config(fmt: str, act: str):
    cls = ModelOptNvFp4Config if fmt == "modelopt" else CompressedTensorsConfig
    return cls.from_config(copy.deepcopy(CONFIGS[(fmt, act)]))


def build_layer(cfg, kind: str, layer_idx: int = 0) -> torch.nn.Module:
    """A parallel linear of ``kind`` (qkv, gate_up, down) with ``cfg``: vLLM runs create_weights and picks the kernel."""
    p = f"model.layers.{layer_idx}"
    common = dict(bias=False, quant_config=cfg, params_dtype=torch.bfloat16)
    if kind == "qkv":
        return QKVParallelLinear(HIDDEN, **QKV, prefix=f"{p}.self_attn.qkv_proj", **common)
    if kind == "gate_up":
        return MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, prefix=f"{p}.mlp.gate_up_proj", **common)
    if kind == "down":
        return RowParallelLinear(INTERMEDIATE, HIDDEN, prefix=f"{p}.mlp.down_proj", **common)
    raise ValueError(kind)


def kernel_of(layer: torch.nn.Module):
    qm = layer.quant_method
    return qm.kernel if hasattr(qm, "kernel") else layer.scheme.kernel


def problem_for(layer: torch.nn.Module, gen: torch.Generator) -> LinearProblem:
    n, k = layer.weight_scale.shape[0], layer.weight_scale.shape[1] * 16
    return make_linear(n, k, gen=gen, logical_widths=layer.logical_widths)


def load_checkpoint(layer: torch.nn.Module, fmt: str, prob: LinearProblem, *, part_decs: list[float] | None = None) -> None:
    """Write a checkpoint's tensors into the layer's parameters (what the weight loaders end with).

    ``part_decs`` overrides the per-part weight decode globals (to set a chosen spread between parts).
    """
    decs = torch.stack([g.dec for g in prob.part_globals]) if part_decs is None else torch.tensor(part_decs)
    codes_name = "weight" if fmt == "modelopt" else "weight_packed"
    getattr(layer, codes_name).data.copy_(prob.codes)
    layer.weight_scale.data.copy_(prob.scales)
    if fmt == "modelopt":
        layer.weight_scale_2.data.copy_(decs)
        if hasattr(layer, "input_scale"):
            layer.input_scale.data.fill_(float(prob.input_gs.dec))
    else:
        layer.weight_global_scale.data.copy_(1.0 / decs)
        if hasattr(layer, "input_global_scale"):
            layer.input_global_scale.data.fill_(float(prob.input_gs.enc))


def part_decodes(prob: LinearProblem) -> torch.Tensor:
    return torch.stack([g.dec for g in prob.part_globals])


def input_gs(layer: torch.nn.Module) -> GlobalScale:
    return GlobalScale.from_encode(layer.input_global_scale_inv)


def guard_moe_on_cpu(mp, gate_up_factor: float = 1.0) -> None:
    """The MoE guard's plans on CPU (``mp``: a pytest MonkeyPatch): T <= 16 in fp16 (the interpreter's bf16 dot is
    wrong, and the guard rightly fails every plan in bf16 there), the W4A16 plans given the GPU's inline-PTX decode,
    whose gate_up launcher then returns its result times ``gate_up_factor`` (1.0: right; else a planted bug)."""
    from dataclasses import replace

    from vllm_nvfp4_sm120.dispatch import guard as G
    from vllm_nvfp4_sm120.dispatch import moe as M
    from vllm_nvfp4_sm120.dispatch import registry
    from vllm_nvfp4_sm120.dispatch.moe import Impl, MoeKernel

    real = G.guard_moe
    mp.setattr(G, "guard_moe", lambda **kw: real(**{**kw, "max_t": 16, "dtype": torch.float16}))
    table = M.table_moe_plan
    mp.setattr(M, "table_moe_plan", lambda cap, **kw: (
        lambda p: replace(p, fast_decode=True) if p.kernel == MoeKernel.W4A16 else p)(table(cap, **kw)))
    gate_up, down = registry.MOE_KERNELS[MoeKernel.W4A16, Impl.TRITON]
    mp.setitem(registry.MOE_KERNELS, (MoeKernel.W4A16, Impl.TRITON), (
        lambda *a, fast_decode=False, **kw: gate_up(*a, fast_decode=False, **kw) * (gate_up_factor if fast_decode
                                                                                     else 1.0),
        lambda *a, fast_decode=False, **kw: down(*a, fast_decode=False, **kw)))
