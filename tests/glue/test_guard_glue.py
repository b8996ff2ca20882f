"""The numerics guard at a layer's load (``process_weights_after_loading``): a kernel that fails it on this device
hands the layer to vLLM's own kernel with one error line; ``VLLM_NVFP4_SM120_GUARD=strict`` fails the load, ``=0``
skips the check.  On CPU the guard is forced, with the registry's launchers replaced by the exact reference and
one of them by a deliberately wrong kernel (``tests/dispatch/test_guard.py`` checks the guard itself)."""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.config import set_current_vllm_config

import nvfp4_layers as NL
from vllm_nvfp4_sm120.dispatch import guard as G
from vllm_nvfp4_sm120.dispatch import linear_call, ops, registry  # noqa: F401  (ops registers the op)
from vllm_nvfp4_sm120.dispatch.linear import LinearKernel, LinearPlan
from vllm_nvfp4_sm120.vllm import linear as ours
from vllm_nvfp4_sm120.vllm import numerics
from vllm_platform import fake_cuda, vllm_config
import vllm_nvfp4_sm120.vllm.log as glue_log_state

pytestmark = pytest.mark.usefixtures("registered", "tp_group")


@pytest.fixture
def forced(monkeypatch):
    """The guard forced on CPU tensors, every linear launcher exact; returns ``break_(kernel)`` and the calls."""
    monkeypatch.setattr(numerics, "FORCE_GUARD", True)
    monkeypatch.delenv(numerics.GUARD_ENV, raising=False)
    monkeypatch.setattr(glue_log_state, "_logged", set())
    G.clear_cache()
    calls = []

    def stand_in(kernel, factor=1.0):
        def run(x, w_codes, w_scales, w_dec_rows, swizzled, in_enc, alpha, bias, **tile):
            calls.append(kernel)
            ref = linear_call.plan_reference(LinearPlan(kernel), x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias)
            return ref * factor
        return run

    for kernel in LinearKernel:
        monkeypatch.setitem(registry.LINEAR_KERNELS, kernel, stand_in(kernel))
    # vLLM's next kernel on the faked sm_120 would be a CUDA one; leave it its emulation kernel, which runs here.
    from vllm.model_executor.kernels import linear as L
    from vllm.platforms import PlatformEnum

    theirs = [c.__name__ for c in L._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]
              if c not in ours.KERNEL_CLASSES and c.__name__ != "EmulationNvFp4LinearKernel"]
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", ",".join(theirs))
    yield (lambda kernel: monkeypatch.setitem(registry.LINEAR_KERNELS, kernel, stand_in(kernel, 1.25))), calls
    G.clear_cache()


def _load(fmt="modelopt", kind="qkv"):
    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(vllm_config()):
        fake_cuda(mp, (12, 0))
        layer = NL.build_layer(NL.quant_config(fmt, "w4a4"), kind)
        NL.load_checkpoint(layer, fmt, NL.problem_for(layer, torch.Generator().manual_seed(7)))
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def _guard_errors(caplog):
    return [r for r in caplog.records if r.levelno == logging.ERROR and "numerics guard" in r.getMessage()]


def test_passing_guard_keeps_our_kernel(forced, plugin_log):
    _, calls = forced
    layer = _load()
    kernel = NL.kernel_of(layer)
    assert isinstance(kernel, ours.Sm120TritonNvFp4LinearKernel) and kernel._fallback is None
    assert calls and not _guard_errors(plugin_log)


@pytest.mark.parametrize("fmt, kind", [("modelopt", "qkv"), ("ct", "gate_up")])
def test_failing_kernel_falls_back_to_vllm_with_one_line(forced, plugin_log, fmt, kind):
    break_, _ = forced
    break_(LinearKernel.W4A4_TRITON)
    layer = _load(fmt, kind)
    kernel = NL.kernel_of(layer)
    assert isinstance(kernel, ours.Sm120TritonNvFp4LinearKernel)
    fallback = kernel._fallback
    assert type(fallback).__name__ == "EmulationNvFp4LinearKernel", fallback
    (line,) = _guard_errors(plugin_log)
    msg = line.getMessage()
    assert layer.prefix in msg and "w4a4_triton(" in msg and "CPU (forced)" in msg and "\n" not in msg
    assert type(fallback).__name__ in msg and "worst row error" in msg
    # The layer serves through vLLM's kernel on the checkpoint's own tensors.
    x = torch.randn(5, layer.weight.shape[1] * 2, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with set_current_vllm_config(vllm_config()):
        assert torch.isfinite(layer.quant_method.apply(layer, x)).all()
    # A second layer of the shape falls back from the cached result, without a second line.
    assert NL.kernel_of(_load(fmt, kind))._fallback is not None and len(_guard_errors(plugin_log)) == 1


def test_strict_fails_the_load(forced, monkeypatch):
    break_, _ = forced
    break_(LinearKernel.W4A4_TRITON)
    monkeypatch.setenv(numerics.GUARD_ENV, "strict")
    with pytest.raises(G.NumericsGuardError, match=r"^NVFP4 layer model\.layers\.0\.self_attn\.qkv_proj: .*strict"):
        _load()


def test_off_skips_and_bad_value_fails(forced, monkeypatch):
    break_, calls = forced
    break_(LinearKernel.W4A4_TRITON)
    monkeypatch.setenv(numerics.GUARD_ENV, "0")
    assert NL.kernel_of(_load())._fallback is None and calls == []
    monkeypatch.setenv(numerics.GUARD_ENV, "yes please")
    with pytest.raises(ValueError, match=numerics.GUARD_ENV):
        _load()


def test_not_forced_on_cpu_is_a_no_op(forced, monkeypatch):
    break_, calls = forced
    break_(LinearKernel.W4A4_TRITON)
    monkeypatch.setattr(numerics, "FORCE_GUARD", False)
    assert NL.kernel_of(_load())._fallback is None and calls == []


# ---- MoE layers ---------------------------------------------------------------------------------------------------

@pytest.fixture
def moe_forced(monkeypatch):
    """The MoE guard forced on CPU (the interpreter runs the real Triton kernels), its plans limited to T <= 16 in
    fp16, and the W4A16 plans given the GPU's inline-PTX decode, whose gate_up launcher is made wrong."""
    from vllm_nvfp4_sm120.dispatch import policy

    monkeypatch.setattr(numerics, "FORCE_GUARD", True)
    monkeypatch.delenv(numerics.GUARD_ENV, raising=False)
    monkeypatch.setattr(glue_log_state, "_logged", set())
    G.clear_cache()
    policy.clear_substitutes()
    NL.guard_moe_on_cpu(monkeypatch, 1.5)
    yield
    G.clear_cache()
    policy.clear_substitutes()


def _moe_layer(fmt="modelopt"):
    from test_moe_glue import Checkpoint, loaded

    return loaded(fmt, "w4a4", Checkpoint(torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("fmt", ["modelopt", "ct"])
def test_moe_failing_plan_falls_back_with_one_line(moe_forced, plugin_log, fmt):
    from vllm_nvfp4_sm120.dispatch.hw import NO_GPU
    from vllm_nvfp4_sm120.dispatch.moe import select_moe_plan

    layer = _moe_layer(fmt)
    (line,) = _guard_errors(plugin_log)
    msg = line.getMessage()
    assert "model.layers.0.mlp.experts" in msg and "moe w4a16/triton" in msg and "exact-decode" in msg, msg
    assert "\n" not in msg
    # The layer's W4A16 calls now run the plain decode (the substitution the selector applies).
    h, i = layer.w13_weight.shape[2] * 2, layer.w2_weight.shape[2] * 2
    plan = select_moe_plan(NO_GPU, num_tokens=1, top_k=2, global_experts=8, hidden=h, intermediate=i, w4a4=True)
    assert not plan.fast_decode and plan.tier.endswith("/exact-decode")


def test_moe_strict_fails_the_load(moe_forced, monkeypatch):
    monkeypatch.setenv(numerics.GUARD_ENV, "strict")
    with pytest.raises(G.NumericsGuardError, match=r"^NVFP4 MoE layer model\.layers\.0\.mlp\.experts: .*strict"):
        _moe_layer()
