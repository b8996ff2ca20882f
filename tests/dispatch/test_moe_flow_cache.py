"""The MoE flow's per-signature cache: a repeated signature skips the checks and the plan selection; anything the
selection reads (shapes, dtypes, the policy, the guard's substitutions, the selector environment, the measured
configs) makes the next call select again; bad inputs raise the same errors whatever was cached before."""

from dataclasses import replace

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import configs, moe_flow, policy
from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.dispatch.linear_call import SELECTOR_ENV
from vllm_nvfp4_sm120.dispatch.moe import decode_tier_plan, moe_guard_key
from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe, plan_for
from vllm_nvfp4_sm120.format import NvFp4, make_moe_bank, moe_ref, topk_route
from vllm_nvfp4_sm120.kernels import moe_decode


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    moe_flow.clear()
    policy.clear_substitutes()
    yield
    policy.set_policy(policy.DEFAULT)
    policy.clear_substitutes()
    moe_flow.clear()


def _layer(gen, t=3, e=4, h=64, i=32, top_k=2, dtype=torch.float16):
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, d2 = make_moe_bank(e, h, i, gen=gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    tw, ti = topk_route(torch.randn(t, e, generator=gen), top_k)
    return [x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti]


@pytest.fixture
def spy(monkeypatch):
    """Counts the checks (every call's first step on a miss) and records the plan each call runs."""
    seen = {"checks": 0, "plans": []}
    checked, reference = moe_flow._checked_plan, moe_flow._reference

    def counting(*a, **kw):
        seen["checks"] += 1
        return checked(*a, **kw)

    def recording(*a):
        seen["plans"].append(a[-1])
        return reference(*a)

    monkeypatch.setattr(moe_flow, "_checked_plan", counting)
    monkeypatch.setattr(moe_flow, "_reference", recording)
    return seen


def test_hit_skips_checks_and_selection(spy, gen, monkeypatch):
    a = _layer(gen)
    out = torch.empty_like(a[0])
    first = nvfp4_moe(*a)
    assert nvfp4_moe(*a, out=out) is out  # an out buffer is another signature: checked once too
    assert spy["checks"] == 2

    def unreachable(*args, **kw):
        raise AssertionError("a cache hit checked or selected again")

    monkeypatch.setattr(moe_flow, "plan_for", unreachable)
    monkeypatch.setattr(moe_flow, "check_moe_layer", unreachable)
    monkeypatch.setattr(moe_flow, "check_tensor", unreachable)
    again = nvfp4_moe(*a)
    out2 = torch.empty_like(a[0])
    assert nvfp4_moe(*a, out=out2) is out2
    assert spy["checks"] == 2
    assert torch.equal(first, again) and torch.equal(first, out) and torch.equal(first, out2)
    assert len(set(spy["plans"])) == 1


@pytest.mark.parametrize("change", ["tokens", "dtype", "top_k", "activation", "deterministic"])
def test_changed_signature_misses(change, spy, gen):
    a = _layer(gen)
    nvfp4_moe(*a)
    b = a
    if change in ("tokens", "dtype", "top_k"):
        b = _layer(torch.Generator().manual_seed(7), t=5 if change == "tokens" else 3,
                   top_k=1 if change == "top_k" else 2, dtype=torch.bfloat16 if change == "dtype" else torch.float16)
    kw = {"activation": dict(activation="gelu_tanh"), "deterministic": dict(deterministic=True)}.get(change, {})
    got = nvfp4_moe(*b, **kw)
    assert spy["checks"] == 2
    x, w13c, w13s, d13, w2c, w2s, d2, tw, ti = b
    ref = moe_ref(x, NvFp4(w13c, w13s), d13, NvFp4(w2c, w2s), d2, tw, ti, activation=kw.get("activation", "silu"))
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_policy_change_misses(spy, gen):
    a = _layer(gen)
    nvfp4_moe(*a)
    nvfp4_moe(*a)
    policy.set_policy(policy.NumericsPolicy(batch_invariant=True))
    nvfp4_moe(*a)
    assert spy["checks"] == 2
    policy.set_policy(policy.NumericsPolicy(batch_invariant=True))  # setting it again: select again (harmless)
    nvfp4_moe(*a)
    assert spy["checks"] == 3


def test_substitution_takes_effect_at_the_next_call(spy, gen):
    a = _layer(gen)
    x, w13c, _, _, w2c, _, _, _, ti = a
    nvfp4_moe(*a)
    plan = plan_for(x, w13c, w2c, ti, w4a4=False)
    assert spy["plans"][-1] == plan
    fallback = replace(plan, tier=plan.tier + "/fallback")
    policy.set_substitute(moe_guard_key(plan, x.shape[1], w2c.shape[2] * 2), fallback)
    nvfp4_moe(*a)
    assert spy["plans"][-1] == fallback
    policy.clear_substitutes()
    nvfp4_moe(*a)
    assert spy["plans"][-1] == plan and spy["checks"] == 3


def test_selector_env_and_configs_clear_miss(spy, gen, monkeypatch):
    a = _layer(gen)
    nvfp4_moe(*a)
    (env,) = SELECTOR_ENV
    monkeypatch.setenv(env, "1")
    nvfp4_moe(*a)
    nvfp4_moe(*a)
    assert spy["checks"] == 2
    configs.clear_cache()
    nvfp4_moe(*a)
    assert spy["checks"] == 3


# Bad signatures: the error of the uncached flow, on the first call, on a repeat (failures are not cached), and after
# a hit of the good signature.
BAD = [
    ("x-fp32", lambda a: [a[0].float(), *a[1:]], TypeError, r"x: expected dtype bfloat16 or float16, got float32"),
    ("w13-scales", lambda a: [*a[:2], a[2][:, :, :2].contiguous(), *a[3:]], ValueError,
     r"w13_scales: expected shape \[4, 64, 4\], got \[4, 64, 2\]"),
    ("topk-weights-T", lambda a: [*a[:7], a[7][:2], a[8]], ValueError, r"topk_weights: expected shape \[3, 2\]"),
    ("out-dtype", lambda a: a, TypeError, r"out: expected dtype float16"),
]


@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BAD])
def test_bad_input_after_a_hit(case, gen):
    change, exc, match = case
    good = _layer(gen)
    kw = dict(out=torch.empty(3, 64, dtype=torch.float32)) if "out" in match else {}
    for _ in range(2):
        with pytest.raises(exc, match=match):
            nvfp4_moe(*change(good), **kw)
    nvfp4_moe(*good)
    nvfp4_moe(*good)
    with pytest.raises(exc, match=match):
        nvfp4_moe(*change(good), **kw)


def test_bad_option_after_a_hit(gen):
    a = _layer(gen)
    nvfp4_moe(*a)
    nvfp4_moe(*a)
    with pytest.raises(ValueError, match="activation: expected one of"):
        nvfp4_moe(*a, activation="relu")
    with pytest.raises(ValueError, match="a13_enc and a2_enc"):
        nvfp4_moe(*a, a13_enc=torch.ones(1))
    with pytest.raises(ValueError, match="activation: expected one of"):
        nvfp4_moe(*a, activation=["silu"])  # unhashable: no cache entry, the same check


def test_decode_launchers_check_after_a_hit(gen):
    """The decode launchers check a bank's and the routing's metadata once per signature, and the ids (a read of
    their values, on CPU) on every call."""
    plan = decode_tier_plan(Capability(90), 1, hidden=112, intermediate=96)
    plan = replace(plan, fast_decode=False, decode=True)
    a = _layer(gen, t=2, h=112, i=96)
    out = nvfp4_moe(*a, plan=plan)
    x, w13c, w13s, d13, w2c, w2s, d2, tw, ti = a
    ref = moe_ref(x, NvFp4(w13c, w13s), d13, NvFp4(w2c, w2s), d2, tw, ti)
    torch.testing.assert_close(out, ref, atol=2.0**-10 * float(ref.float().abs().max()), rtol=2.0**-9)
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 4\)"):
        nvfp4_moe(*a[:8], ti + 4, plan=plan)
    with pytest.raises(ValueError, match="w13_scales: expected shape"):
        moe_decode.moe_decode_gate_up(x, w13c, w13s[:, :, :3], d13, ti, tile=plan.gate_up)
    with pytest.raises(ValueError, match="topk_ids: expected a contiguous"):
        moe_decode.moe_decode_gate_up(x, w13c, w13s, d13, ti.t().contiguous().t(), tile=plan.gate_up)
