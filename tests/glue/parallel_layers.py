"""Layers of one tiny checkpoint built, loaded and run through vLLM's parallel classes in the current TP group.

The functions named ``task_*`` run on every spawned rank (``parallel_harness.Ranks.run``) *and*, for the one-rank
reference, in the test process (its one-process gloo group): the same code builds the layer with vLLM's own class
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``, ``FusedMoEFactory``) under a faked
sm_120 GPU, so vLLM's NVFP4 schemes select the plugin's kernels; loads the *full* checkpoint's tensors through the
layer's ``weight_loader`` (each rank's loader takes its shard, as in a real model load); runs vLLM's weight
processing; then runs the layer's forward on CPU tensors (the plugin's ops compute the torch reference of the plan
an sm_120 GPU would run) and returns what vLLM's collectives produce: the all-gathered output of column-parallel
layers, the all-reduced output of row-parallel layers and MoE, and each rank's own partial (for the tolerance).

The checkpoint is :func:`vllm_nvfp4_sm120.tiny_checkpoint.write_tiny_checkpoint`'s (HF names of a Qwen3-MoE).  Its
layers have no dense MLP, so the dense gate_up / down cases use expert 0's ``gate_proj`` / ``up_proj`` /
``down_proj`` tensors (NVFP4 linears like any other, with their own per-part globals).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import vllm_platform
from parallel_harness import rank_and_world

import nvfp4_layers as NL

from vllm_nvfp4_sm120.format import topk_route
from vllm_nvfp4_sm120.tiny_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    SAFETENSORS_FILE,
    TinyShape,
    write_tiny_checkpoint,
)

CHECKPOINT_FORMAT = {"modelopt": MODELOPT, "ct": COMPRESSED_TENSORS}
LAYER = "model.layers.0"
SM120 = (12, 0)


@dataclass(frozen=True)
class Case:
    """One layer of the checkpoint and how vLLM is asked to run it."""

    kind: str  # "qkv" | "o" | "mlp" (gate_up then down) | "moe"
    fmt: str = "modelopt"  # "modelopt" | "ct"
    act: str = "w4a4"  # "w4a4" | "w4a16"
    linear_backend: str = "auto"
    moe_backend: str = "auto"
    ep: bool = False  # --enable-expert-parallel (MoE)


# ---- the checkpoint -----------------------------------------------------------------------------------------------

def write_checkpoint(out_dir: Path, fmt: str, act: str, shape: TinyShape, *, shared_fused_globals: bool) -> Path:
    """The tiny checkpoint in ``fmt`` (W4A4 or W4A16); fused parts with their own globals unless shared."""
    return write_tiny_checkpoint(out_dir, CHECKPOINT_FORMAT[fmt], w4a16=act == "w4a16",
                                 shared_fused_globals=shared_fused_globals, shape=shape, tokenizer=False)


def read_checkpoint(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt_dir) / SAFETENSORS_FILE))


def read_shape(ckpt_dir: str | Path) -> TinyShape:
    import json

    return TinyShape(**json.loads((Path(ckpt_dir) / "tiny_checkpoint.json").read_text())["shape"])


# ---- vLLM config and platform -------------------------------------------------------------------------------------

def vllm_config_for(case: Case):
    from vllm.config import DeviceConfig, KernelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kernel_config=KernelConfig(linear_backend=case.linear_backend, moe_backend=case.moe_backend),
        parallel_config=ParallelConfig(enable_expert_parallel=case.ep),
    )


def _fresh_log_state(mp: pytest.MonkeyPatch) -> None:
    """Every task sees its own once-per-choice log lines (a rank serves many tasks)."""
    import vllm_nvfp4_sm120.vllm.log as glue_log

    mp.setattr(glue_log, "_logged", set())


# ---- loading through the layers' weight loaders -------------------------------------------------------------------

# Model-side module → checkpoint modules and the shard ids vLLM's stacked-parameter mapping gives them (Qwen3).
_LINEAR_SOURCES = {
    "qkv": [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")],
    "o": [("self_attn.o_proj", None)],
    "gate_up": [("mlp.experts.0.gate_proj", 0), ("mlp.experts.0.up_proj", 1)],
    "down": [("mlp.experts.0.down_proj", None)],
}


# Parameters a W4A16 layer registers that its checkpoint does not have (vLLM keeps them so that legacy exports with
# input scales load; they are unused and dropped at processing).
W4A16_UNLOADED = {"input_scale", "input_global_scale", "w13_input_scale", "w2_input_scale", "w13_input_global_scale",
                  "w2_input_global_scale"}


def _check_loaded(what: str, params: dict, loaded: set, act: str) -> None:
    missing = set(params) - loaded - (W4A16_UNLOADED if act == "w4a16" else set())
    assert not missing, f"{what}: parameters not in the checkpoint: {sorted(missing)}"


def load_linear(layer: torch.nn.Module, which: str, ckpt: dict[str, torch.Tensor], act: str) -> None:
    """Every checkpoint tensor of the layer's source modules through ``param.weight_loader`` (as a model's
    ``load_weights`` does); every parameter the layer needs must have been loaded."""
    params = dict(layer.named_parameters())
    loaded = set()
    for module, shard_id in _LINEAR_SOURCES[which]:
        for name, tensor in ckpt.items():
            if not name.startswith(f"{LAYER}.{module}."):
                continue
            pname = name[len(f"{LAYER}.{module}."):]
            param = params[pname]
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
            loaded.add(pname)
    _check_loaded(which, params, loaded, act)


def load_moe(experts: torch.nn.Module, ckpt: dict[str, torch.Tensor], num_experts: int, act: str) -> None:
    """Every expert tensor through the ``RoutedExperts`` weight loader with vLLM's own expert mapping; each rank's
    loader keeps its shard (TP) or its experts (EP)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)
    params = dict(experts.named_parameters())
    loaded = set()
    prefix = f"{LAYER}.mlp."
    for name, tensor in ckpt.items():
        if not name.startswith(prefix + "experts."):
            continue
        rel = name[len(prefix):]  # experts.{e}.{gate,up,down}_proj.{suffix}
        for param_prefix, weight_prefix, expert_id, shard_id in mapping:
            if rel.startswith(weight_prefix):
                model_name = rel.replace(weight_prefix, param_prefix)  # experts.routed_experts.w13_weight, ...
                pname = model_name.removeprefix("experts.routed_experts.")
                param = params[pname]
                param.weight_loader(param, tensor, model_name, shard_id=shard_id, expert_id=expert_id)
                loaded.add(pname)
                break
        else:
            raise AssertionError(f"no expert mapping for {name}")
    _check_loaded("moe", params, loaded, act)


# ---- building -----------------------------------------------------------------------------------------------------

def build_linear(case: Case, which: str, shape: TinyShape, *, bias: bool = False) -> torch.nn.Module:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    common = dict(bias=bias, quant_config=NL.quant_config(case.fmt, case.act), params_dtype=torch.bfloat16)
    s = shape
    if which == "qkv":
        return QKVParallelLinear(s.hidden, s.head_dim, s.heads, s.kv_heads, prefix=f"{LAYER}.self_attn.qkv_proj",
                                 **common)
    if which == "o":
        return RowParallelLinear(s.heads * s.head_dim, s.hidden, prefix=f"{LAYER}.self_attn.o_proj", **common)
    if which == "gate_up":
        return MergedColumnParallelLinear(s.hidden, [s.moe_intermediate] * 2, prefix=f"{LAYER}.mlp.gate_up_proj",
                                          **common)
    if which == "down":
        return RowParallelLinear(s.moe_intermediate, s.hidden, prefix=f"{LAYER}.mlp.down_proj", **common)
    raise ValueError(which)


def route(hidden_states, gating_output, topk, renormalize):
    """The layer's router as a ``custom_routing_function`` (vLLM's fused top-k router needs ``vllm._C``)."""
    return topk_route(gating_output.float(), topk)


def build_moe(case: Case, shape: TinyShape):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    return FusedMoEFactory(
        num_experts=shape.experts, top_k=shape.top_k, hidden_size=shape.hidden,
        intermediate_size=shape.moe_intermediate, params_dtype=torch.bfloat16,
        quant_config=NL.quant_config(case.fmt, case.act), prefix=f"{LAYER}.mlp.experts", custom_routing_function=route,
    )


def _bias(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)


def build_and_load(case: Case, ckpt_dir: str | Path, mp: pytest.MonkeyPatch) -> dict[str, torch.nn.Module]:
    """The case's layers (name → module; the MoE runner under ``"moe"``), built, loaded and processed by vLLM on a
    faked sm_120.  The platform fake is undone by ``mp``; call inside ``set_current_vllm_config``."""
    shape, ckpt = read_shape(ckpt_dir), read_checkpoint(ckpt_dir)
    vllm_platform.fake_cuda(mp, SM120)
    if case.kind == "moe":
        runner = build_moe(case, shape)
        load_moe(runner.routed_experts, ckpt, shape.experts, case.act)
        runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)
        return {"moe": runner}
    # The down projection gets a bias (the checkpoint has none): vLLM adds it on rank 0 only, before the all-reduce.
    ckpt[f"{LAYER}.mlp.experts.0.down_proj.bias"] = _bias(shape.hidden)
    names = {"qkv": ["qkv"], "o": ["o"], "mlp": ["gate_up", "down"]}[case.kind]
    layers = {}
    for which in names:
        layer = build_linear(case, which, shape, bias=which == "down")
        load_linear(layer, which, ckpt, case.act)
        layer.quant_method.process_weights_after_loading(layer)
        layers[which] = layer
    return layers


def kernel_summary(layer: torch.nn.Module) -> dict:
    """Which kernel vLLM left on the layer: our class (and its fallback, if a route refused the layer) or vLLM's."""
    if hasattr(layer, "routed_experts"):
        return {"kernel": type(layer.routed_experts.quant_method.moe_kernel.fused_experts).__name__, "fallback": None,
                "route": None}
    kernel = NL.kernel_of(layer)
    fallback = getattr(kernel, "_fallback", None)
    return {"kernel": type(kernel).__name__, "fallback": None if fallback is None else type(fallback).__name__,
            "route": getattr(kernel, "route", None)}


# ---- forward ------------------------------------------------------------------------------------------------------

def _activations(t: int, k: int, seed: int) -> torch.Tensor:
    """The same bf16 inputs on every rank and on one rank."""
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _gather(out: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(out.contiguous(), dim=-1)


def _linear_forward(layers, shape: TinyShape, t: int, seed: int) -> dict:
    from vllm.distributed.utils import split_tensor_along_last_dim

    rank, world = rank_and_world()
    res = {}
    if "qkv" in layers:
        qkv = layers["qkv"]
        out, _ = qkv(_activations(t, shape.hidden, seed))
        res["qkv"] = _gather(out)
        res["qkv_widths"] = list(qkv.logical_widths)
        res["kv_replicas"] = qkv.num_kv_head_replicas
    if "o" in layers:
        o = layers["o"]
        x_r = split_tensor_along_last_dim(_activations(t, shape.heads * shape.head_dim, seed), world)[rank].contiguous()
        res["o"], _ = o(x_r)
        res["o_partial"] = o.quant_method.apply(o, x_r)  # this rank's share, before vLLM's all-reduce
    if "gate_up" in layers:
        gate_up, down = layers["gate_up"], layers["down"]
        h, _ = gate_up(_activations(t, shape.hidden, seed))
        res["gate_up"] = _gather(h)
        res["gate_up_widths"] = list(gate_up.logical_widths)
        # The row-parallel input is this rank's slice of the activation: its own gate and up shards.
        g, u = h.split(gate_up.logical_widths, dim=-1)
        a = (torch.nn.functional.silu(g.float()) * u.float()).to(torch.bfloat16)
        res["down"], _ = down(a)
        res["down_partial"] = down.quant_method.apply(down, a, down.bias if rank == 0 else None)
    return res


def _moe_forward(runner, shape: TinyShape, t: int, seed: int, cfg) -> dict:
    from vllm.forward_context import set_forward_context

    x = _activations(t, shape.hidden, seed)
    logits = torch.randn(t, shape.experts, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    experts = runner.routed_experts
    with pytest.MonkeyPatch.context() as mp, set_forward_context(None, cfg):
        vllm_platform.cpu_platform(mp)  # the modular kernel's buffers on the CPU instead of the CUDA workspace
        out = runner(x, logits)
        tw, ti = route(x, logits, shape.top_k, True)
        partial = experts.forward_modular(x, tw, ti)  # this rank's experts / shard, before vLLM's all-reduce
    return {"moe": out, "moe_partial": partial}


def _plans(layers, shape: TinyShape, ts) -> dict:
    """Whether each T runs a W4A4 plan on this rank: the op's own dispatch on the rank's shapes."""
    from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE
    from vllm_nvfp4_sm120.dispatch.linear import select_linear
    from vllm_nvfp4_sm120.dispatch.moe_flow import plan_for

    plans = {}
    for name, layer in layers.items():
        for t in ts:
            if name == "moe":
                ex = layer.routed_experts
                x = torch.empty(t, shape.hidden, dtype=torch.bfloat16)
                ids = torch.empty(t, shape.top_k, dtype=torch.int32)
                plan = plan_for(x, ex.w13_weight, ex.w2_weight, ids, expert_map=ex.expert_map,
                                w4a4=ex.quant_method.moe_quant_config.a1_gscale is not None)
                plans[(name, t)] = plan.kernel
            else:
                kernel = NL.kernel_of(layer)
                if getattr(kernel, "_fallback", None) is not None or not hasattr(kernel, "route"):
                    continue
                n, k = layer.weight_scale.shape[0], layer.weight_scale.shape[1] * 16
                plan = select_linear(SM120_REFERENCE, kernel.route, t, n, k)  # what the op runs on CPU
                plans[(name, t)] = "w4a4" if plan.is_w4a4 else "w4a16"
    return plans


def _static_scales(layers) -> dict:
    """The MoE layer's static activation encode scales (EP: must be the same on every rank and as one rank's)."""
    if "moe" not in layers:
        return {}
    ex = layers["moe"].routed_experts
    qc = ex.quant_method.moe_quant_config
    return {"a1_gscale": qc.a1_gscale, "a2_gscale": qc.a2_gscale, "local_experts": ex.w13_weight.shape[0],
            "expert_map": ex.expert_map}


# ---- tasks (run on every rank, and in the test process for one rank) -----------------------------------------------

def task_forward(ckpt_dir: str, case: Case, ts: tuple[int, ...], seed: int = 0) -> dict:
    """Build and load the case's layers, run them at each T: outputs after vLLM's collectives, per-rank partials,
    the kernels chosen, the plans run and the MoE's static scales."""
    from vllm.config import set_current_vllm_config

    shape = read_shape(ckpt_dir)
    cfg = vllm_config_for(case)
    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(cfg):
        _fresh_log_state(mp)
        layers = build_and_load(case, ckpt_dir, mp)
    result = {"rank_world": rank_and_world(), "kernels": {n: kernel_summary(layer) for n, layer in layers.items()},
              "plans": _plans(layers, shape, ts), "scales": _static_scales(layers), "outputs": {}}
    with set_current_vllm_config(cfg):
        for t in ts:
            if case.kind == "moe":
                result["outputs"][t] = _moe_forward(layers["moe"], shape, t, seed + t, cfg)
            else:
                result["outputs"][t] = _linear_forward(layers, shape, t, seed + t)
    return result


def task_load_outcome(ckpt_dir: str, case: Case) -> dict:
    """What loading the case does on this rank: the kernels chosen, or the error raised (type and message)."""
    from vllm.config import set_current_vllm_config

    try:
        with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(vllm_config_for(case)):
            _fresh_log_state(mp)
            layers = build_and_load(case, ckpt_dir, mp)
    except Exception as e:  # noqa: BLE001  (the outcome is the subject of the test)
        return {"rank_world": rank_and_world(), "error": f"{type(e).__name__}: {e}"}
    return {"rank_world": rank_and_world(), "error": None,
            "kernels": {n: kernel_summary(layer) for n, layer in layers.items()}}


def task_load_outcome_refusing_on_rank(ckpt_dir: str, case: Case, refusing_rank: int) -> dict:
    """:func:`task_load_outcome` with the cuBLAS route's layer check refusing on one rank only: a planted
    inconsistency, to show that the tests' consistency check can fail."""
    from vllm_nvfp4_sm120.dispatch import vendor

    with pytest.MonkeyPatch.context() as mp:
        if rank_and_world()[0] == refusing_rank:
            mp.setattr(vendor, "cublas_refusal", lambda cap, n, k, **kw: "planted: this rank only")
        return task_load_outcome(ckpt_dir, case)



def task_load_outcome_guard_failing_on_rank(ckpt_dir: str, case: Case, failing_rank: int) -> dict:
    """:func:`task_load_outcome` with the numerics guard forced on CPU: every linear launcher exact, except on one
    rank, where the W4A4 Triton GEMM is wrong (linears) or the W4A16 MoE plans' inline-PTX decode variant is
    (MoE, plans up to T = 16 in fp16: the interpreter runs the real Triton kernels, and its bf16 dot is wrong).
    Which kernels every rank ends on, and the guard's log lines."""
    import logging

    from vllm.model_executor.kernels import linear as L
    from vllm.platforms import PlatformEnum

    from vllm_nvfp4_sm120.dispatch import guard as G
    from vllm_nvfp4_sm120.dispatch import moe as M
    from vllm_nvfp4_sm120.dispatch import linear_call, ops, policy, registry  # noqa: F401  (ops registers the op)
    from vllm_nvfp4_sm120.dispatch.linear import LinearKernel, LinearPlan
    from vllm_nvfp4_sm120.vllm import linear as ours
    from vllm_nvfp4_sm120.vllm import numerics

    wrong = rank_and_world()[0] == failing_rank

    def stand_in(kernel):
        factor = 1.25 if wrong and kernel is LinearKernel.W4A4_TRITON else 1.0

        def run(x, w_codes, w_scales, w_dec_rows, swizzled, in_enc, alpha, bias, **tile):
            ref = linear_call.plan_reference(LinearPlan(kernel), x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias)
            return ref * factor
        return run

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("vllm.nvfp4_sm120")
    handler = Keep(logging.ERROR)
    G.clear_cache()
    policy.clear_substitutes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numerics, "FORCE_GUARD", True)
        mp.delenv(numerics.GUARD_ENV, raising=False)
        for kernel in LinearKernel:
            mp.setitem(registry.LINEAR_KERNELS, kernel, stand_in(kernel))
        theirs = [c.__name__ for c in L._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]
                  if c not in ours.KERNEL_CLASSES and c.__name__ != "EmulationNvFp4LinearKernel"]
        mp.setenv("VLLM_DISABLED_KERNELS", ",".join(theirs))
        NL.guard_moe_on_cpu(mp, 1.5 if wrong else 1.0)
        log.addHandler(handler)
        try:
            outcome = task_load_outcome(ckpt_dir, case)
            if case.kind == "moe" and outcome["error"] is None:
                from vllm_nvfp4_sm120.dispatch.hw import NO_GPU

                shape = read_shape(ckpt_dir)
                per_rank_i = shape.moe_intermediate // rank_and_world()[1]
                plan = M.select_moe_plan(NO_GPU, num_tokens=1, top_k=shape.top_k, global_experts=shape.experts,
                                         hidden=shape.hidden, intermediate=per_rank_i, w4a4=case.act == "w4a4")
                outcome["moe_plan_t1"] = plan.tier
        finally:
            log.removeHandler(handler)
            G.clear_cache()
            policy.clear_substitutes()
    return {**outcome, "guard_lines": [m for m in records if "numerics guard" in m]}
