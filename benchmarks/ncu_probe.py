"""One call of each decode kernel the dispatch runs, for Nsight Compute (``ncu``) to profile on a CUDA GPU.

    source .carry/env.sh && ncu --clock-control none -k regex:'moe_decode|gemv' --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python benchmarks/ncu_probe.py [--moe qwen3-30b-a3b:1,16] [--linear 5120x25600:1]

Each case runs once to compile, then once more with an NVTX range named after it, so ``ncu --nvtx
--nvtx-include 'case/'`` or the kernel order tells which call a report is.  ncu flushes the caches before each
profiled kernel, so the weights come from DRAM as in the benchmarks' many-copy graphs.  What ncu gives that a
timer cannot: achieved occupancy and its limiter (registers, shared memory, blocks), issue slots used, and where
the warps stall (long scoreboard = waiting for memory, short scoreboard / MIO = shared memory, not selected =
enough warps).  Runs without vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_nvfp4_sm120.bench import MOE_SHAPES, gpu_nvfp4  # noqa: E402
from vllm_nvfp4_sm120.dispatch.hw import capability_of  # noqa: E402
from vllm_nvfp4_sm120.dispatch.linear import gemv_stream_linear_plan, select_linear  # noqa: E402
from vllm_nvfp4_sm120.dispatch.moe import decode_tier_plan  # noqa: E402
from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe  # noqa: E402
from vllm_nvfp4_sm120.dispatch.registry import LINEAR_KERNELS  # noqa: E402


def _cases(spec: str) -> list[tuple[str, list[int]]]:
    out = []
    for item in filter(None, spec.split(";")):
        name, ts = item.split(":")
        out.append((name, [int(t) for t in ts.split(",")]))
    return out


def moe_case(name: str, t: int, gen: torch.Generator):
    h, i, e, k = MOE_SHAPES[name]
    dev = gen.device
    w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
    d13 = torch.full((e,), 0.005, device=dev)
    d2 = torch.full((e,), 0.005, device=dev)
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    tw, ti = torch.softmax(torch.randn(t, e, device=dev, generator=gen), -1).topk(k, -1)
    tw, ti = (tw / tw.sum(-1, keepdim=True)).float().contiguous(), ti.to(torch.int32).contiguous()
    plan = decode_tier_plan(capability_of(dev), t, hidden=h, intermediate=i)
    print(f"moe {name} T={t}: plan {plan.tier} gate_up {plan.gate_up} down {plan.down}", flush=True)
    return lambda: nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, plan=plan)


def linear_case(nk: str, t: int, gen: torch.Generator, stream: bool = False):
    n, k = map(int, nk.split("x"))
    dev = gen.device
    w = gpu_nvfp4((n, k), gen)
    dec = torch.full((n,), 0.01, device=dev)
    x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
    cap = capability_of(dev)
    plan = gemv_stream_linear_plan(cap, t, n, k) if stream else select_linear(cap, "w4a16", t, n, k)
    print(f"linear {n}x{k} T={t}: {plan.kernel} {plan.kwargs}", flush=True)
    run = LINEAR_KERNELS[plan.kernel]
    return lambda: run(x, w.codes, w.scales, dec, None, None, None, None, **plan.kwargs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--moe", default="qwen3-30b-a3b:1,16;deepseek-v3:1", help="name:T,T;name:T")
    p.add_argument("--linear", default="5120x25600:1;51200x5120:1", help="NxK:T,T;NxK:T")
    p.add_argument("--linear-stream", default="", help="NxK:T,...: the streaming kernel's plan whatever the table "
                   "picks (its kernel is _stream_kernel: add it to ncu's -k regex)")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(f"moe-{n}-T{t}", moe_case(n, t, gen)) for n, ts in _cases(args.moe) for t in ts]
    cases += [(f"linear-{nk}-T{t}", linear_case(nk, t, gen)) for nk, ts in _cases(args.linear) for t in ts]
    cases += [(f"stream-{nk}-T{t}", linear_case(nk, t, gen, stream=True))
              for nk, ts in _cases(args.linear_stream) for t in ts]
    for _, fn in cases:  # compile everything first: the profiled launches are the second calls
        fn()
    torch.cuda.synchronize()
    for label, fn in cases:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {label}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
