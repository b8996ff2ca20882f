"""``dispatch/registry.py``: every plan kind the tables can return has a launcher, and the MoE launchers take the
plan's tiles as they are (a new kernel is registered in one place; these tests say when that place is missed)."""

from __future__ import annotations

import inspect

import pytest

from vllm_nvfp4_sm120.dispatch.hw import NO_GPU, Capability
from vllm_nvfp4_sm120.dispatch.linear import LinearKernel, all_linear_plans
from vllm_nvfp4_sm120.dispatch.moe import Impl, MoeKernel, all_moe_plans
from vllm_nvfp4_sm120.dispatch.registry import LINEAR_KERNELS, MOE_KERNELS

CAPS = {"no-gpu": NO_GPU, "sm90": Capability(90), "sm120": Capability(120)}


def test_every_linear_kernel_has_one_launcher():
    assert set(LINEAR_KERNELS) == set(LinearKernel)
    assert {p.kernel for p in all_linear_plans()} <= set(LINEAR_KERNELS)


def test_every_moe_kernel_and_impl_has_launchers():
    # The decode kernels are weight-only: W4A16 is their one kernel (W4A4 checkpoints' small calls run them too).
    kinds = {(kernel, impl) for kernel in MoeKernel for impl in Impl if impl is not Impl.DECODE}
    assert set(MOE_KERNELS) == kinds | {(MoeKernel.W4A16, Impl.DECODE)}
    planned = {(p.kernel, p.impl) for cap in CAPS.values() for p in all_moe_plans(cap)}
    assert planned <= set(MOE_KERNELS) and (MoeKernel.W4A16, Impl.DECODE) in planned


@pytest.mark.parametrize("cap", list(CAPS.values()), ids=list(CAPS))
def test_moe_plans_bind_to_their_launchers(cap):
    plans = all_moe_plans(cap)
    assert plans
    for plan in plans:
        gate_up, down = MOE_KERNELS[plan.kernel, plan.impl]
        # TypeError here: the plan passes a keyword its launcher does not take.
        inspect.signature(gate_up).bind_partial(**plan.gate_up_kwargs())
        inspect.signature(down).bind_partial(**plan.down_kwargs())
