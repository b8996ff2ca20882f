"""NVFP4 fused MoE in vLLM 0.33: our experts class.

:class:`Sm120NvFp4Experts` is a ``FusedMoEExpertsModular`` (standard activation format; it quantizes its own
inputs) whose ``apply`` is one call of ``torch.ops.nvfp4_sm120.moe`` (``dispatch/moe_ops.py``): the layer flow
picks W4A16 or W4A4 kernels per call from the tokens per expert, inside the op.

vLLM has no registry for MoE backends, so :mod:`.register` patches ModelOpt's (``ModelOptNvFp4FusedMoE``) and
compressed-tensors' (``CompressedTensorsW4A4Nvfp4MoEMethod``) NVFP4 MoE methods to ask this class:

1. their ``select_nvfp4_moe_backend`` takes our experts unless :meth:`Sm120NvFp4Experts.refusal` says why not:
   automatically on sm_12x for W4A4 checkpoints (the experts carry static input scales), and by name,
   ``--moe-backend nvfp4_sm120``, on any CUDA GPU and for W4A16 checkpoints too (W4A16 kernels only).  Both methods
   keep a ``NvFp4MoeBackend`` value; ours is :attr:`~Sm120NvFp4Experts.backend_slot` (``EMULATION``): no global-sf
   input scales (``use_global_sf`` False: input scales per local expert) and no extra kernel arguments.
2. their ``process_weights_after_loading`` becomes :meth:`Sm120NvFp4Experts.prepare_layer`: vLLM's loaded banks
   stay as they are (codes ``[E, 2I, H/2]``, gate rows then up rows; linear e4m3 scales), nothing is copied; the
   per-expert weight globals and the static activation scales are reduced by :mod:`.scale_policy`; then vLLM's own
   ``make_nvfp4_moe_kernel`` builds the modular kernel.
3. their ``get_fused_moe_quant_config`` gives our experts the tensors they read
   (:meth:`Sm120NvFp4Experts.quant_config`).

The class names of the methods are untouched, so the weight loader's class-name checks ("ModelOpt" in the name:
w1/w3 input scales in ``[E, 0]`` / ``[E, 1]``; "compressed": w1 and w3 input scales must agree) behave as usual.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
import vllm.model_executor.layers.fused_moe.oracle.nvfp4 as oracle
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    nvfp4_moe_quant_config,
    nvfp4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey, kNvfp4Dynamic, kNvfp4Static
from vllm.model_executor.utils import replace_parameter

from ..dispatch import moe_ops  # registers torch.ops.nvfp4_sm120.moe: it must exist before any apply is traced
from ..dispatch import guard, vendor
from ..dispatch.hw import capability_of
from ..dispatch.linear import AUTO_BACKEND
from ..dispatch.shards import shard_refusal
from ..format import check_tensor
from . import scale_policy
from . import numerics
from .log import layer_name, log_once
from .numerics import apply_numerics_policy
from .platform import current_capability
from .scale_policy import COMPRESSED_TENSORS, MODELOPT  # noqa: F401  (the formats prepare_layer takes)

BACKEND_NAME = AUTO_BACKEND  # --moe-backend
BACKEND_NAMES: tuple[str, ...] = (BACKEND_NAME,)
# The static activation encode scales the experts read (one [1] fp32 each): our own names, since ModelOpt's
# w13_input_scale / w2_input_scale hold its per-expert decode scales.
A13_ENC = "_nvfp4_sm120_a13_enc"
A2_ENC = "_nvfp4_sm120_a2_enc"


# ---- the experts ---------------------------------------------------------------------------------------------------

class Sm120NvFp4Experts(mk.FusedMoEExpertsModular):
    """NVFP4 MoE experts on our kernels (``torch.ops.nvfp4_sm120.moe``).

    Reads from its quant config (:meth:`quant_config`): ``w1_scale`` / ``w2_scale`` linear e4m3 block scales
    ``[E, 2I, H/16]`` / ``[E, H, I/16]``, ``g1_alphas`` / ``g2_alphas`` per-expert weight *decode* globals ``[E]``,
    and, for W4A4 checkpoints, ``a1_gscale`` / ``a2_gscale``: one-element *encode* activation scales (``None`` for
    W4A16).  Weighs and sums the top-k routes itself (``TopKWeightAndReduceNoOP``).
    """

    backend_name = BACKEND_NAME
    # The NvFp4MoeBackend value our layers carry (the enum is closed): EMULATION is the one whose semantics match
    # ours -- input scales per local expert (no global-sf loading) and no extra kernel arguments in
    # make_nvfp4_moe_kernel.
    backend_slot = oracle.NvFp4MoeBackend.EMULATION
    deterministic = False  # fp32 atomics for the top-k sum; the op has a slot-ordered mode if ever needed

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # the op quantizes x with the static scale when its plan is W4A4

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def is_supported_config(
        cls: type[mk.FusedMoEExperts],
        moe_config: FusedMoEConfig,
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
        activation_format: mk.FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        if moe_config.has_bias:
            return False, "kernel does not support expert bias"
        if any(getattr(moe_config, f, None) is not None for f in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
            return False, "kernel does not support the SwiGLU clamp / alpha / beta"
        if moe_config.in_dtype not in (torch.bfloat16, torch.float16):
            return False, f"kernel does not support {moe_config.in_dtype} activations (bf16/fp16 only)"
        return mk.FusedMoEExpertsModular.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format)

    @staticmethod
    def _supports_current_device() -> bool:
        from vllm.platforms import current_platform  # late: tests fake the platform

        # Any CUDA GPU runs the kernels (exact decode instead of the FP4 MMA before sm_120); auto picks them on
        # sm_12x only (see refusal).
        return current_platform.is_cuda()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        # W4A4 (static global, dynamic block scales) and weight-only W4A16.
        return weight_key == kNvfp4Static and activation_key in (kNvfp4Dynamic, None)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation.value in moe_ops.ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        # Global top-k ids + expert_map (no EP, or EP with allgather/reducescatter or naive dispatch), as vLLM's
        # CUTLASS FP4 experts; the DeepEP-HT and FlashInfer NVLink layouts are different.
        return not (
            moe_parallel_config.use_fi_nvl_two_sided_kernels
            or moe_parallel_config.use_deepep_ht_kernels
            or moe_parallel_config.use_fi_nvl_one_sided_kernels
        )

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return hidden_dim % 16 == 0

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # The op sizes its own scratch from shapes; vLLM only provides the [M, K] output.
        return (0,), (0,), (M, K)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = layer_name(layer)
        e, two_i, h_half = check_tensor(f"{name}.w13_weight", layer.w13_weight, dtype=torch.uint8, ndim=3).shape
        h, i = h_half * 2, two_i // 2
        check_tensor(f"{name}.w2_weight", layer.w2_weight, dtype=torch.uint8, shape=[e, h, i // 2])
        check_tensor(f"{name}.w13_weight_scale (linear e4m3)", self.w1_scale, dtype=torch.float8_e4m3fn,
                     shape=[e, two_i, h // 16])
        check_tensor(f"{name}.w2_weight_scale (linear e4m3)", self.w2_scale, dtype=torch.float8_e4m3fn,
                     shape=[e, h, i // 16])
        check_tensor(f"{name}.w13_weight_scale_2 (decode)", self.g1_alphas, dtype=torch.float32, shape=[e])
        check_tensor(f"{name}.w2_weight_scale_2 (decode)", self.g2_alphas, dtype=torch.float32, shape=[e])
        for what, t in ((A13_ENC, self.a1_gscale), (A2_ENC, self.a2_gscale)):
            if t is not None:
                check_tensor(f"{name}.{what} (encode)", t, dtype=torch.float32, shape=[1])

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor | None,
        workspace2: torch.Tensor | None,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        # prepare() already scaled the input by the routing weight (top_k == 1): route with weight 1.
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        torch.ops.nvfp4_sm120.moe(
            hidden_states, w1, self.w1_scale, self.g1_alphas, w2, self.w2_scale, self.g2_alphas,
            weights.to(torch.float32), topk_ids, self.a1_gscale, self.a2_gscale, expert_map,
            activation.value, self.deterministic, output,
        )


    # ---- how vLLM's NVFP4 MoE methods reach this class (installed by register.py) ------------------------------
    @classmethod
    def refusal(cls, config: FusedMoEConfig, weight_key, activation_key) -> str | None:
        """``None`` when our experts take the layer, else why not."""
        import vllm.envs as envs

        named = config.moe_backend in BACKEND_NAMES
        if not named and config.moe_backend != "auto":
            return f"--moe-backend {config.moe_backend} names another backend"
        if cls.__name__ in envs.VLLM_DISABLED_KERNELS:
            return "disabled by VLLM_DISABLED_KERNELS"
        if not named:
            cap = current_capability()
            if not vendor.chosen_automatically(cap):
                return f"chosen automatically on sm_12x only (this GPU: {'none' if cap is None else cap.name})"
            if activation_key is None:
                return "W4A16 checkpoint (no static input scales): by name only (--moe-backend nvfp4_sm120)"
        act_format = (mk.FusedMoEActivationFormat.BatchedExperts
                      if config.moe_parallel_config.use_batched_activation_format
                      else mk.FusedMoEActivationFormat.Standard)
        ok, why = cls.is_supported_config(cls, config, weight_key, activation_key, act_format)
        return None if ok else why

    @staticmethod
    def quant_config(layer: torch.nn.Module, *, w4a4: bool) -> FusedMoEQuantConfig:
        """The tensors the experts read, as the layer's own parameters (EPLB moves them in place)."""
        if not w4a4:
            return nvfp4_w4a16_moe_quant_config(
                g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2,
                w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
            )
        return nvfp4_moe_quant_config(
            g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2,
            a1_gscale=getattr(layer, A13_ENC), a2_gscale=getattr(layer, A2_ENC),
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
            is_scale_swizzled=False,
        )

    @classmethod
    def prepare_layer(cls, method, layer: torch.nn.Module, fmt: str) -> None:
        """The ``process_weights_after_loading`` of ``method`` (ModelOpt or compressed-tensors) for our experts."""
        name = layer_name(layer)
        w4a4 = not method.use_a16
        # The down GEMM's K is this rank's share of I; a share that is not whole 16-blocks has no NVFP4 kernel
        # (vLLM's MoE backends included: its w2 scales were loaded rounded down), so refuse, on every rank alike.
        moe = method.moe
        if (why := shard_refusal(name, "intermediate size I", moe.intermediate_size,
                                 moe.intermediate_size_per_partition, moe.moe_parallel_config.tp_size)) is not None:
            raise ValueError(why)
        apply_numerics_policy()
        if fmt == COMPRESSED_TENSORS:
            # The modular kernel expects vLLM's `w13_weight` / `w2_weight` names (CT's own processing renames too).
            for n in ("w13", "w2"):
                packed = getattr(layer, f"{n}_weight_packed")
                delattr(layer, f"{n}_weight_packed")
                layer.register_parameter(f"{n}_weight", torch.nn.Parameter(packed.data, requires_grad=False))
        w13, w2, a13, a2 = scale_policy.moe_globals(layer, fmt, w4a4=w4a4)
        replace_parameter(layer, "w13_weight_scale_2", scale_policy.gate_up_weight_dec(w13, name))
        replace_parameter(layer, "w2_weight_scale_2", w2.dec.contiguous())
        if w4a4:
            parallel = method.moe.moe_parallel_config
            replace_parameter(layer, A13_ENC, scale_policy.static_input_enc(a13.dec, f"{name}.w13_input_scale",
                                                                             parallel))
            replace_parameter(layer, A2_ENC, scale_policy.static_input_enc(a2.dec, f"{name}.w2_input_scale",
                                                                            parallel))

        cls._guard(method, layer, name, w4a4)

        method.moe_quant_config = method.get_fused_moe_quant_config(layer)
        method.moe_kernel = oracle.make_nvfp4_moe_kernel(
            moe_quant_config=method.moe_quant_config,
            moe_config=method.moe,
            experts_cls=method.experts_cls,
            backend=method.nvfp4_backend,
            routing_tables=layer._expert_routing_tables(),
        )
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    @staticmethod
    def _guard(method, layer: torch.nn.Module, name: str, w4a4: bool) -> None:
        """The numerics guard on this layer's shape (``dispatch/guard.py``): a plan that fails on this GPU is
        replaced by the portable Triton plan of its tier for every layer of the shape, with one error line."""
        moe = method.moe
        mode, device = numerics.guard_mode(), layer.w13_weight.device
        if not guard.should_run(mode, device, numerics.FORCE_GUARD):
            return
        hidden, intermediate = layer.w13_weight.shape[2] * 2, layer.w2_weight.shape[2] * 2
        try:
            outcome = guard.guard_moe(
                hidden=hidden, intermediate=intermediate, global_experts=moe.num_experts,
                top_k=moe.experts_per_token, w4a4=w4a4, dtype=moe.in_dtype, device=device, mode=mode, force=True)
        except guard.NumericsGuardError as e:
            raise guard.NumericsGuardError(f"NVFP4 MoE layer {name}: {e}") from None
        # Every rank runs a plan as far down the portable chain as any rank's GPU needed (same plans everywhere).
        plans = list(outcome.depths)
        fallbacks = dict(outcome.fallbacks)
        for plan, depth in zip(plans, numerics.max_over_ranks([outcome.depths[p] for p in plans])):
            if depth > outcome.depths[plan]:
                fallbacks[plan] = guard.fall_back(capability_of(device), plan, depth, hidden=hidden,
                                                  intermediate=intermediate)
        failed = {r.key: r for r in outcome.results if not r.ok}
        for plan, fallback in fallbacks.items():
            why = next((r for r in failed.values() if r.key[1] == plan), None)
            log_once("error", ("guard", plan, fallback),
                     "nvfp4_sm120: numerics guard: MoE layer %s: %s; its shape runs %s/%s tier %s instead "
                     "(VLLM_NVFP4_SM120_GUARD=strict fails the load)",
                     name, why.describe() if why else f"{plan.tier} failed on another tensor-parallel rank",
                     fallback.kernel, fallback.impl, fallback.tier)

    @classmethod
    def serves(cls, method) -> bool:
        """Whether vLLM's MoE ``method`` runs our experts."""
        experts = getattr(method, "experts_cls", None)
        return isinstance(experts, type) and issubclass(experts, cls)
