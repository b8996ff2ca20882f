"""The batch numerics policy: ``decode = w4a4`` and batch-invariant mode in the selectors and through the ops.

In batch-invariant mode a row's output must be bitwise the same whatever batch it is in (``torch.equal``), through
``torch.ops.nvfp4_sm120.linear`` and ``torch.ops.nvfp4_sm120.moe``; without it, on a W4A4 layer, small batches run
weight-only and the same row moves by several percent of its norm (the controls below show the test can fail).
"""

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import moe_ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.moe)
from vllm_nvfp4_sm120.dispatch import ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.linear)
from vllm_nvfp4_sm120.dispatch import policy as P
from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE, Capability
from vllm_nvfp4_sm120.dispatch.linear import ROUTES, W4A4_ROUTES, Route, select_linear
from vllm_nvfp4_sm120.dispatch.moe import MoeKernel, select_moe_plan
from vllm_nvfp4_sm120.format import GlobalScale, make_linear, make_moe_bank, topk_route
from vllm_nvfp4_sm120.format.swizzle import swizzle_128x4

TS = (1, 3, 16, 17, 64)
SELECT_TS = (1, 2, 3, 8, 9, 16, 17, 32, 33, 64, 65, 128, 255, 256, 1024, 8192)
SM90 = Capability(90, 132, "NVIDIA H200")
BATCH_INVARIANT = P.NumericsPolicy(batch_invariant=True)
DECODE_W4A4 = P.NumericsPolicy(decode=P.Decode.W4A4)


@pytest.fixture(autouse=True)
def default_policy():
    P.set_policy(P.DEFAULT)
    yield
    P.set_policy(P.DEFAULT)


# ---- the policy values -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [(None, "w4a16"), ("", "w4a16"), ("w4a16", "w4a16"), (" W4A4 ", "w4a4")])
def test_parse_decode(value, expected):
    assert P.parse_decode(value) == expected


@pytest.mark.parametrize("value", ["w4a8", "fp4", "1"])
def test_parse_decode_rejects_other_values(value):
    with pytest.raises(ValueError, match=rf"^VLLM_NVFP4_SM120_DECODE='{value}': expected one of \['w4a16', 'w4a4'\]$"):
        P.parse_decode(value, "VLLM_NVFP4_SM120_DECODE")


def test_set_policy_type():
    with pytest.raises(TypeError, match="expected a NumericsPolicy"):
        P.set_policy("w4a4")


# ---- the selectors ----------------------------------------------------------------------------------------------

def _routes(cap):
    return [r for r in ROUTES if r in (W4A4_ROUTES if cap.cc == 120 else (Route.TRITON,)) or r is Route.W4A16]


@pytest.mark.parametrize("cap", [SM120_REFERENCE, SM90], ids=["sm120", "sm90"])
def test_default_runs_weight_only_at_decode_sizes(cap):
    assert not select_linear(cap, Route.TRITON, 1, 4096, 4096).is_w4a4
    assert select_linear(cap, Route.TRITON, 64, 4096, 4096).is_w4a4


@pytest.mark.parametrize("cap", [SM120_REFERENCE, SM90], ids=["sm120", "sm90"])
def test_decode_w4a4_keeps_w4a4_routes_on_w4a4(cap):
    P.set_policy(DECODE_W4A4)
    for route in _routes(cap):
        w4a4 = {select_linear(cap, route, t, 4096, 4096).is_w4a4 for t in SELECT_TS}
        assert w4a4 == {route in W4A4_ROUTES}, route


@pytest.mark.parametrize("cap", [SM120_REFERENCE, SM90], ids=["sm120", "sm90"])
def test_batch_invariant_linear_is_one_plan_without_split_k(cap):
    P.set_policy(BATCH_INVARIANT)
    for route in _routes(cap):
        plans = {select_linear(cap, route, t, n, 4096) for t in SELECT_TS for n in (512, 4096)}
        (plan,) = plans
        assert plan.is_w4a4 == (route in W4A4_ROUTES), route
        assert "split_k" not in plan.kwargs and plan.kernel in ("w4a4_triton", "w4a16_gemm"), plan


@pytest.mark.parametrize("cap", [SM120_REFERENCE, SM90], ids=["sm120", "sm90"])
def test_moe_policies(cap):
    shape = dict(top_k=8, global_experts=128, hidden=2048, intermediate=768)
    plan = lambda t, w4a4=True: select_moe_plan(cap, num_tokens=t, w4a4=w4a4, **shape)  # noqa: E731
    assert plan(1).kernel == MoeKernel.W4A16 and plan(1024).kernel == MoeKernel.W4A4
    P.set_policy(DECODE_W4A4)
    assert {plan(t).kernel for t in SELECT_TS} == {MoeKernel.W4A4}
    assert {plan(t, w4a4=False).kernel for t in SELECT_TS} == {MoeKernel.W4A16}
    assert len({plan(t) for t in SELECT_TS}) > 1  # tiles still follow T
    P.set_policy(BATCH_INVARIANT)
    for w4a4 in (True, False):
        (one,) = {plan(t, w4a4) for t in SELECT_TS}
        assert one.kernel == (MoeKernel.W4A4 if w4a4 else MoeKernel.W4A16) and one.impl == "triton"


# ---- bitwise row invariance through the ops (CPU) ---------------------------------------------------------------

def _linear_outputs(route, gen):
    p = make_linear(48, 512, gen=gen, logical_widths=[16, 32])
    x = torch.randn(max(TS), 512, generator=gen).to(torch.bfloat16)
    alpha = p.input_gs.dec * p.weight_gs.dec
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    swizzled = swizzle_128x4(p.scales) if route in ("cublas", "b12x") else None  # those routes' scale layout
    return {t: torch.ops.nvfp4_sm120.linear(x[:t], p.codes, p.scales, p.dec_rows, swizzled, p.input_gs.enc, alpha,
                                            bias, route) for t in TS}


def _moe_outputs(gen, *, w4a4=True):
    e, h, i, top_k = 4, 256, 64, 2
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, d2 = make_moe_bank(e, h, i, gen=gen)
    x = torch.randn(max(TS), h, generator=gen).to(torch.bfloat16)
    tw, ti = topk_route(torch.randn(max(TS), e, generator=gen), top_k)
    a13, a2 = (GlobalScale.from_amax(4.0).enc.reshape(1), GlobalScale.from_amax(2.0).enc.reshape(1)) if w4a4 \
        else (None, None)
    outs = {}
    for t in TS:
        out = torch.empty(t, h, dtype=torch.bfloat16)
        torch.ops.nvfp4_sm120.moe(x[:t], w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw[:t], ti[:t], a13, a2,
                                  None, "silu", False, out)
        outs[t] = out
    return outs


def _assert_rows_equal(outs):
    full = outs[max(TS)]
    for t, out in outs.items():
        assert torch.equal(out, full[:t]), f"T = {t}: rows differ from the same rows at T = {max(TS)}"


@pytest.mark.parametrize("route", ["triton", "cublas", "b12x", "w4a16"])
def test_linear_rows_batch_invariant(route, gen):
    P.set_policy(BATCH_INVARIANT)
    _assert_rows_equal(_linear_outputs(route, gen))


@pytest.mark.parametrize("w4a4", [True, False], ids=["w4a4", "w4a16"])
def test_moe_rows_batch_invariant(w4a4, gen):
    P.set_policy(BATCH_INVARIANT)
    _assert_rows_equal(_moe_outputs(gen, w4a4=w4a4))


def _relative_row_change(outs):
    """How far row 0 moves between T = 1 and the largest T, relative to its norm."""
    a, b = outs[1][0].float(), outs[max(TS)][0].float()
    return float((a - b).norm() / b.norm())


def test_controls_default_policy_moves_rows(gen):
    """Without the mode, a W4A4 layer's row depends on the batch: weight-only at T = 1, W4A4 at T = 64."""
    assert _relative_row_change(_linear_outputs("triton", gen)) > 0.02
    assert _relative_row_change(_moe_outputs(gen)) > 0.02


def test_decode_w4a4_keeps_the_numerics(gen):
    """``decode = w4a4``: the same numerics at every T (the rows agree up to the CPU matmul's summation order)."""
    P.set_policy(DECODE_W4A4)
    for outs in (_linear_outputs("triton", gen), _moe_outputs(gen)):
        assert _relative_row_change(outs) < 2.0**-7
        for t, out in outs.items():
            torch.testing.assert_close(out, outs[max(TS)][:t], rtol=2.0**-7, atol=2.0**-8 * float(out.abs().max()))


# ---- the same on a GPU's kernels ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("route", ["triton", "w4a16"])
def test_gpu_linear_rows_batch_invariant(route, gen):
    from vllm_nvfp4_sm120.format.testing import random_nvfp4

    P.set_policy(BATCH_INVARIANT)
    n, k = 1024, 2048
    w = random_nvfp4([n, k], gen=gen, device="cuda")
    dec = torch.full((n,), 0.01, device="cuda")
    x = torch.randn(max(TS), k, generator=gen).to(torch.bfloat16).cuda()
    enc, alpha = torch.tensor(448 * 6 / 4.0, device="cuda"), torch.tensor(0.01 * 4.0 / (448 * 6), device="cuda")
    outs = {t: torch.ops.nvfp4_sm120.linear(x[:t], w.codes, w.scales, dec, None, enc, alpha, None, route) for t in TS}
    _assert_rows_equal(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("w4a4", [True, False], ids=["w4a4", "w4a16"])
def test_gpu_moe_rows_batch_invariant(w4a4, gen):
    from vllm_nvfp4_sm120.format.testing import random_nvfp4

    P.set_policy(BATCH_INVARIANT)
    e, h, i, top_k = 8, 1024, 512, 2
    w13, w2 = random_nvfp4([e, 2 * i, h], gen=gen, device="cuda"), random_nvfp4([e, h, i], gen=gen, device="cuda")
    d = torch.full((e,), 0.01, device="cuda")
    x = torch.randn(max(TS), h, generator=gen).to(torch.bfloat16).cuda()
    tw, ti = topk_route(torch.randn(max(TS), e, generator=gen), top_k)
    tw, ti = tw.cuda(), ti.cuda()
    a = torch.tensor([448 * 6 / 4.0], device="cuda") if w4a4 else None
    outs = {}
    for t in TS:
        out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
        torch.ops.nvfp4_sm120.moe(x[:t], w13.codes, w13.scales, d, w2.codes, w2.scales, d, tw[:t], ti[:t], a, a,
                                  None, "silu", False, out)
        outs[t] = out
    _assert_rows_equal(outs)
