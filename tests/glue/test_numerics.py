"""The batch numerics policy from the environment: ``VLLM_NVFP4_SM120_DECODE`` and vLLM's ``VLLM_BATCH_INVARIANT``,
read at a layer's load and followed by the op (``dispatch/policy.py``)."""

from __future__ import annotations

import pytest
import torch
from vllm.config import set_current_vllm_config

import nvfp4_layers as NL
from vllm_nvfp4_sm120.dispatch import policy as P
from vllm_nvfp4_sm120.vllm.numerics import DECODE_ENV, apply_numerics_policy
from vllm_platform import fake_cuda, vllm_config

pytestmark = pytest.mark.usefixtures("registered", "tp_group")


@pytest.fixture(autouse=True)
def default_policy(monkeypatch):
    monkeypatch.delenv(DECODE_ENV, raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    P.set_policy(P.DEFAULT)
    yield
    P.set_policy(P.DEFAULT)


@pytest.mark.parametrize("env, expected", [
    ({}, P.NumericsPolicy()),
    ({DECODE_ENV: "w4a16"}, P.NumericsPolicy()),
    ({DECODE_ENV: "w4a4"}, P.NumericsPolicy(decode=P.Decode.W4A4)),
    ({"VLLM_BATCH_INVARIANT": "1"}, P.NumericsPolicy(batch_invariant=True)),
    ({DECODE_ENV: "w4a4", "VLLM_BATCH_INVARIANT": "1"}, P.NumericsPolicy(P.Decode.W4A4, True)),
])
def test_environment_sets_the_policy(monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert apply_numerics_policy() == expected == P.current_policy()


def test_invalid_decode_value_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(DECODE_ENV, "fp8")
    with pytest.raises(ValueError, match=rf"^{DECODE_ENV}='fp8': expected one of \['w4a16', 'w4a4'\]$"):
        apply_numerics_policy()
    assert P.current_policy() == P.DEFAULT


def _loaded_layer(fmt: str):
    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(vllm_config()):
        fake_cuda(mp, (12, 0))
        layer = NL.build_layer(NL.quant_config(fmt, "w4a4"), "qkv")
        NL.load_checkpoint(layer, fmt, NL.problem_for(layer, torch.Generator().manual_seed(3)))
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def _row_change(layer) -> float:
    """How far one token's output moves between a batch of 1 and a batch of 40 (the same token first in both)."""
    x = torch.randn(40, layer.weight.shape[1] * 2, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with set_current_vllm_config(vllm_config()):
        one = layer.quant_method.apply(layer, x[:1])[0].float()
        batch = layer.quant_method.apply(layer, x)[0].float()
    return float((one - batch).norm() / batch.norm())


@pytest.mark.parametrize("fmt", ["modelopt", "ct"])
def test_a_layer_follows_the_environment(monkeypatch, fmt):
    """Default: a W4A4 layer runs weight-only at T = 1 and W4A4 at T = 40, so the token's output moves; with
    ``VLLM_NVFP4_SM120_DECODE=w4a4`` set when the layer loads it runs W4A4 at both."""
    assert _row_change(_loaded_layer(fmt)) > 0.02
    monkeypatch.setenv(DECODE_ENV, "w4a4")
    layer = _loaded_layer(fmt)
    assert P.current_policy().decode is P.Decode.W4A4
    assert _row_change(layer) < 2.0**-7


def test_invalid_value_fails_the_load(monkeypatch):
    monkeypatch.setenv(DECODE_ENV, "w4a8")
    with pytest.raises(ValueError, match=DECODE_ENV):
        _loaded_layer("modelopt")
