"""The load-time numerics guard (``dispatch/guard.py``): its tolerance, its cache, strict and off modes, and the
fallback when a kernel is wrong.

On CPU the guard is forced (``force=True``) and runs the registry's launchers on CPU tensors: for linears every
entry is replaced by the exact reference of its kind, and one by a deliberately wrong kernel; for MoE layers the
real Triton kernels run in the interpreter, with one launcher variant made wrong.  The ``gpu`` tests run the
guard on the real kernels of the GPU present.
"""

from dataclasses import replace

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import guard as G
from vllm_nvfp4_sm120.dispatch import moe as M
from vllm_nvfp4_sm120.dispatch import linear_call, ops, policy, registry  # noqa: F401  (ops registers the op)
from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE, Capability
from vllm_nvfp4_sm120.dispatch.linear import LinearKernel, LinearPlan, Route, select_linear
from vllm_nvfp4_sm120.dispatch.moe import Impl, MoeKernel

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_state():
    G.clear_cache()
    policy.clear_substitutes()
    yield
    G.clear_cache()
    policy.clear_substitutes()


# ---- tolerance --------------------------------------------------------------------------------------------------

def _rows(gen, t=4, n=256):
    return torch.randn(t, n, generator=gen)


def test_compare_exact_and_last_bit(gen):
    ref = _rows(gen).to(torch.bfloat16)
    assert G.compare(ref, ref, ties=False).ok
    one_ulp = (ref.float() * (1 + 2.0**-8)).to(torch.bfloat16)  # at most one bf16 step
    assert G.compare(one_ulp, ref, ties=False).ok


def test_compare_ties_allow_a_flipped_code_not_a_wrong_kernel(gen):
    ref = _rows(gen)
    flip = ref.clone()
    flip[0, 0] += 0.05 * float(ref.abs().max())  # one output moved by 5 % of the largest
    assert not G.compare(flip, ref, ties=False).ok
    c = G.compare(flip, ref, ties=True)
    assert c.outside == 1 and c.row_err < G.TIE_ROW_TOL and c.ok
    assert not G.compare(ref * 1.05, ref, ties=True).ok  # every row 5 % off: a wrong kernel


def test_compare_non_finite_fails(gen):
    ref = _rows(gen)
    bad = ref.clone()
    bad[1, 3] = float("nan")
    c = G.compare(bad, ref, ties=True)
    assert not c.finite and not c.ok and c.outside == 1


@pytest.mark.parametrize("value, mode", [(None, "on"), ("", "on"), ("1", "on"), ("strict", "strict"), (" 0 ", "off"),
                                         ("off", "off")])
def test_parse_mode(value, mode):
    assert G.parse_mode(value) == mode


def test_parse_mode_rejects_other_values():
    with pytest.raises(ValueError, match=r"^VLLM_NVFP4_SM120_GUARD='maybe': expected 1"):
        G.parse_mode("maybe", "VLLM_NVFP4_SM120_GUARD")


@pytest.mark.parametrize("max_t", [64, 512, 8192])
def test_probe_ts_reach_every_plan(max_t):
    """Every plan any T up to max_t selects is among the probed ones (dense T, real shapes)."""
    from vllm_nvfp4_sm120.dispatch.moe import select_moe_plan

    ts = G.probe_ts(max_t)
    assert ts[0] == 1 and ts[-1] == max_t and set(range(1, 65)) <= set(ts)
    # Every T to 64 (the decode rows change at T = 1, 2, 4, ...), then every T or every 7th.
    every = [*range(1, min(max_t, 64) + 1), *range(65, max_t + 1, 1 if max_t <= 512 else 7)]
    for cap in (SM120_REFERENCE, Capability(90, 132, "H200")):
        for route in (Route.TRITON, Route.W4A16):
            probed = set(G.linear_plans(cap, route, 5120, 2048, max_t))
            assert {p.kernel for p in probed} == {select_linear(cap, route, t, 5120, 2048).kernel for t in every}
        for w4a4 in (True, False):
            shape = dict(top_k=8, global_experts=128, hidden=2048, intermediate=768, w4a4=w4a4)
            probed = set(G.moe_plans(cap, **shape, max_t=max_t))
            assert probed == {select_moe_plan(cap, num_tokens=t, **shape) for t in every}


# ---- linears on CPU (forced), with stand-in launchers -------------------------------------------------------------

def _stand_in(kernel, calls, *, wrong=None):
    def run(x, w_codes, w_scales, w_dec_rows, swizzled, in_enc, alpha, bias, **tile):
        calls.append((kernel, x.shape[0], tuple(sorted(tile.items()))))
        out = linear_call.plan_reference(LinearPlan(kernel), x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias)
        return out if wrong is None else wrong(out)

    return run


@pytest.fixture
def launchers(monkeypatch):
    """Every linear registry entry replaced by its exact reference; ``launchers.break_(kernel, fn)`` makes one wrong."""
    calls = []
    for kernel in LinearKernel:
        monkeypatch.setitem(registry.LINEAR_KERNELS, kernel, _stand_in(kernel, calls))

    class L:
        pass

    L.calls = calls
    L.break_ = staticmethod(lambda kernel, fn: monkeypatch.setitem(
        registry.LINEAR_KERNELS, kernel, _stand_in(kernel, calls, wrong=fn)))
    return L


N, K = 48, 256


def test_every_plan_checked_once_per_shape(launchers):
    plans = G.linear_plans(SM120_REFERENCE, Route.TRITON, N, K, 128)
    assert len(plans) >= 3 and any(p.is_w4a4 for p in plans) and any(not p.is_w4a4 for p in plans)
    results = G.guard_linear(Route.TRITON, N, K, torch.bfloat16, CPU, force=True, max_t=128)
    assert all(r.ok for r in results) and len(results) == len(plans)
    # each ran at the smallest T that picks it, and that T does pick it
    for r in results:
        assert select_linear(SM120_REFERENCE, Route.TRITON, r.t, N, K) == r.key[1]
    n_calls = len(launchers.calls)
    assert n_calls == len(plans)
    again = G.guard_linear(Route.TRITON, N, K, torch.bfloat16, CPU, force=True, max_t=128)
    assert [r.key for r in again] == [r.key for r in results] and len(launchers.calls) == n_calls  # cached
    G.guard_linear(Route.TRITON, N, 2 * K, torch.bfloat16, CPU, force=True, max_t=128)
    assert len(launchers.calls) > n_calls  # another shape is checked anew


def test_a_wrong_kernel_fails(launchers):
    launchers.break_(LinearKernel.W4A4_TRITON, lambda out: out * 1.25)
    results = G.guard_linear(Route.TRITON, N, K, torch.bfloat16, CPU, force=True, max_t=128)
    bad = [r for r in results if not r.ok]
    assert bad and results[0] is bad[0] and {r.key[1].kernel for r in bad} == {LinearKernel.W4A4_TRITON}
    line = bad[0].describe()
    assert "w4a4_triton(" in line and f"N={N} K={K}" in line and "CPU (forced)" in line and "\n" not in line
    assert 0.2 < bad[0].comparison.row_err < 0.3


def test_strict_raises_and_off_skips(launchers):
    launchers.break_(LinearKernel.W4A4_TRITON, lambda out: out.clone().fill_(float("nan")))
    with pytest.raises(G.NumericsGuardError, match=r"strict.*w4a4_triton.*non-finite output"):
        G.guard_linear(Route.TRITON, N, K, torch.bfloat16, CPU, mode=G.GuardMode.STRICT, force=True, max_t=128)
    G.clear_cache()
    launchers.calls.clear()
    assert G.guard_linear(Route.TRITON, N, K, torch.bfloat16, CPU, mode=G.GuardMode.OFF, force=True) == []
    assert G.guard_linear(Route.TRITON, N, K, torch.bfloat16, CPU) == []  # CPU, not forced: nothing runs
    assert launchers.calls == []


@pytest.mark.parametrize("route", [Route.CUBLAS, Route.B12X])
def test_vendor_routes_run_on_their_prepared_weight(launchers, route):
    """b12x pads the codes (N, K to 32): the launchers get the layer's layout, the reference the logical weight."""
    results = G.guard_linear(route, 40, 272, torch.float16, CPU, force=True, max_t=32)
    assert results and all(r.ok for r in results)


# ---- MoE on CPU (forced): the interpreter runs the real Triton kernels -------------------------------------------

MOE = dict(hidden=64, intermediate=32, global_experts=8, top_k=2)


@pytest.fixture
def fast_decode_plans(monkeypatch):
    """The W4A16 plans as a GPU gets them (inline-PTX decode), with that variant of the gate_up launcher wrong;
    the plain decode is the real kernel.  (The interpreter runs the plain decode only.)"""
    table = M.table_moe_plan

    def with_fast_decode(cap, **kw):
        plan = table(cap, **kw)
        return replace(plan, fast_decode=True) if plan.kernel == MoeKernel.W4A16 else plan

    monkeypatch.setattr(M, "table_moe_plan", with_fast_decode)
    gate_up, down = registry.MOE_KERNELS[MoeKernel.W4A16, Impl.TRITON]

    def wrong_when_fast(*a, fast_decode=False, **kw):
        out = gate_up(*a, fast_decode=False, **kw)
        return out * 1.5 if fast_decode else out

    def plain_down(*a, fast_decode=False, **kw):
        return down(*a, fast_decode=False, **kw)

    monkeypatch.setitem(registry.MOE_KERNELS, (MoeKernel.W4A16, Impl.TRITON), (wrong_when_fast, plain_down))


def test_moe_wrong_plan_falls_back_to_the_portable_plan(fast_decode_plans):
    cap = Capability(None)
    outcome = G.guard_moe(**MOE, w4a4=True, dtype=torch.float16, device=CPU, force=True, max_t=16)
    (failed, fallback), = outcome.fallbacks.items()
    assert failed.kernel == MoeKernel.W4A16 and failed.fast_decode and not fallback.fast_decode
    assert fallback.tier.endswith("/exact-decode")
    assert [r.ok for r in outcome.results][0] is False and sum(not r.ok for r in outcome.results) == 1
    assert "moe w4a16/triton" in outcome.results[0].describe()
    # The W4A4 plan (T = 16: 4 tokens per expert) passed and stays.
    assert any(r.ok and r.key[1].kernel == MoeKernel.W4A4 for r in outcome.results)
    # From now on the selector runs the fallback at that shape, and only there.
    shape = dict(top_k=2, global_experts=8, hidden=64, w4a4=True)
    assert M.select_moe_plan(cap, num_tokens=1, intermediate=32, **shape) == fallback
    assert M.select_moe_plan(cap, num_tokens=1, intermediate=64, **shape).fast_decode


def test_moe_strict_raises(fast_decode_plans):
    with pytest.raises(G.NumericsGuardError, match=r"strict.*moe w4a16/triton"):
        G.guard_moe(**MOE, w4a4=False, dtype=torch.float16, device=CPU, mode=G.GuardMode.STRICT, force=True, max_t=4)


def test_portable_plan_chain():
    cap = Capability(120)
    gluon = M.tier_plan(cap, MoeKernel.W4A4, 64, hidden=2048, intermediate=768, impl=Impl.GLUON)
    step1 = G.portable_moe_plan(cap, gluon, hidden=2048, intermediate=768)
    assert step1 == M.tier_plan(cap, MoeKernel.W4A4, 64, hidden=2048, intermediate=768)
    step2 = G.portable_moe_plan(cap, step1, hidden=2048, intermediate=768)
    assert step2.impl == Impl.TRITON and step2.decode and step2.block_m == 64
    assert G.portable_moe_plan(cap, step2, hidden=2048, intermediate=768) == step2



def test_portable_plan_of_the_decode_plan():
    """The align-free decode plan falls back to today's path (the smallest W4A16 tier), then its exact decode; its
    guard problem has tokens (no BLOCK_M to size it by)."""
    cap = Capability(90)
    decode = M.decode_tier_plan(cap, 1, hidden=2048, intermediate=768)
    assert decode.impl == Impl.DECODE and G._moe_tokens(decode) > 0
    step1 = G.portable_moe_plan(cap, decode, hidden=2048, intermediate=768)
    assert (step1.impl, step1.kernel, step1.block_m) == (Impl.TRITON, MoeKernel.W4A16, 16) and step1.fast_decode
    step2 = G.portable_moe_plan(cap, step1, hidden=2048, intermediate=768)
    assert not step2.fast_decode and step2.block_m == 16

# ---- on the GPU present: the real kernels ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("route", [Route.TRITON, Route.W4A16])
@pytest.mark.parametrize("n, k", [(5120, 2048), (2048, 4096), (1536, 272)])
def test_gpu_linear_kernels_pass_the_guard(route, n, k):
    from vllm_nvfp4_sm120.dispatch.hw import capability_of
    from vllm_nvfp4_sm120.dispatch.linear import TABLE

    if route not in TABLE[capability_of(torch.device("cuda")).family]:
        pytest.skip(f"route {route} has no kernels on this GPU")
    results = G.guard_linear(route, n, k, torch.bfloat16, "cuda", max_t=8192)
    assert results
    bad = [r.describe() for r in results if not r.ok]
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("w4a4", [True, False], ids=["w4a4", "w4a16"])
def test_gpu_moe_kernels_pass_the_guard(w4a4):
    outcome = G.guard_moe(hidden=2048, intermediate=768, global_experts=128, top_k=8, w4a4=w4a4,
                          dtype=torch.bfloat16, device="cuda", max_t=8192)
    assert outcome.results and not outcome.fallbacks, [r.describe() for r in outcome.results if not r.ok]


@pytest.mark.gpu
def test_gpu_wrong_kernel_falls_back(monkeypatch):
    """A deliberately wrong W4A4 launcher on the GPU: the guard names it and the MoE layer falls back."""
    gate_up, down = registry.MOE_KERNELS[MoeKernel.W4A4, Impl.TRITON]

    def wrong_down(*a, decode=None, **kw):  # wrong with the FP4 MMA, right with the exact decode
        down(*a, decode=decode, **kw)
        if not decode:
            a[8].mul_(1.25)  # acc

    for impl in [impl for kernel, impl in registry.MOE_KERNELS if kernel == MoeKernel.W4A4]:
        gu, dn = registry.MOE_KERNELS[MoeKernel.W4A4, impl]
        monkeypatch.setitem(registry.MOE_KERNELS, (MoeKernel.W4A4, impl), (gu, wrong_down if impl is Impl.TRITON
                                                                           else dn))
    outcome = G.guard_moe(hidden=2048, intermediate=768, global_experts=128, top_k=8, w4a4=True,
                          dtype=torch.bfloat16, device="cuda", max_t=8192)
    wrong = {p for p in outcome.fallbacks if p.kernel == MoeKernel.W4A4 and p.impl == Impl.TRITON and not p.decode}
    assert wrong, outcome.fallbacks
