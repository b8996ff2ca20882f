"""Peer adapters (vllm_nvfp4_sm120/peers.py): a clean reason without the peer, and what is passed to it."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vllm_nvfp4_sm120 import peers
from vllm_nvfp4_sm120.format import GlobalScale, linear_w4a16_ref, make_linear


def test_gemlite_absent_gives_a_one_line_reason(gen, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemlite", None)  # import gemlite raises ImportError
    monkeypatch.setitem(sys.modules, "gemlite.helper", None)
    p = make_linear(32, 64, gen=gen)
    reason = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.part_globals[0])
    assert isinstance(reason, str) and reason.startswith("gemlite not importable") and "\n" not in reason


def test_gemlite_refuses_different_part_globals(gen):
    p = make_linear(32, 64, gen=gen, logical_widths=[16, 16])
    assert not torch.equal(p.dec_rows[:1].expand(32), p.dec_rows)
    reason = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.dec_rows)
    assert isinstance(reason, str) and "one global per layer" in reason


@pytest.fixture
def fake_gemlite(monkeypatch):
    """gemlite.helper.A16W4_NVFP as its source defines the interface, recording what it is given."""
    calls = {}

    class A16W4_NVFP:
        def __init__(self, device="cuda:0", dtype=None):
            calls["init"] = (device, dtype)

        def from_packed_weights(self, weight_packed, bias=None, scales=None, meta_scale=None):
            calls["weights"] = (weight_packed, bias, scales, meta_scale)
            return lambda x: ("layer output", x)

    helper = types.ModuleType("gemlite.helper")
    helper.A16W4_NVFP = A16W4_NVFP
    gemlite = types.ModuleType("gemlite")
    gemlite.helper = helper
    monkeypatch.setitem(sys.modules, "gemlite", gemlite)
    monkeypatch.setitem(sys.modules, "gemlite.helper", helper)
    return calls


@pytest.mark.parametrize("per_row", [False, True])
def test_gemlite_gets_our_codes_scales_and_the_encode_global(gen, fake_gemlite, per_row):
    p = make_linear(32, 64, gen=gen)
    bias = torch.randn(32, generator=gen).to(torch.float16)
    gs = p.part_globals[0]
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.dec_rows if per_row else gs, dtype=torch.float16,
                                       bias=bias)
    assert layer("x") == ("layer output", "x")
    assert fake_gemlite["init"] == (p.codes.device, torch.float16)
    codes, b, scales, meta = fake_gemlite["weights"]
    assert codes is p.codes and scales is p.scales and b is bias  # no copy, no repack
    # gemlite dequantizes as W_q * scale / meta_scale: meta_scale is the encode global
    torch.testing.assert_close(meta, gs.enc, rtol=1e-6, atol=0)
    torch.testing.assert_close(1.0 / meta, gs.dec, rtol=1e-6, atol=0)


def test_gemlite_checks_its_inputs(gen):
    p = make_linear(32, 64, gen=gen)
    with pytest.raises(TypeError, match="codes: expected dtype"):
        peers.gemlite_nvfp4_linear(p.codes.int(), p.scales, p.part_globals[0])
    with pytest.raises(ValueError, match="scales: expected shape"):
        peers.gemlite_nvfp4_linear(p.codes, p.scales[:, :2], p.part_globals[0])


@pytest.mark.gpu
def test_gpu_gemlite_matches_our_reference(gen):
    p = make_linear(256, 1024, gen=gen).to("cuda")
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, GlobalScale.from_decode(p.part_globals[0].dec),
                                       dtype=torch.bfloat16)
    if isinstance(layer, str):
        pytest.skip(layer)
    x = torch.randn(3, 1024, generator=gen).to(torch.bfloat16).cuda()
    torch.testing.assert_close(layer(x), linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows), rtol=1.6e-2, atol=1e-3)
