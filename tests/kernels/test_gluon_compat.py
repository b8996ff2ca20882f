"""The Gluon version shim and the switch that turns every Gluon kernel off."""

import pytest

from vllm_nvfp4_sm120.kernels import gluon_compat as compat


def test_triton_has_gluon():
    assert compat.HAS_GLUON, f"Triton {compat.TRITON_VERSION} has no usable Gluon; the Gluon kernels need >= 3.6"
    assert compat.gluon_enabled() in (True, False)


@pytest.mark.parametrize("value,enabled", [("1", False), ("true", False), ("ON", False), ("0", True), ("", True)])
def test_disable_switch(monkeypatch, value, enabled):
    monkeypatch.setenv(compat.ENV_DISABLE, value)
    assert compat.gluon_enabled() is (enabled and compat.HAS_GLUON)


def test_disable_switch_is_read_on_every_call(monkeypatch):
    monkeypatch.delenv(compat.ENV_DISABLE, raising=False)
    before = compat.gluon_enabled()
    monkeypatch.setenv(compat.ENV_DISABLE, "1")
    assert before is compat.HAS_GLUON and compat.gluon_enabled() is False


def test_version_drift_names_resolve():
    # 3.8 renamed the TMA copies; whichever wheel is installed, the shim's names are Gluon builtins.
    for fn in (compat.tma_async_load, compat.tma_async_store, compat.mbarrier_expect, compat.warp_specialize):
        assert callable(fn) and getattr(fn, "__triton_builtin__", False), fn
    assert compat.DOT_SCALED_FORMAT_IS_CONSTEXPR is (compat.TRITON_VERSION[:2] <= (3, 7))


def test_ptx_isa_version_follows_the_bundled_ptxas(monkeypatch):
    # Triton 3.8 ships ptxas-blackwell 13.3 (PTX 9.3) for sm_100+: enough for cvt.rn.bf16x2.e2m1x2 (needs 9.2).
    # (FlashInfer's import may have pointed Triton at a system ptxas: ask about the bundled one.)
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    v = compat.ptx_isa_version(120)
    assert v >= 87, v
    if compat.TRITON_VERSION[:2] >= (3, 8):
        assert v >= 92, v


def test_parse_version():
    assert compat._parse_version("3.8.0") == (3, 8, 0)
    assert compat._parse_version("3.9.0+git1234") == (3, 9, 0)
    assert compat._parse_version("3.6") == (3, 6, 0)


def test_native_decode_only_where_the_ptx_isa_has_it():
    import torch

    from vllm_nvfp4_sm120.kernels.gluon_common import DECODE_CVT, DECODE_PORTABLE, decode_for

    assert decode_for(12, torch.bfloat16, 93) == DECODE_CVT
    assert decode_for(12, torch.bfloat16, 90) == DECODE_PORTABLE  # CUDA 13.0's ptxas (what FlashInfer selects)
    assert decode_for(12, torch.float16, 90) == DECODE_CVT  # f16x2.e2m1x2 needs only PTX 8.7
    assert decode_for(9, torch.float16, 93) == DECODE_PORTABLE  # no e2m1 cvt on sm_90
