"""Global scales of fused and MoE weights: one per part / per expert, in either convention, reduced and expanded."""

import pytest
import torch

from vllm_nvfp4_sm120.format import GlobalScale, make_linear, per_row_decode


@pytest.mark.parametrize("shape", [(3,), (8,), (8, 2)])
def test_vector_globals_in_both_conventions(shape, gen):
    dec = (1.0 + torch.rand(shape, generator=gen)) / 2688.0
    modelopt = GlobalScale.from_decode(dec, per_tensor=False)  # w13_weight_scale_2 [E, 2], input_scale [E]
    ct = GlobalScale.from_encode(1.0 / dec, per_tensor=False)  # w13_weight_global_scale, input_global_scale
    assert modelopt.dec.shape == ct.enc.shape == shape and modelopt.dec.dtype == torch.float32
    torch.testing.assert_close(modelopt.dec, dec, rtol=0, atol=0)
    torch.testing.assert_close(ct.dec, 1.0 / (1.0 / dec), rtol=0, atol=0)  # one fp32 inversion, as vLLM's
    torch.testing.assert_close(modelopt.enc, 1.0 / dec, rtol=0, atol=0)


def test_vector_globals_are_detached_from_parameters():
    p = torch.nn.Parameter(torch.tensor([1e-3, 2e-3]), requires_grad=False)
    gs = GlobalScale.from_decode(p, per_tensor=False)
    assert type(gs.dec) is torch.Tensor and gs.dec.data_ptr() == p.data_ptr()


def test_max_is_the_largest_decode():
    gs = GlobalScale.from_encode(torch.tensor([[400.0, 500.0], [300.0, 800.0]]), per_tensor=False)
    top = gs.max()
    assert top.dec.shape == () and float(top.enc) == 300.0
    with pytest.raises(ValueError, match="finite and > 0"):
        GlobalScale.from_decode(torch.zeros(4), per_tensor=False).max()


@pytest.mark.parametrize("decs, spread", [([1e-4], 0.0), ([1e-4, 1e-4], 0.0), ([1e-4, 1.25e-4, 1.1e-4], 0.25)])
def test_spread(decs, spread):
    assert GlobalScale.from_decode(torch.tensor(decs), per_tensor=False).spread() == pytest.approx(spread)


def test_per_row_decode_from_one_part_or_row_global(gen):
    widths = [4, 2, 2]
    parts = torch.tensor([1.0, 2.0, 3.0])
    rows = per_row_decode(parts, widths, 8)
    assert rows.is_contiguous() and rows.tolist() == [1.0] * 4 + [2.0] * 2 + [3.0] * 2
    assert per_row_decode(0.5, widths, 8).tolist() == [0.5] * 8 and per_row_decode(0.5, None, 8).is_contiguous()
    assert per_row_decode(rows, widths, 8).tolist() == rows.tolist()
    with pytest.raises(ValueError, match="sum to 8, weight has 9 rows"):
        per_row_decode(parts, widths, 9)
    with pytest.raises(ValueError, match="one per part"):
        per_row_decode(torch.ones(2), widths, 8)
    p = make_linear(48, 32, gen=gen, logical_widths=[16, 32])
    torch.testing.assert_close(p.dec_rows, per_row_decode(p.parts_gs.dec, p.logical_widths, 48), rtol=0, atol=0)
    torch.testing.assert_close(p.weight_gs.dec, p.parts_gs.dec.max(), rtol=0, atol=0)
