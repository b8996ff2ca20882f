"""NVFP4 MoE in vLLM 0.33.0 (CPU, real vLLM): our experts selected, the layer's scales, numerics against vLLM.

Layers are built the way a model builds them (``FusedMoEFactory`` with vLLM's own ModelOpt / compressed-tensors
config classes), under a faked CUDA platform (``vllm_platform.fake_cuda``, strictly through a ``MonkeyPatch``);
checkpoint tensors are written into the parameters the way the weight loader leaves them, then vLLM's
``process_weights_after_loading`` runs.  Forwards run on CPU tensors with the real platform back: the op then
computes ``format.moe_ref`` in the form the dispatch plan selects.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import vllm_platform  # noqa: F401  (first: imports the vLLM modules that must precede any platform fake)
import vllm.model_executor.layers.fused_moe.oracle.nvfp4 as oracle  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E402,F401
    compressed_tensors_moe_w4a4_nvfp4,  # before any platform fake
)
from nvfp4_layers import quant_config  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (  # noqa: E402
    Nvfp4QuantizationEmulationTritonExperts,
)
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory  # noqa: E402
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (  # noqa: E402
    dequantize_to_dtype,
    ref_nvfp4_quant_dequant,
)
from vllm_platform import fake_cuda, vllm_config  # noqa: E402

from vllm_nvfp4_sm120.dispatch.moe import W4A4_MIN_TOKENS_PER_EXPERT  # noqa: E402
from vllm_nvfp4_sm120.format import GlobalScale, NvFp4, make_moe_bank, moe_ref, topk_route  # noqa: E402
from vllm_nvfp4_sm120.vllm import moe as glue  # noqa: E402
from vllm_nvfp4_sm120.vllm import register as plugin  # noqa: E402
from vllm_nvfp4_sm120.vllm import scale_policy  # noqa: E402
import vllm_nvfp4_sm120.vllm.log as glue_log_state  # noqa: E402

E, H, I, TOP_K = 8, 128, 64, 2  # one TP shard: H and I multiples of 16 (and of the 128x4 swizzle's 4 scale columns)
FORMATS = ("modelopt", "ct")
SM120, SM90 = (12, 0), (9, 0)


@pytest.fixture(scope="module", autouse=True)
def moe_registered(tp_group):
    was = plugin.is_registered()
    plugin.register()
    assert plugin.is_registered(), "register() did nothing (VLLM_NVFP4_SM120=0 in the environment?)"
    yield
    if not was:
        plugin.unregister()


@pytest.fixture
def glue_log(plugin_log, monkeypatch):
    monkeypatch.setattr(glue_log_state, "_logged", set())  # every test sees its own once-per-choice lines
    return plugin_log


@contextlib.contextmanager
def on_gpu(cc, **kernel):
    """vLLM believes it runs on a CUDA GPU ``cc`` with these kernel options (undone on exit)."""
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, cc)
        with set_current_vllm_config(vllm_config(**kernel)):
            yield


def build(fmt: str, act: str = "w4a4", *, idx: int = 0):
    """vLLM's RoutedExperts module of a MoE layer (call inside :func:`on_gpu`)."""
    runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             params_dtype=torch.bfloat16, quant_config=quant_config(fmt, act),
                             prefix=f"model.layers.{idx}.mlp.experts")
    return runner.routed_experts


# ---- a checkpoint ------------------------------------------------------------------------------------------------

class Checkpoint:
    """Expert banks as a checkpoint stores them; globals and input scales in DECODE form (amax / 2688).

    ``w13_dec [E, 2]`` per expert and part (w1 gate, w3 up); ``a13_dec [E, 2]`` and ``a2_dec [E]`` calibrated input
    scales, different per expert (and per part where ``split_inputs``).
    """

    def __init__(self, gen, *, split_globals=False, split_inputs=False):
        if split_globals:  # gate and up quantized separately: two globals per expert
            gate, d_gate = make_moe_bank(E, I, H, gen=gen)
            up, d_up = make_moe_bank(E, I, H, gen=gen, weight_std=0.08)
            self.w13 = NvFp4(torch.cat([gate.codes, up.codes], 1), torch.cat([gate.scales, up.scales], 1))
            self.w13_dec = torch.stack([d_gate, d_up], 1)
        else:  # one global shared by gate and up (what exporters write for fused weights)
            self.w13, d = make_moe_bank(E, 2 * I, H, gen=gen)
            self.w13_dec = torch.stack([d, d], 1)
        self.w2, self.w2_dec = make_moe_bank(E, H, I, gen=gen)
        amax13 = 2.0 + 4.0 * torch.rand(E, generator=gen)
        self.a13_dec = torch.stack([amax13, amax13 * (1.25 if split_inputs else 1.0)], 1) / 2688.0
        self.a2_dec = (4.0 + 6.0 * torch.rand(E, generator=gen)) / 2688.0

    def load(self, layer, fmt: str, act: str = "w4a4") -> None:
        """Write the tensors into ``layer``'s parameters (what the weight loaders end with)."""
        if fmt == "modelopt":
            layer.w13_weight.data.copy_(self.w13.codes)
            layer.w2_weight.data.copy_(self.w2.codes)
            layer.w13_weight_scale_2.data.copy_(self.w13_dec)
            layer.w2_weight_scale_2.data.copy_(self.w2_dec)
            if act == "w4a4":
                layer.w13_input_scale.data.copy_(self.a13_dec)
                layer.w2_input_scale.data.copy_(self.a2_dec)
        else:  # compressed-tensors: ENCODE globals (2688 / amax)
            layer.w13_weight_packed.data.copy_(self.w13.codes)
            layer.w2_weight_packed.data.copy_(self.w2.codes)
            layer.w13_weight_global_scale.data.copy_(1.0 / self.w13_dec)
            layer.w2_weight_global_scale.data.copy_(1.0 / self.w2_dec)
            if act == "w4a4":
                layer.w13_input_global_scale.data.copy_(1.0 / self.a13_dec)
                layer.w2_input_global_scale.data.copy_(1.0 / self.a2_dec)
        layer.w13_weight_scale.data.copy_(self.w13.scales)
        layer.w2_weight_scale.data.copy_(self.w2.scales)


def loaded(fmt, act, ckpt, cc=SM120, **kernel):
    """A layer built, loaded with ``ckpt`` and processed by vLLM on a faked GPU ``cc``."""
    with on_gpu(cc, **kernel):
        layer = build(fmt, act)
        ckpt.load(layer, fmt, act)
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def experts_of(layer):
    return layer.quant_method.moe_kernel.fused_experts


def run_experts(layer, x, topk_weights, topk_ids):
    """Our experts' ``apply`` as vLLM's modular kernel calls it (standard format, no EP)."""
    out = torch.empty_like(x)
    experts_of(layer).apply(
        out, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, MoEActivation.SILU, E, None,
        None, None, None, None, None, False,
    )
    return out


# ---- selection -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_selects_ours_on_sm120_w4a4(fmt, glue_log):
    with on_gpu(SM120):
        layer = build(fmt)
    qm = layer.quant_method
    assert qm.experts_cls is glue.Sm120NvFp4Experts
    assert qm.nvfp4_backend is glue.Sm120NvFp4Experts.backend_slot
    assert not qm.use_global_sf  # input scales per local expert
    fmt_name = glue.MODELOPT if fmt == "modelopt" else glue.COMPRESSED_TENSORS
    info = [r.getMessage() for r in glue_log.records if r.levelno == logging.INFO]
    assert info == [f"nvfp4_sm120: NVFP4 MoE layers ({fmt_name} W4A4) use Sm120NvFp4Experts (automatic on sm_12x)"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_log_line_per_choice(fmt, glue_log):
    with on_gpu(SM120):
        for idx in range(3):
            build(fmt, idx=idx)
    assert len([r for r in glue_log.records if r.levelno == logging.INFO]) == 1


@pytest.mark.parametrize("backend", ["auto", glue.BACKEND_NAME])
@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_cache_daemon_load_uses_vllm_experts(fmt, backend, glue_log):
    """The weight-cache IPC loader skips our experts' load step: the daemon (and an ipc_cache engine) pick vLLM's."""
    from vllm_nvfp4_sm120.vllm.load_modes import loading_for_weight_cache

    with on_gpu(SM120, moe_backend=backend), loading_for_weight_cache():
        layer = build(fmt)
        build(fmt, idx=1)
    assert layer.quant_method.experts_cls is not glue.Sm120NvFp4Experts
    warnings = [r.getMessage() for r in glue_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "weight-cache IPC loader (the weight cache daemon" in warnings[0], warnings


@pytest.mark.parametrize("fmt", FORMATS)
def test_not_ours_on_sm90_unless_named(fmt):
    with on_gpu(SM90):
        assert build(fmt).quant_method.experts_cls is not glue.Sm120NvFp4Experts
    with on_gpu(SM90, moe_backend="nvfp4_sm120"):
        assert build(fmt).quant_method.experts_cls is glue.Sm120NvFp4Experts


@pytest.mark.parametrize("fmt", FORMATS)
def test_w4a16_checkpoints_by_name_only(fmt):
    with on_gpu(SM120):
        assert build(fmt, "w4a16").quant_method.experts_cls is not glue.Sm120NvFp4Experts
    with on_gpu(SM120, moe_backend="nvfp4-sm120"):  # the CLI spelling with a dash normalises too
        assert build(fmt, "w4a16").quant_method.experts_cls is glue.Sm120NvFp4Experts


def test_other_backend_name_wins():
    with on_gpu(SM120, moe_backend="emulation"):
        assert build("modelopt").quant_method.experts_cls is Nvfp4QuantizationEmulationTritonExperts


def test_disabled_kernels_switch(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_DISABLED_KERNELS", ["Sm120NvFp4Experts"], raising=False)
    with on_gpu(SM120):
        assert build("modelopt").quant_method.experts_cls is not glue.Sm120NvFp4Experts


def test_named_but_unsupported_falls_back_with_warning(glue_log):
    with on_gpu(SM120, moe_backend="nvfp4_sm120"):
        runner = FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                                 params_dtype=torch.bfloat16, quant_config=quant_config("modelopt", "w4a4"),
                                 prefix="model.layers.0.mlp.experts", swiglu_limit=7.0)
    qm = runner.routed_experts.quant_method
    assert qm.experts_cls is not glue.Sm120NvFp4Experts
    assert runner.routed_experts.moe_config.moe_backend == "nvfp4_sm120"  # restored after vLLM's auto choice
    warnings = [r.getMessage() for r in glue_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "SwiGLU" in warnings[0] and "automatic choice" in warnings[0]


def test_moe_backend_name_accepted_and_unknown_rejected():
    from vllm.config import KernelConfig

    assert KernelConfig(moe_backend="nvfp4_sm120").moe_backend == "nvfp4_sm120"
    with pytest.raises(Exception):
        KernelConfig(moe_backend="nvfp4_sm121")


def test_register_idempotent_and_undone():
    import vllm.model_executor.layers.quantization.modelopt as modelopt

    patched = modelopt.select_nvfp4_moe_backend
    plugin.register()
    assert modelopt.select_nvfp4_moe_backend is patched
    plugin.unregister()
    try:
        assert modelopt.select_nvfp4_moe_backend is oracle.select_nvfp4_moe_backend
        assert "process_weights_after_loading" in vars(modelopt.ModelOptNvFp4FusedMoE)
        assert not glue.Sm120NvFp4Experts.serves(object())
    finally:
        plugin.register()


# ---- process_weights_after_loading: layout and scales ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_banks_kept_in_place(fmt, gen):
    ckpt = Checkpoint(gen)
    with on_gpu(SM120):
        layer = build(fmt)
        ckpt.load(layer, fmt)
        codes_name = "w13_weight" if fmt == "modelopt" else "w13_weight_packed"
        ptrs = {n: getattr(layer, n).data_ptr() for n in (codes_name, "w13_weight_scale", "w2_weight_scale")}
        layer.quant_method.process_weights_after_loading(layer)
    # Never a second copy of the codes: the experts read vLLM's loaded banks, gate rows then up rows.
    assert layer.w13_weight.data_ptr() == ptrs[codes_name]
    assert layer.w13_weight_scale.data_ptr() == ptrs["w13_weight_scale"]
    assert layer.w2_weight_scale.data_ptr() == ptrs["w2_weight_scale"]
    assert torch.equal(layer.w13_weight, ckpt.w13.codes) and torch.equal(layer.w2_weight, ckpt.w2.codes)
    assert not hasattr(layer, "w13_weight_packed")
    ex = experts_of(layer)
    assert isinstance(ex, glue.Sm120NvFp4Experts) and ex.expects_unquantized_inputs
    assert ex.w1_scale is layer.w13_weight_scale and ex.g1_alphas is layer.w13_weight_scale_2


# compressed-tensors' loader rejects different w1/w3 input scales; ModelOpt's keeps both ([E, 0] / [E, 1]).
@pytest.mark.parametrize("fmt, split_inputs", [("modelopt", False), ("modelopt", True), ("ct", False)])
def test_globals_and_static_scales(fmt, split_inputs, gen, glue_log):
    ckpt = Checkpoint(gen, split_inputs=split_inputs)
    layer = loaded(fmt, "w4a4", ckpt)
    # Per-expert weight decode globals (CT's encode globals inverted).
    torch.testing.assert_close(layer.w13_weight_scale_2.data, ckpt.w13_dec[:, 0])
    torch.testing.assert_close(layer.w2_weight_scale_2.data, ckpt.w2_dec)
    # One static ENCODE scale per GEMM input: 1 / the largest calibrated decode (over experts and w1/w3).
    a13_enc, a2_enc = getattr(layer, glue.A13_ENC), getattr(layer, glue.A2_ENC)
    torch.testing.assert_close(a13_enc, (1.0 / ckpt.a13_dec.max()).reshape(1))
    torch.testing.assert_close(a2_enc, (1.0 / ckpt.a2_dec.max()).reshape(1))
    ex = experts_of(layer)
    assert ex.a1_gscale is a13_enc and ex.a2_gscale is a2_enc
    if fmt == "modelopt":  # ModelOpt's decode-scale parameters keep what the checkpoint holds
        torch.testing.assert_close(layer.w13_input_scale.data, ckpt.a13_dec, rtol=0, atol=0)
    assert ex.quant_dtype == "nvfp4"
    assert not [r for r in glue_log.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_equal_vllm_emulation_backend(fmt, gen):
    """vLLM's own EMULATION conversion of the same checkpoint reduces the scales the same way (bit for bit)."""
    ckpt = Checkpoint(gen)
    ours = experts_of(loaded(fmt, "w4a4", ckpt))
    theirs = experts_of(loaded(fmt, "w4a4", ckpt, moe_backend="emulation"))
    assert isinstance(theirs, Nvfp4QuantizationEmulationTritonExperts)
    for name in ("a1_gscale", "a2_gscale", "g1_alphas", "g2_alphas"):
        torch.testing.assert_close(getattr(ours, name).reshape(-1), getattr(theirs, name).reshape(-1),
                                   rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_w4a16_checkpoint_has_no_activation_scales(fmt, gen):
    ckpt = Checkpoint(gen)
    layer = loaded(fmt, "w4a16", ckpt, moe_backend="nvfp4_sm120")
    ex = experts_of(layer)
    assert ex.a1_gscale is None and ex.a2_gscale is None and ex.quant_dtype is None
    torch.testing.assert_close(ex.g1_alphas, ckpt.w13_dec[:, 0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_w1_w3_globals_differ_warns_with_layer_name(fmt, gen, glue_log):
    ckpt = Checkpoint(gen, split_globals=True)
    layer = loaded(fmt, "w4a4", ckpt)
    torch.testing.assert_close(layer.w13_weight_scale_2.data, ckpt.w13_dec[:, 0])  # w1's, as vLLM keeps
    warnings = [r.getMessage() for r in glue_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "model.layers.0.mlp.experts" in warnings[0] and f"differ for {E} of {E} experts" in warnings[0]


def test_missing_input_scales_raise_naming_the_layer(gen):
    ckpt = Checkpoint(gen)
    ckpt.a2_dec = torch.zeros(E)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.w2_input_scale"):
        loaded("modelopt", "w4a4", ckpt)


def test_static_scales_all_reduced_across_ep_ranks(gen, monkeypatch):
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(op)
        t.mul_(2.0)  # "another rank had twice the amax"

    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(ps, "get_ep_group", lambda: type("G", (), {"device_group": None})())
    parallel = type("P", (), {"use_ep": True, "ep_size": 2})()
    dec = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    enc = scale_policy.static_input_enc(dec, "layer.w13_input_scale", parallel)
    assert calls == [torch.distributed.ReduceOp.MAX]
    torch.testing.assert_close(enc, torch.tensor([1.0 / 6.0]))
    single = type("P", (), {"use_ep": False, "ep_size": 1})()
    torch.testing.assert_close(scale_policy.static_input_enc(dec, "x", single), torch.tensor([1.0 / 3.0]))
    assert len(calls) == 1


# ---- numerics: our experts against vLLM's emulation -----------------------------------------------------------------

def vllm_emulation_moe(experts, w13, w2, x, topk_weights, topk_ids):
    """vLLM's NVFP4 emulation MoE (``Nvfp4QuantizationEmulationTritonExperts.apply``) in torch, with vLLM's own
    quant-dequant and dequantization (its Triton kernels need a GPU): bf16 operands, fp32 accumulation, bf16
    intermediates, the routing weight applied in fp32 on the down GEMM's output."""
    qc = experts.quant_config
    xq = ref_nvfp4_quant_dequant(x, qc.a1_gscale, 16)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w1e = dequantize_to_dtype(w13[e], experts.w1_scale_val[e], qc.g1_alphas[e], x.dtype, swizzle=False)
        w2e = dequantize_to_dtype(w2[e], experts.w2_scale_val[e], qc.g2_alphas[e], x.dtype, swizzle=False)
        h = (xq[tok].float() @ w1e.float().t()).to(x.dtype)
        gate, up = h.float().chunk(2, dim=-1)
        inter = ref_nvfp4_quant_dequant((torch.nn.functional.silu(gate) * up).to(x.dtype), qc.a2_gscale, 16)
        y = ((inter.float() @ w2e.float().t()) * topk_weights[tok, slot, None]).to(x.dtype)
        out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def routing(t, gen):
    weights, ids = topk_route(torch.randn(t, E, generator=gen), TOP_K)
    return weights, ids


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_format_reload_matches_fresh_load(fmt, act, gen):
    """``reload_weights(is_checkpoint_format=False)`` copies processed tensors into the parameters and runs no load
    step; our experts read parameters only, so the layer then computes what a fresh load of those weights does."""
    import types

    import vllm.model_executor.model_loader.reload.inplace as inplace

    layer = loaded(fmt, act, Checkpoint(gen), moe_backend=glue.BACKEND_NAME)  # W4A16 experts are ours by name
    fresh = loaded(fmt, act, Checkpoint(gen, split_inputs=True), moe_backend=glue.BACKEND_NAME)
    assert glue.Sm120NvFp4Experts.serves(layer.quant_method)
    held = {n: t.data_ptr() for n, t in [*layer.named_parameters(), *layer.named_buffers()]}
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=fmt), load_config=None,
                                   lora_config=None)
    weights = [(n, t.data.clone()) for n, t in fresh.named_parameters()]
    inplace.reload_weights(config, layer, iter(weights), None, is_checkpoint_format=False)

    assert {n: t.data_ptr() for n, t in [*layer.named_parameters(), *layer.named_buffers()]} == held
    now = dict([*layer.named_parameters(), *layer.named_buffers()])
    for name, t in [*fresh.named_parameters(), *fresh.named_buffers()]:
        # Bytes, not values: a W4A16 checkpoint never fills vLLM's input-scale parameters (torch.empty), so they may
        # hold NaN bit patterns, which a copy keeps and a value comparison calls unequal.
        assert now[name].dtype == t.dtype and now[name].shape == t.shape, name
        assert torch.equal(now[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name
    for t in (2, 32):  # weight-only below the W4A4 threshold, activations quantized above
        x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
        tw, ti = routing(t, gen)
        torch.testing.assert_close(run_experts(layer, x, tw, ti), run_experts(fresh, x, tw, ti), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_apply_matches_vllm_emulation(fmt, gen):
    ckpt = Checkpoint(gen)
    ours = loaded(fmt, "w4a4", ckpt)
    theirs = loaded(fmt, "w4a4", ckpt, moe_backend="emulation")
    t = 32  # 8 routes per expert: the plan quantizes activations (W4A4), as the emulation does
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    tw, ti = routing(t, gen)
    out = run_experts(ours, x, tw, ti)
    expected = vllm_emulation_moe(experts_of(theirs), theirs.w13_weight, theirs.w2_weight, x, tw, ti)
    # Same codes, same scales (bit for bit: test_scales_equal_vllm_emulation_backend), same input quantization
    # (tests/format/test_vllm_crosscheck.py).  vLLM rounds the dequantized weights, the gate_up output and the
    # activation output to bf16 where our fused epilogue keeps fp32, then both re-quantize the intermediate to FP4:
    # the rare codes and block scales that round the other way move by a whole FP4 step (up to 50% of the value).
    # Measured here: ~3% relative L2, ~4% of the largest output elementwise; our own reference with a bf16 instead
    # of an fp32 intermediate differs from itself by about half that.  Hence vLLM's own NVFP4 MoE test tolerance
    # (tests/kernels/moe/test_nvfp4_moe.py: 1e-1), relative to the output scale, plus a relative-L2 bound; the
    # exact checks are the scale test above and the reference comparison below.
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-1, atol=1e-1 * scale)
    assert float((out.float() - expected.float()).norm() / expected.float().norm()) < 0.05
    # And exactly the W4A4 reference with the layer's scales (what the op runs on CPU).
    gs = dict(a13_gs=GlobalScale.from_encode(getattr(ours, glue.A13_ENC)),
              a2_gs=GlobalScale.from_encode(getattr(ours, glue.A2_ENC)))
    ref = moe_ref(x, ckpt.w13, ckpt.w13_dec[:, 0], ckpt.w2, ckpt.w2_dec, tw, ti, **gs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_apply_w4a16_checkpoint(fmt, gen):
    ckpt = Checkpoint(gen)
    layer = loaded(fmt, "w4a16", ckpt, moe_backend="nvfp4_sm120")
    t = 32
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    tw, ti = routing(t, gen)
    out = run_experts(layer, x, tw, ti)
    torch.testing.assert_close(out, moe_ref(x, ckpt.w13, ckpt.w13_dec[:, 0], ckpt.w2, ckpt.w2_dec, tw, ti),
                               rtol=0, atol=0)


def test_apply_with_expert_map_and_router_weight_on_input(gen):
    """EP: this rank holds experts 0..E-1 of 2E; routes to the others contribute nothing."""
    ckpt = Checkpoint(gen)
    layer = loaded("modelopt", "w4a4", ckpt)
    t = 32
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    tw, ti = topk_route(torch.randn(t, 2 * E, generator=gen), TOP_K)
    expert_map = torch.cat([torch.arange(E), torch.full((E,), -1)]).to(torch.int32)
    out = torch.empty_like(x)
    experts_of(layer).apply(out, x, layer.w13_weight, layer.w2_weight, tw, ti, MoEActivation.SILU, 2 * E,
                            expert_map, None, None, None, None, None, False)
    gs = dict(a13_gs=GlobalScale.from_encode(getattr(layer, glue.A13_ENC)),
              a2_gs=GlobalScale.from_encode(getattr(layer, glue.A2_ENC)))
    ref = moe_ref(x, ckpt.w13, ckpt.w13_dec[:, 0], ckpt.w2, ckpt.w2_dec, tw, ti, expert_map=expert_map, **gs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # apply_router_weight_on_input: prepare() already scaled x, the experts route with weight 1.
    out1 = torch.empty_like(x)
    experts_of(layer).apply(out1, x, layer.w13_weight, layer.w2_weight, tw, ti, MoEActivation.SILU, 2 * E,
                            expert_map, None, None, None, None, None, True)
    ref1 = moe_ref(x, ckpt.w13, ckpt.w13_dec[:, 0], ckpt.w2, ckpt.w2_dec, torch.ones_like(tw), ti,
                   expert_map=expert_map, **gs)
    torch.testing.assert_close(out1, ref1, rtol=0, atol=0)


def test_apply_through_vllm_modular_kernel(gen, monkeypatch):
    """The whole ``FusedMoEKernel`` (prepare with deferred input quantization → our experts → no-op finalize)."""
    ckpt = Checkpoint(gen)
    layer = loaded("ct", "w4a4", ckpt)
    vllm_platform.cpu_platform(monkeypatch)  # CPU buffers instead of the CUDA workspace manager
    t = 32
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
    tw, ti = routing(t, gen)
    out = layer.quant_method.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, tw, ti, MoEActivation.SILU,
                                              E, None, False)
    torch.testing.assert_close(out, run_experts(layer, x, tw, ti), rtol=0, atol=0)


def test_compile_fullgraph_over_apply(gen):
    """``apply`` traces into one graph: the op is opaque (fake implementation), no host sync, no graph break."""
    ckpt = Checkpoint(gen)
    layer = loaded("modelopt", "w4a4", ckpt)
    ex = experts_of(layer)
    torch._dynamo.reset()

    def fwd(out, x, tw, ti):
        ex.apply(out, x, layer.w13_weight, layer.w2_weight, tw, ti, MoEActivation.SILU, E, None,
                 None, None, None, None, None, False)
        return out

    compiled = torch.compile(fwd, fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (32, 5):  # W4A4 and W4A16 plans behind the same graph (the op branches on T inside)
        x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
        tw, ti = routing(t, gen)
        got = compiled(torch.empty_like(x), x, tw, ti)
        torch.testing.assert_close(got, run_experts(layer, x, tw, ti), rtol=0, atol=0)


def test_op_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vllm_nvfp4_sm120.dispatch import moe_ops  # noqa: F401

    with FakeTensorMode():
        x = torch.empty(7, H, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        e4m3 = torch.float8_e4m3fn
        torch.ops.nvfp4_sm120.moe(
            x, torch.empty(E, 2 * I, H // 2, dtype=torch.uint8), torch.empty(E, 2 * I, H // 16, dtype=e4m3),
            torch.empty(E), torch.empty(E, H, I // 2, dtype=torch.uint8), torch.empty(E, H, I // 16, dtype=e4m3),
            torch.empty(E), torch.empty(7, TOP_K), torch.empty(7, TOP_K, dtype=torch.int32),
            torch.empty(1), torch.empty(1), None, "silu", False, out,
        )
    torch.library.opcheck(
        torch.ops.nvfp4_sm120.moe.default,
        _tiny_op_args(torch.Generator().manual_seed(0)),
        test_utils=("test_faketensor",),
    )


def _tiny_op_args(gen):
    w13, d13 = make_moe_bank(2, 32, 32, gen=gen)
    w2, d2 = make_moe_bank(2, 32, 16, gen=gen)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    tw, ti = topk_route(torch.randn(3, 2, generator=gen), 1)
    return (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, None, None, None, "silu", False,
            torch.empty_like(x))


# ---- GPU: CUDA graph capture + replay (needs a CUDA GPU *and* vLLM) --------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_cuda_graph_capture_replay(act, gen):
    """The real kernels behind the vLLM experts class: eager vs the reference, then capture + replay vs eager."""
    ckpt = Checkpoint(gen)
    with set_current_vllm_config(vllm_config(moe_backend="nvfp4_sm120")):  # the real CUDA platform
        layer = build("modelopt", act)
        ckpt.load(layer, "modelopt", act)
        layer.to("cuda")
        layer.quant_method.process_weights_after_loading(layer)
    ex = experts_of(layer)
    assert isinstance(ex, glue.Sm120NvFp4Experts)
    for t in (4, 64):  # decode-sized (W4A16 plan) and prefill-sized (W4A4 plan where the checkpoint allows)
        x = torch.randn(t, H, generator=gen).to(torch.bfloat16).cuda()
        tw, ti = (v.cuda() for v in routing(t, gen))
        out = torch.empty_like(x)

        def step():
            ex.apply(out, x, layer.w13_weight, layer.w2_weight, tw, ti, MoEActivation.SILU, E, None,
                     None, None, None, None, None, False)

        step()
        eager = out.clone()
        kw = {}
        if act == "w4a4" and t * TOP_K / E >= W4A4_MIN_TOKENS_PER_EXPERT:
            kw = dict(a13_gs=GlobalScale.from_encode(getattr(layer, glue.A13_ENC).cpu()),
                      a2_gs=GlobalScale.from_encode(getattr(layer, glue.A2_ENC).cpu()))
        ref = moe_ref(x.cpu(), ckpt.w13, ckpt.w13_dec[:, 0], ckpt.w2, ckpt.w2_dec, tw.cpu(), ti.cpu(), **kw)
        atol = 2.0**-10 * float(ref.float().abs().max())  # fp32 summation order (tests/dispatch/test_moe_flow.py)
        torch.testing.assert_close(eager.cpu(), ref, atol=atol, rtol=2.0**-9)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # warm up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        out.zero_()
        with torch.cuda.graph(graph):
            step()
        x.copy_(torch.randn(t, H, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        step()
        torch.testing.assert_close(replayed, out, atol=atol, rtol=2.0**-9)
