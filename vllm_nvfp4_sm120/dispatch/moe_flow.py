"""The NVFP4 MoE layer as the algorithm reads, one kernel per step; every tile and switch comes from the plan.

    align routes to experts → gate_up GEMM (+ gated activation) → down GEMM (+ routing weight) → top-k sum

The gated activation is the gate_up GEMM's epilogue (W4A4: it also quantizes the intermediate to NVFP4), and the
routing weight is the down GEMM's; the top-k sum is fp32 atomics into ``[T, H]`` or, ``deterministic``, a
per-route buffer ``[T * top_k, H]`` summed in slot order.  Every buffer is sized from shapes (T, top_k, E, block
size), nothing reads a device value on the host: the function is CUDA-graph safe and can be a torch custom op.

A call's checks and plan depend only on its tensors' metadata and its options, so they run once per signature:
the first call validates every tensor and selects the plan, later ones with the same signature find it in a dict
(the key also holds what the selector reads besides the shapes: the policy's and the substitutions' generation,
``policy.generation()``, and the selector environment; ``configs.clear_cache`` forgets the entries).  The launchers
still check their arguments, except on later GPU calls of a plan with a ready layer launcher
(``registry.READY_MOE``: the decode plan and the tiers, Triton and Gluon): the first call runs the validating launchers,
and the entry then keeps the ready one (``registry.prepare_moe``: grids, compile-time arguments and buffer sizes
fixed, Triton's argument binding skipped), since nothing they check can change within a signature but the banks'
addresses (whose TMA alignment the ready launches still check).

Decode plans (``Impl.DECODE``, small T) skip the alignment: ``topk_ids`` (and ``expert_map``) go straight into the
gate_up kernel (gated activation fused) and the down kernel (routing weight and top-k sum fused), or both as the work
items of one launch (``DecodeDown.FUSED``); see :func:`_run_decode`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..format import GlobalScale, NvFp4, moe_ref
from ..format.checks import check_tensor
from ..format.reference import ACTIVATIONS
from ..kernels.common import interpreting
from ..kernels.moe_align import moe_align, moe_sum
from ..kernels.moe_common import check_moe_layer
from ..kernels.moe_decode import down_expert_workspace, moe_decode
from ..kernels.moe_decode_fused import moe_decode_fused
from ..kernels.moe_w4a4 import moe_quant_input
from . import policy
from .hw import capability_of
from .linear import act_quant_config
from .linear_call import MAX_ENTRIES, SELECTOR_ENV
from .moe import DecodeDown, Impl, MoeKernel, MoePlan, select_moe_plan
from .policy import current_policy
from .registry import MOE_KERNELS, MoeReady, prepare_moe



class _Entry:
    """One call signature's (the metadata of every tensor argument, activation, deterministic, an explicit plan,
    the policy's and substitutions' generation, the selector environment) cached state: its checks passed, this is
    its plan, and, once a GPU call ran it through the validating launchers, its ready launcher."""

    __slots__ = ("plan", "deterministic", "batch_invariant", "ready")

    def __init__(self, plan: MoePlan, deterministic: bool, batch_invariant: bool):
        self.plan, self.deterministic, self.batch_invariant, self.ready = plan, deterministic, batch_invariant, None


_CACHE: dict[tuple, _Entry] = {}


def clear() -> None:
    """Forget every cached entry (after anything the selectors read changed)."""
    _CACHE.clear()


def _selector_env():
    """A function returning the selector environment's values (a key component), one per SELECTOR_ENV name.
    ``os.environ.get`` encodes the name and decodes the value per call (~1 µs); ``os.environ`` keeps its values
    in ``_data`` (bytes on POSIX), which every change through ``os.environ`` updates, so reading that dict is the
    same lookup.  Elsewhere, or without it, ``os.environ.get``."""
    env = os.environ
    data, encode = getattr(env, "_data", None), getattr(env, "encodekey", None)
    if os.name != "posix" or type(data) is not dict or encode is None:
        return lambda: tuple(map(env.get, SELECTOR_ENV))
    keys = tuple(map(encode, SELECTOR_ENV))
    return lambda: tuple(map(data.get, keys))


_env = _selector_env()


def plan_for(x, w13_codes, w2_codes, topk_ids, *, w4a4: bool, expert_map=None) -> MoePlan:
    """The dispatch's plan for this call (what :func:`nvfp4_moe` runs)."""
    global_e = expert_map.shape[0] if expert_map is not None else w13_codes.shape[0]
    return select_moe_plan(
        capability_of(x.device), num_tokens=x.shape[0], top_k=topk_ids.shape[1], global_experts=global_e,
        hidden=x.shape[1], intermediate=w2_codes.shape[2] * 2, w4a4=w4a4,
    )


def nvfp4_moe(
    x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, *,
    a13_enc=None, a2_enc=None, expert_map=None, activation: str = "silu", deterministic: bool = False, out=None,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """An NVFP4 MoE layer: ``out [T, H] = sum_k topk_weights * down(act(gate) * up)`` over the routed experts.

    ``x [T, H]`` bf16/fp16; ``w13`` codes ``[E, 2I, H/2]`` (gate rows, then up rows), e4m3 scales
    ``[E, 2I, H/16]``, decode globals ``w13_dec [E]``; ``w2`` codes ``[E, H, I/2]``, scales ``[E, H, I/16]``,
    ``w2_dec [E]``; ``topk_weights [T, k]`` fp32, ``topk_ids [T, k]`` int32/int64 (global ids, mapped by
    ``expert_map [global_E]`` int32 to local ids or -1).  ``a13_enc`` / ``a2_enc``: one-element fp32 *encode*
    scales of the gate_up and down inputs (W4A4 checkpoints); the plan uses them from a few tokens per expert
    on.  CPU tensors: the torch reference in the form the plan selects (``moe_ref``; W4A4 quantizes the fp32
    activation output directly, as the fused epilogue does).  ``plan`` overrides the dispatch (tests; on CPU with
    ``TRITON_INTERPRET=1`` it runs the kernels in the interpreter).
    """
    try:
        # Per tensor (shape, strides, dtype, device): one comprehension, not a function call per tensor.
        key = (*[None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                 for t in (x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                           a13_enc, a2_enc, expert_map, out)],
               activation, deterministic, plan, policy.generation(), _env())
        entry = _CACHE.get(key)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: no entry, the checks name the argument
        key = entry = None
    if entry is None:
        entry = _Entry(*_checked_plan(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights,
                                      topk_ids, a13_enc, a2_enc, expert_map, activation, deterministic, out, plan))
        if key is not None:
            if len(_CACHE) >= MAX_ENTRIES:
                _CACHE.clear()
            _CACHE[key] = entry
    if entry.ready is not None:  # a GPU call of a signature that ran before: its launches, nothing else
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return entry.ready(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                           a13_enc, a2_enc, expert_map, out)
    explicit_plan = plan is not None
    plan, deterministic, batch_invariant = entry.plan, entry.deterministic, entry.batch_invariant
    t = x.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)

    if x.device.type != "cuda" and not (explicit_plan and interpreting()):
        # CPU: the torch reference in the plan's form.  (Tests that pass a plan run the kernels in the interpreter.)
        if batch_invariant and t > 1:
            # One token at a time: the CPU matmul's result depends on how many rows an expert gets.
            for i in range(t):
                out[i:i + 1].copy_(_reference(x[i:i + 1], w13_codes, w13_scales, w13_dec, w2_codes, w2_scales,
                                              w2_dec, topk_weights[i:i + 1], topk_ids[i:i + 1], a13_enc, a2_enc,
                                              expert_map, activation, plan))
            return out
        return out.copy_(_reference(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights,
                                     topk_ids, a13_enc, a2_enc, expert_map, activation, plan))
    out = _run_kernels(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                       a13_enc, a2_enc, expert_map, activation, deterministic, out, plan)
    if key is not None and x.is_cuda and t > 0:
        # The validating launchers passed for this signature: later calls launch the same kernels directly.
        entry.ready = prepare_moe(plan, MoeReady(
            t, x.shape[1], w2_codes.shape[2] * 2, w13_codes.shape[0], topk_ids.shape[1],
            expert_map.shape[0] if expert_map is not None else w13_codes.shape[0], x.device, x.dtype,
            expert_map is not None, activation, deterministic))
    return out


def _checked_plan(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc,
                  a2_enc, expert_map, activation, deterministic, out, plan) -> tuple[MoePlan, bool, bool]:
    """Every check of a call with a new signature, and its plan: ``(plan, deterministic, batch_invariant)``."""
    check_moe_layer(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                    a13_enc, a2_enc, expert_map)  # every tensor, CPU and GPU alike, before anything reads them
    t, h = x.shape
    if (a13_enc is None) != (a2_enc is None):
        raise ValueError("a13_enc and a2_enc: give both (W4A4) or neither (W4A16)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=[t, topk_ids.shape[1]])
    check_tensor("topk_ids", topk_ids, shape=[t, None])
    if out is not None:  # the flow allocates it otherwise, in x's dtype and shape
        check_tensor("out", out, dtype=x.dtype, shape=[t, h], last_dim_contiguous=True)
    batch_invariant = current_policy().batch_invariant
    deterministic = deterministic or batch_invariant  # atomics add the top-k routes in a run-dependent order
    if plan is None:
        plan = plan_for(x, w13_codes, w2_codes, topk_ids, w4a4=a13_enc is not None, expert_map=expert_map)
    if plan.kernel == MoeKernel.W4A4 and a13_enc is None:
        raise ValueError("plan: a W4A4 plan needs the activation scales a13_enc and a2_enc")
    if deterministic and plan.impl == Impl.DECODE and plan.down.split_k > 1:
        # K splits add into the atomic sums; the deterministic per-route rows take the whole K in one program.
        plan = replace(plan, down=replace(plan.down, split_k=1))
    if deterministic and plan.stream_down is not None:  # its sums are fp32 atomics: the row's Triton down runs
        plan = replace(plan, stream_down=None)
    return plan, bool(deterministic), batch_invariant


def _reference(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
               a13_enc, a2_enc, expert_map, activation, plan: MoePlan):
    w4a4 = plan.kernel == MoeKernel.W4A4
    return moe_ref(
        x, NvFp4(w13_codes, w13_scales), w13_dec, NvFp4(w2_codes, w2_scales), w2_dec, topk_weights, topk_ids,
        activation=activation, expert_map=expert_map,
        a13_gs=GlobalScale.from_encode(a13_enc) if w4a4 else None,
        a2_gs=GlobalScale.from_encode(a2_enc) if w4a4 else None,
    )


def _run_kernels(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                 a13_enc, a2_enc, expert_map, activation, deterministic, out, plan: MoePlan):
    t, h = x.shape
    top_k = topk_ids.shape[1]
    if t == 0:
        return out
    if plan.impl == Impl.DECODE:
        return _run_decode(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                           expert_map, activation, deterministic, out, plan)
    # The top-k sum: fp32 atomics into [T, H], or one row per route summed in slot order.
    acc = torch.zeros((t * top_k if deterministic else t, h), dtype=torch.float32, device=x.device)

    # 1. Align routes to experts: sorted route ids padded per expert to BLOCK_M rows.
    align = moe_align(topk_ids, w13_codes.shape[0], plan.block_m, expert_map=expert_map)

    gate_up, down = MOE_KERNELS[plan.kernel, plan.impl]
    if plan.kernel == MoeKernel.W4A16:
        # 2-3. gate_up GEMM with the gated activation in its epilogue → intermediate [T * top_k, I].
        inter = gate_up(x, w13_codes, w13_scales, w13_dec, align, activation=activation, **plan.gate_up_kwargs())
        # 4. down GEMM, routing weight in its epilogue, summed over the top-k routes.
        down(inter, w2_codes, w2_scales, w2_dec, topk_weights, align, acc, deterministic=deterministic,
             **plan.down_kwargs())
    else:
        # 2-3. Quantize the input, then gate_up GEMM with activation + NVFP4 quantization in its epilogue.
        a_codes, a_scales = moe_quant_input(x, a13_enc, **act_quant_config(t, h))
        i_codes, i_scales = gate_up(a_codes, a_scales, w13_codes, w13_scales, w13_dec, a13_enc, a2_enc,
                                    align, activation=activation, **plan.gate_up_kwargs())
        # 4. down GEMM on the FP4 intermediate, routing weight in its epilogue, summed over the top-k routes.
        down(i_codes, i_scales, w2_codes, w2_scales, w2_dec, a2_enc, topk_weights, align, acc,
             deterministic=deterministic, **plan.down_kwargs())

    # 5. fp32 sum → x.dtype (slot order in deterministic mode).
    return moe_sum(acc, top_k if deterministic else 1, out)


def _run_decode(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, expert_map,
                activation, deterministic, out, plan: MoePlan):
    """The decode plan: two launches (three for the deterministic expert-major down; one for the fused plan), no
    alignment, buffers from shapes.  Routing ids out of range contribute nothing (as ``-1`` in ``expert_map``): checking them would sync."""
    # The kernels read the routing as flat [T * top_k] vectors (no copy when already contiguous, vLLM's case).
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    if plan.decode_down == DecodeDown.FUSED:
        # One launch: gate_up and down items in one grid, the top-k sum in slot order (a zeroed control block per
        # call here; the ready launcher keeps one per stream).
        return moe_decode_fused(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights,
                                topk_ids, gate_up_tile=plan.gate_up, down_tile=plan.down, expert_map=expert_map,
                                activation=activation, out=out)
    gate_up, down = MOE_KERNELS[plan.kernel, plan.impl]
    if plan.stream_down is not None:  # the streaming Gluon down (never in deterministic mode: _checked_plan)
        return moe_decode(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                          gate_up_tile=plan.gate_up, down_tile=plan.stream_down, down="expert",
                          expert_map=expert_map, activation=activation, out=out)
    by_expert = plan.decode_down == DecodeDown.EXPERT
    # Expert-major: fp32 sums + tile counts that the gate_up kernel's programs zero (atomic mode), or per-route
    # rows (deterministic, summed in slot order); token-major needs none.
    ws = (down_expert_workspace(x.shape[0], topk_ids.shape[1], w2_codes.shape[1], plan.down, deterministic, x.device)
          if by_expert else None)
    # 1. gate_up with the gated activation → intermediate [T * top_k, I], one row per route.
    # (the down bank goes with it: a gate_up tile may prefetch the down rows into L2)
    inter = gate_up(x, w13_codes, w13_scales, w13_dec, topk_ids, expert_map=expert_map, activation=activation,
                    zero=ws if by_expert and not deterministic else None, down_bank=(w2_codes, w2_scales, w2_dec),
                    **plan.gate_up_kwargs())
    # 2. down with the routing weight and the top-k sum → out [T, H].
    return down(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, ws, expert_map=expert_map,
                deterministic=deterministic, out=out, **plan.down_kwargs())
