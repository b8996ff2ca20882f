"""The activation quantizer's traffic twin (benchmarks/act_quant_ceiling.py), on CPU in the interpreter: it writes
exactly the bytes its torch reference says, on the dispatch's tiles and ragged shapes, so a device run cannot time a
kernel that skips part of the traffic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from vllm_nvfp4_sm120.dispatch.linear import act_quant_config

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "act_quant_ceiling.py"
_spec = importlib.util.spec_from_file_location("act_quant_ceiling", _PATH)
twin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twin)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("t,k", [(64, 1024), (67, 2048 + 48), (9, 5120)])
def test_traffic_twin_writes_every_byte_it_stands_for(gen, t, k):
    tile = act_quant_config(t, k)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    codes = torch.full((t, k // 2), 0xAA, dtype=torch.uint8)
    sf = torch.full((t, k // 16), 0xAA, dtype=torch.uint8)
    want_codes, want_sf = twin.traffic_twin_ref(x)
    got_codes, got_sf = twin.traffic_twin(x, codes, sf, **tile)
    torch.testing.assert_close(got_codes, want_codes, rtol=0, atol=0)
    torch.testing.assert_close(got_sf, want_sf, rtol=0, atol=0)
    x.view(torch.int16)[t // 2, k // 3] ^= 1  # one changed bit anywhere changes a code byte
    again = twin.traffic_twin(x, codes.clone(), sf.clone(), **tile)
    assert not torch.equal(again[0], want_codes)


def test_the_script_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(twin.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        twin.main([])
