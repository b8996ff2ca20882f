"""NVFP4 fused MoE in vLLM 0.33: our experts class, its selection and the layer's scales.

:class:`Sm120NvFp4Experts` is a ``FusedMoEExpertsModular`` (standard activation format; it quantizes its own
inputs) whose ``apply`` is one call of ``torch.ops.nvfp4_sm120.moe`` (``dispatch/moe_ops.py``): the layer flow
picks W4A16 or W4A4 kernels per call from the tokens per expert, inside the op.

vLLM has no registry for MoE backends (``oracle/fp8.py``: "TODO(rob) ... register MoE backends by OOT plugins"), so
:func:`register_moe` makes three small, recorded patches, for ModelOpt (``ModelOptNvFp4FusedMoE``) and
compressed-tensors (``CompressedTensorsW4A4Nvfp4MoEMethod``) only:

1. ``select_nvfp4_moe_backend``, where those two modules imported it, picks our experts
   * automatically on sm_12x for W4A4 checkpoints (the experts carry static input scales), and
   * by name, ``--moe-backend nvfp4_sm120`` (appended to vLLM's closed ``MoEBackend`` Literal), on any CUDA GPU and
     for W4A16 checkpoints too (W4A16 kernels only); a name we cannot honour logs why and falls back to vLLM's
     automatic choice.
   Both methods keep a ``NvFp4MoeBackend`` value; ours is :data:`BACKEND_SLOT` (``EMULATION``): no global-sf
   input scales (``use_global_sf`` False: input scales per local expert) and no extra kernel arguments.
2. their ``process_weights_after_loading``, for layers whose experts are ours, replaces vLLM's conversion by
   :func:`_prepare_layer`: vLLM's loaded banks stay as they are (codes ``[E, 2I, H/2]``, gate rows then up rows;
   linear e4m3 scales), nothing is copied; the per-expert weight globals and the static activation scales are
   reduced as described there; then vLLM's own ``make_nvfp4_moe_kernel`` builds the modular kernel.
3. their ``get_fused_moe_quant_config`` gives our experts the tensors they read (:func:`quant_config_for`).

The class names of the methods are untouched, so the weight loader's class-name checks ("ModelOpt" in the name:
w1/w3 input scales in ``[E, 0]`` / ``[E, 1]``; "compressed": w1 and w3 input scales must agree) behave as usual.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

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

from ..format import GlobalScale, check_tensor
from .log import layer_name, log_once, logger


BACKEND_NAME = "nvfp4_sm120"  # --moe-backend
BACKEND_NAMES: tuple[str, ...] = (BACKEND_NAME,)
# The NvFp4MoeBackend value our layers carry (the enum is closed): EMULATION is the one whose semantics match ours —
# input scales per local expert (no global-sf loading) and no extra kernel arguments in make_nvfp4_moe_kernel.
BACKEND_SLOT = oracle.NvFp4MoeBackend.EMULATION
MODELOPT = "ModelOpt"
COMPRESSED_TENSORS = "compressed-tensors"

_MODELOPT_MODULE = "vllm.model_executor.layers.quantization.modelopt"
_CT_MODULE = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
              "compressed_tensors_moe_w4a4_nvfp4")


def _ops():
    from ..dispatch import moe_ops  # registers torch.ops.nvfp4_sm120.moe

    return moe_ops


# ---- the experts ---------------------------------------------------------------------------------------------------

class Sm120NvFp4Experts(mk.FusedMoEExpertsModular):
    """NVFP4 MoE experts on our Triton kernels (``torch.ops.nvfp4_sm120.moe``).

    Reads from its quant config (:func:`quant_config_for`): ``w1_scale`` / ``w2_scale`` linear e4m3 block scales
    ``[E, 2I, H/16]`` / ``[E, H, I/16]``, ``g1_alphas`` / ``g2_alphas`` per-expert weight *decode* globals ``[E]``,
    and, for W4A4 checkpoints, ``a1_gscale`` / ``a2_gscale``: one-element *encode* activation scales (``None`` for
    W4A16).  Weighs and sums the top-k routes itself (``TopKWeightAndReduceNoOP``).
    """

    backend_name = BACKEND_NAME
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
        # sm_12x only (see _choose).
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
        return activation.value in _ops().ACTIVATIONS

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
        for what, t in (("w13_input_scale", self.a1_gscale), ("w2_input_scale", self.a2_gscale)):
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


_ops()  # the op must exist before any apply is traced

# ---- quant config and load-time scales ------------------------------------------------------------------------------

def quant_config_for(layer: torch.nn.Module, *, w4a4: bool) -> FusedMoEQuantConfig:
    """The tensors :class:`Sm120NvFp4Experts` reads, as the layer's own parameters (EPLB moves them in place)."""
    if not w4a4:
        return nvfp4_w4a16_moe_quant_config(
            g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2,
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
        )
    return nvfp4_moe_quant_config(
        g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2,
        a1_gscale=layer.w13_input_scale, a2_gscale=layer.w2_input_scale,
        w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
        is_scale_swizzled=False,
    )


def gate_up_weight_dec(parts_dec: torch.Tensor, name: str) -> torch.Tensor:
    """Per-expert gate_up weight decode global ``[E]`` from ``[E, 2]`` (w1, w3): w1's, as vLLM keeps.

    The kernels scale the gate_up GEMM with one global per expert; a w3 global that differs rescales the up rows.
    vLLM warns once for the whole model; we name the layer and the spread (load time: reads values on the host).
    """
    parts_dec = parts_dec.detach().to(torch.float32)
    w1, w3 = parts_dec[:, 0], parts_dec[:, 1]
    if not torch.allclose(w1, w3):
        differ = ~torch.isclose(w1, w3)
        ratio = float((torch.maximum(w1, w3) / torch.minimum(w1, w3))[differ].max())
        logger.warning(
            "NVFP4 MoE layer %s: the gate (w1) and up (w3) weight global scales differ for %d of %d experts "
            "(largest ratio %.4g); the kernels use one global per expert, w1's (as vLLM does). "
            "Accuracy may be affected.",
            name, int(differ.sum()), w1.numel(), ratio,
        )
    return w1.contiguous()


def _ep_max(t: torch.Tensor, parallel: FusedMoEParallelConfig) -> torch.Tensor:
    """Max across expert-parallel ranks, so every rank quantizes with the same scale (as vLLM's global-sf backends
    do, where each rank sees every expert's scale; and required with EPLB, where experts move between ranks)."""
    if parallel.use_ep and parallel.ep_size > 1:
        from vllm.distributed.parallel_state import get_ep_group

        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=get_ep_group().device_group)
    return t


def static_input_enc(dec: torch.Tensor, name: str, parallel: FusedMoEParallelConfig) -> torch.Tensor:
    """One static activation *encode* scale ``[1]`` for a GEMM input from the experts' *decode* scales.

    Max of the decode scales (the largest calibrated amax: no expert's input saturates), over the layer's experts,
    the w1/w3 parts and the expert-parallel ranks.  Load time: validated on the host.
    """
    dec_max = _ep_max(dec.detach().to(torch.float32).max().reshape(1), parallel)
    value = float(dec_max)
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"{name}: the static activation scale of the experts must be finite and > 0 (decode amax/2688), "
            f"got max {value}; the checkpoint's input scales are missing or broken"
        )
    return GlobalScale.from_decode(dec_max, name).enc.reshape(1)


def _prepare_layer(method, layer: torch.nn.Module, fmt: str) -> None:
    """Our ``process_weights_after_loading`` for ``method`` (ModelOpt or compressed-tensors) on ``layer``."""
    name = layer_name(layer)
    w4a4 = not method.use_a16
    if fmt == COMPRESSED_TENSORS:
        # The modular kernel expects vLLM's `w13_weight` / `w2_weight` names (CT's own processing renames too).
        for n in ("w13", "w2"):
            packed = getattr(layer, f"{n}_weight_packed")
            delattr(layer, f"{n}_weight_packed")
            layer.register_parameter(f"{n}_weight", torch.nn.Parameter(packed.data, requires_grad=False))
        # compressed-tensors stores ENCODE globals (2688 / amax).
        many = functools.partial(GlobalScale.from_encode, per_tensor=False)
        w13_parts, w2 = many(layer.w13_weight_global_scale), many(layer.w2_weight_global_scale)
        a13 = many(layer.w13_input_global_scale) if w4a4 else None
        a2 = many(layer.w2_input_global_scale) if w4a4 else None
    else:
        # ModelOpt stores DECODE globals (amax / 2688).
        many = functools.partial(GlobalScale.from_decode, per_tensor=False)
        w13_parts, w2 = many(layer.w13_weight_scale_2), many(layer.w2_weight_scale_2)
        a13 = many(layer.w13_input_scale) if w4a4 else None
        a2 = many(layer.w2_input_scale) if w4a4 else None

    replace_parameter(layer, "w13_weight_scale_2", gate_up_weight_dec(w13_parts.dec, name))
    replace_parameter(layer, "w2_weight_scale_2", w2.dec.contiguous())
    parallel = method.moe.moe_parallel_config
    a13_enc = static_input_enc(a13.dec, f"{name}.w13_input_scale", parallel) if w4a4 else None
    a2_enc = static_input_enc(a2.dec, f"{name}.w2_input_scale", parallel) if w4a4 else None
    if fmt == MODELOPT:
        replace_parameter(layer, "w13_input_scale", a13_enc)
        replace_parameter(layer, "w2_input_scale", a2_enc)
    else:
        layer.w13_input_scale, layer.w2_input_scale = a13_enc, a2_enc

    method.moe_quant_config = method.get_fused_moe_quant_config(layer)
    method.moe_kernel = oracle.make_nvfp4_moe_kernel(
        moe_quant_config=method.moe_quant_config,
        moe_config=method.moe,
        experts_cls=method.experts_cls,
        backend=method.nvfp4_backend,
        routing_tables=layer._expert_routing_tables(),
    )
    method.moe_kernel.fused_experts.process_weights_after_loading(layer)


# ---- selection -------------------------------------------------------------------------------------------------------

def current_capability() -> int | None:
    from vllm.platforms import current_platform  # late: tests fake the platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else cap.to_int()


def _choose(config: FusedMoEConfig, weight_key, activation_key) -> str | None:
    """``None`` when our experts take the layer, else why not."""
    import vllm.envs as envs

    named = config.moe_backend in BACKEND_NAMES
    if not named and config.moe_backend != "auto":
        return f"--moe-backend {config.moe_backend} names another backend"
    if Sm120NvFp4Experts.__name__ in envs.VLLM_DISABLED_KERNELS:
        return "disabled by VLLM_DISABLED_KERNELS"
    if not named:
        cc = current_capability()
        if cc is None or cc // 10 != 12:
            return f"chosen automatically on sm_12x only (this GPU: {'none' if cc is None else f'sm_{cc}'})"
        if activation_key is None:
            return "W4A16 checkpoint (no static input scales): by name only (--moe-backend nvfp4_sm120)"
    act_format = (mk.FusedMoEActivationFormat.BatchedExperts
                  if config.moe_parallel_config.use_batched_activation_format
                  else mk.FusedMoEActivationFormat.Standard)
    ok, why = Sm120NvFp4Experts.is_supported_config(Sm120NvFp4Experts, config, weight_key, activation_key,
                                                    act_format)
    return None if ok else why


def _make_select(fmt: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def select_nvfp4_moe_backend(config: FusedMoEConfig, weight_key, activation_key):
        acts = "W4A16" if activation_key is None else "W4A4"
        why = _choose(config, weight_key, activation_key)
        if why is None:
            how = "named" if config.moe_backend in BACKEND_NAMES else "auto"
            log_once("info", (fmt, acts, how),
                      "nvfp4_sm120: NVFP4 MoE layers (%s %s) use %s (%s)",
                      fmt, acts, Sm120NvFp4Experts.__name__,
                      "--moe-backend " + BACKEND_NAME if how == "named" else "automatic on sm_12x")
            return BACKEND_SLOT, Sm120NvFp4Experts
        if config.moe_backend not in BACKEND_NAMES:
            return original(config, weight_key, activation_key)
        log_once("warning", (fmt, acts, why),
                  "nvfp4_sm120: --moe-backend %s cannot take %s %s MoE layers (%s); using vLLM's automatic choice",
                  BACKEND_NAME, fmt, acts, why)
        # vLLM does not know our name: run its automatic selection for this layer.
        config.moe_backend = "auto"
        try:
            return original(config, weight_key, activation_key)
        finally:
            config.moe_backend = BACKEND_NAME

    return select_nvfp4_moe_backend


def is_ours(method) -> bool:
    cls = getattr(method, "experts_cls", None)
    return isinstance(cls, type) and issubclass(cls, Sm120NvFp4Experts)


def _make_process(fmt: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def process_weights_after_loading(self, layer):
        if not is_ours(self):
            return original(self, layer)
        if fmt == MODELOPT and sys.modules[_MODELOPT_MODULE].is_weights_pre_processed():
            return original(self, layer)  # vLLM's pre-processed (TRTLLM) weights: vLLM explains the error
        return _prepare_layer(self, layer, fmt)

    return process_weights_after_loading


def _make_quant_config(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_fused_moe_quant_config(self, layer):
        if not is_ours(self):
            return original(self, layer)
        return quant_config_for(layer, w4a4=not self.use_a16)

    return get_fused_moe_quant_config


# ---- registration ----------------------------------------------------------------------------------------------------

_undo: list[Callable[[], None]] = []


def _set(obj, name: str, value) -> None:
    old = vars(obj)[name]
    setattr(obj, name, value)
    _undo.append(lambda: setattr(obj, name, old))


def is_moe_registered() -> bool:
    return bool(_undo)


def register_moe() -> None:
    """Install the MoE hooks (module docstring).  Idempotent; does nothing on vLLM other than 0.33.x or with
    ``VLLM_NVFP4_SM120=0`` (the lead's ``register()`` calls it; :func:`unregister_moe` undoes it)."""
    from . import register as plugin

    if plugin.disabled_by_env() or is_moe_registered():
        return
    import vllm

    if not plugin.vllm_version_supported(vllm.__version__):
        return  # register() warns once about the version
    try:
        _install()
    except BaseException:
        unregister_moe()
        raise


def unregister_moe() -> None:
    while _undo:
        _undo.pop()()


def _install() -> None:
    import importlib

    from . import backend_names

    modelopt = importlib.import_module(_MODELOPT_MODULE)
    ct = importlib.import_module(_CT_MODULE)

    if backend_names.extend_literal(backend_names.MOE_BACKEND, BACKEND_NAMES):
        _undo.append(lambda: backend_names.restore(backend_names.MOE_BACKEND))

    original = oracle.select_nvfp4_moe_backend
    for fmt, module, method_cls in ((MODELOPT, modelopt, modelopt.ModelOptNvFp4FusedMoE),
                                    (COMPRESSED_TENSORS, ct, ct.CompressedTensorsW4A4Nvfp4MoEMethod)):
        if module.select_nvfp4_moe_backend is not original:
            raise RuntimeError(f"{module.__name__}.select_nvfp4_moe_backend is not vLLM's: another plugin patched it")
        _set(module, "select_nvfp4_moe_backend", _make_select(fmt, original))
        _set(method_cls, "process_weights_after_loading", _make_process(fmt, method_cls.process_weights_after_loading))
        _set(method_cls, "get_fused_moe_quant_config", _make_quant_config(method_cls.get_fused_moe_quant_config))
