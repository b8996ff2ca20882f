"""Host time of the MoE layer flow's Python path on CPU, kernels stubbed out: where a call's microseconds go.

CPU tensors with an explicit plan run the GPU flow under ``TRITON_INTERPRET=1``; here every Triton kernel of the MoE
kernel modules is replaced by a no-op, so what is timed is the flow's checks, plan selection, buffer allocation and
the launchers' own validation (the real launch cost, Triton's argument binding, is not in it: ``bench host`` on a
GPU measures that).  On CPU the decode launchers also read the routing ids (their synchronizing range check, absent
on a GPU), so the launcher figures are an upper bound; at large T the CPU's zeroing of the fp32 accumulators
(an asynchronous memset on a GPU) dominates the flow's time.  Each row also gives the Python function calls and the
``check_tensor`` calls per call, which a shared machine does not disturb.

    TRITON_INTERPRET=1 python benchmarks/moe_host_cpu.py [--repeat N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from vllm_nvfp4_sm120.dispatch import moe_flow  # noqa: E402
from vllm_nvfp4_sm120.dispatch.hw import Capability  # noqa: E402
from vllm_nvfp4_sm120.dispatch.moe import decode_tier_plan, select_moe_plan  # noqa: E402
from vllm_nvfp4_sm120.dispatch.registry import MoeReady, prepare_moe_decode  # noqa: E402
from vllm_nvfp4_sm120.format import make_moe_bank, topk_route  # noqa: E402
from vllm_nvfp4_sm120.kernels import moe_align, moe_common, moe_decode, moe_w4a4, moe_w4a16  # noqa: E402

SM90 = Capability(90)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **kw: None


def stub_kernels() -> int:
    n = 0
    for mod in (moe_align, moe_decode, moe_w4a16, moe_w4a4):
        for name, v in list(vars(mod).items()):
            if hasattr(v, "fn") and hasattr(v, "__getitem__") and hasattr(v, "run"):
                setattr(mod, name, _NoLaunch())
                n += 1
    return n


def layer(t, e=8, h=256, i=128, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, d2 = make_moe_bank(e, h, i, gen=gen)
    x = torch.randn(t, h, generator=gen).half()
    tw, ti = topk_route(torch.randn(t, e, generator=gen), top_k)
    return (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti), dict(e=e, h=h, i=i, top_k=top_k)


def us_per_call(fn, repeat: int) -> float:
    """The best of 5 rounds (the machine may be shared: the minimum is the code's cost, not its neighbours')."""
    for _ in range(20):
        fn()
    best = float("inf")
    n = max(repeat // 5, 1)
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def calls_per_call(fn, n: int = 100) -> tuple[float, float]:
    """Python function calls and ``check_tensor`` calls per call: a measure a shared machine does not disturb."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    checks = sum(v[1] for k, v in st.stats.items() if k[2] == "check_tensor")
    return st.total_calls / n, checks / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="cProfile the decode call (top 25 by own time)")
    args = ap.parse_args()
    print(f"stubbed kernels: {stub_kernels()}")
    for t, what in ((1, "decode"), (512, "tiers")):
        a, s = layer(t)
        x, w13c, w13s, d13, w2c, w2s, d2, tw, ti = a
        if what == "decode":
            plan = decode_tier_plan(SM90, t, hidden=s["h"], intermediate=s["i"])
        else:
            plan = select_moe_plan(SM90, num_tokens=t, top_k=s["top_k"], global_experts=s["e"], hidden=s["h"],
                                   intermediate=s["i"], w4a4=False)
        from dataclasses import replace
        plan = replace(plan, fast_decode=False, decode=True)
        out = torch.empty_like(x)
        rows = {
            "check_moe_layer (hit)": lambda: moe_common.check_moe_layer(*a),
            "plan_for (no plan given)": lambda: moe_flow.plan_for(x, w13c, w2c, ti, w4a4=False),
            "select_moe_plan (sm_90)": lambda: select_moe_plan(
                SM90, num_tokens=t, top_k=s["top_k"], global_experts=s["e"], hidden=s["h"], intermediate=s["i"],
                w4a4=False),
            "nvfp4_moe, stubbed kernels": lambda: moe_flow.nvfp4_moe(*a, plan=plan, out=out),
        }
        if what == "decode":
            rows["decode gate_up launcher (stubbed)"] = lambda: moe_decode.moe_decode_gate_up(
                x, w13c, w13s, d13, ti, tile=plan.gate_up)
            inter = torch.empty(t * s["top_k"], s["i"], dtype=x.dtype)
            rows["decode down launcher (stubbed)"] = lambda: moe_decode.moe_decode_down_token(
                inter, w2c, w2s, d2, ti, tw, tile=plan.down, out=out)
            # What a GPU call of a cached decode signature runs after the flow's lookup (the flow's CPU path
            # always validates): the ready layer launcher, Triton's launches stubbed.
            ready = prepare_moe_decode(plan, MoeReady(t, s["h"], s["i"], s["e"], s["top_k"], s["e"], x.device, x.dtype,
                                                      False, "silu", False))
            rows["ready decode layer (stubbed)"] = lambda: ready(x, w13c, w13s, d13, w2c, w2s, d2, tw, ti, None, None,
                                                                 None, out)
        print(f"T = {t} ({plan.impl}, {plan.tier}):")
        for name, fn in rows.items():
            calls, checks = calls_per_call(fn)
            print(f"  {name:34s} {us_per_call(fn, args.repeat):8.1f} us  {calls:6.0f} calls  {checks:4.0f} checks")
        if args.profile and what == "decode":
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.repeat):
                moe_flow.nvfp4_moe(*a, plan=plan, out=out)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
