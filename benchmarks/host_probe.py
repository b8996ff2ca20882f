"""Where a call's host microseconds go: the pieces of the linear op's and the MoE op's hot paths, the ready
kernels' direct C launch against Triton's Python launcher, and the decode down kernel's ready launcher with and
without TMA, each timed alone on a CUDA GPU.

    source .carry/env.sh && python benchmarks/host_probe.py

``bench host`` times whole calls next to a trivial Triton launch; this takes two of them apart, timed the way
``bench host`` times its rows (eager, tiny shapes, ``bench_host._Rows``: interleaved rounds, the host time before the
final synchronize, medians).  The host's speed drifts between runs, so compare the rows of one run with each other,
not with another run's.  Runs without vLLM.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_nvfp4_sm120.bench import gpu_nvfp4  # noqa: E402
from vllm_nvfp4_sm120.bench_host import MOE_SHAPE, _Rows, _trivial_12  # noqa: E402
from vllm_nvfp4_sm120.dispatch import moe_flow  # noqa: E402
from vllm_nvfp4_sm120.dispatch import moe_ops  # noqa: E402, F401  (registers torch.ops.nvfp4_sm120.moe)
from vllm_nvfp4_sm120.dispatch import linear_call as lc  # noqa: E402
from vllm_nvfp4_sm120.dispatch import ops  # noqa: E402, F401  (registers torch.ops.nvfp4_sm120.linear)
from vllm_nvfp4_sm120.dispatch.moe import DECODE_DOWN_TILES  # noqa: E402
from vllm_nvfp4_sm120.dispatch.policy import current_policy  # noqa: E402
from vllm_nvfp4_sm120.dispatch.registry import MoeReady, prepare_moe  # noqa: E402
from vllm_nvfp4_sm120.kernels import launch  # noqa: E402
from vllm_nvfp4_sm120.kernels.launch import ReadyKernel  # noqa: E402
from vllm_nvfp4_sm120.kernels.moe_decode import down_expert_workspace, prepare_moe_decode_down_expert  # noqa: E402


def linear_rows(gen) -> dict:
    """The ``linear`` w4a16 T = 1 op (N = K = 512) and its pieces: the op through ``torch.ops``, its Python body,
    the cached ready run, the signature key, and what the run does besides the launch."""
    n = k = 512
    w = gpu_nvfp4((n, k), gen)
    dec = torch.full((n,), 0.01, device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty(16, device="cuda") for _ in range(6)]
    args = (x, w.codes, w.scales, dec, None, None, None, None, "w4a16")
    op = torch.ops.nvfp4_sm120.linear
    op(*args)
    run = next(v for key, v in lc._CACHE.items() if key[0] == "w4a16")
    m = lc._meta
    return {
        "trivial Triton launch, 12 arguments": lambda: _trivial_12[(1,)](*bufs, 1, 2, 3, 4, 5, 6, BLOCK=16),
        "cuBLAS x @ w.t()": lambda: x @ wb.t(),
        "torch.ops.nvfp4_sm120.linear w4a16 T=1": lambda: op(*args),
        "  its body (linear_call.linear)": lambda: lc.linear(*args),
        "  the cached ready run": lambda: run(x, w.codes, w.scales, dec, None, None, None, None),
        "  the signature key": lambda: ("w4a16", m(x), m(w.codes), m(w.scales), m(dec), m(None), m(None), m(None),
                                        m(None), current_policy(), *map(os.environ.get, lc.SELECTOR_ENV)),
        "  one environment read": lambda: os.environ.get(lc.SELECTOR_ENV[0]),
        "  the output allocation": lambda: torch.empty((1, n), dtype=torch.bfloat16, device="cuda"),
        "  the scales' uint8 view": lambda: w.scales.view(torch.uint8),
    }


def moe_rows(gen) -> dict:
    """The ``moe`` op at T = 1 on ``bench host``'s MoE shape (the decode plan, W4A16) and its pieces: the op through
    ``torch.ops``, its Python body, the entry's ready layer launcher with the ready kernels launched directly and
    through Triton's Python launcher (``launch.DIRECT``), and the signature key."""
    h, i, e, top_k = MOE_SHAPE
    w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
    d13, d2 = torch.full((e,), 0.01, device="cuda"), torch.full((e,), 0.01, device="cuda")
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = torch.softmax(torch.randn(1, e, device="cuda", generator=gen), -1).topk(top_k, -1)
    tw, ti = tw.float().contiguous(), ti.to(torch.int32).contiguous()
    out = torch.empty((1, h), device="cuda", dtype=torch.bfloat16)
    args = (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, None, None, None, "silu", False, out)
    op = torch.ops.nvfp4_sm120.moe
    op(*args)
    op(*args)  # the second call builds the ready launcher
    entry = next(v for v in moe_flow._CACHE.values() if v.ready is not None)
    ready_args = (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, None, None, None, out)
    r = MoeReady(1, h, i, e, top_k, e, x.device, x.dtype, False, "silu", False)
    launch.DIRECT = False  # read when a ready kernel remembers its variant: on its first call
    try:
        python_launcher = prepare_moe(entry.plan, r)
        python_launcher(*ready_args)
    finally:
        launch.DIRECT = True
    m = moe_flow._meta
    return {
        f"torch.ops.nvfp4_sm120.moe W4A16 T=1 ({entry.plan.impl}, 2 kernels)": lambda: op(*args),
        "  its body (moe_flow.nvfp4_moe)": lambda: moe_flow.nvfp4_moe(*args[:9], out=out),
        "  the entry's ready layer launcher, direct launches": lambda: entry.ready(*ready_args),
        "  the same, through Triton's Python launcher": lambda: python_launcher(*ready_args),
        "  the signature key": lambda: (*map(m, (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                                  None, None, None, out)), "silu", False, None),
    }


def launcher_rows() -> dict:
    """The trivial 12-argument kernel (six tensors) as a ready kernel: direct C launch and Python launcher."""
    bufs = [torch.empty(16, device="cuda") for _ in range(6)]
    args = (*bufs, 1, 2, 3, 4, 5, 6)
    rows = {}
    for direct in (True, False):
        launch.DIRECT = direct
        try:
            ready = ReadyKernel(_trivial_12, (1,), BLOCK=16)
            ready(*args)  # remembers its variant
        finally:
            launch.DIRECT = True
        assert (ready._variant.direct is not None) == direct
        rows[f"trivial 12-argument ReadyKernel, {'direct C launch' if direct else 'Python launcher'}"] = (
            lambda ready=ready: ready(*args))
    return rows


def down_rows(gen) -> dict:
    """The expert-major decode down's ready launcher (H = I = 256, E = 8, top-2, T = 1) for the table's two TMA
    tiles, as they are and by pointer loads: a TMA tile builds and encodes two descriptors per call."""
    h, i, e, k, t = 256, 256, 8, 2, 1
    w2 = gpu_nvfp4((e, h, i), gen)
    d2 = torch.full((e,), 0.01, device="cuda")
    inter = torch.randn(t * k, i, device="cuda", dtype=torch.bfloat16)
    tw, ti = torch.softmax(torch.randn(t, e, device="cuda", generator=gen), -1).topk(k, -1)
    tw, ti = tw.float().contiguous(), ti.to(torch.int32).contiguous()
    sf = w2.scales.view(torch.uint8)
    rows = {}
    for name in ("exp-n32k256-w2-tma-st2", "exp-n64k256-w2-tma-st2-shift"):
        for tma in (True, False):
            tile = replace(DECODE_DOWN_TILES[name], use_tma=tma)
            run = prepare_moe_decode_down_expert(t, h, i, e, k, e, inter.device, tile=tile, has_map=False,
                                                 deterministic=False)
            ws = down_expert_workspace(t, k, h, tile, False, "cuda").zero_()
            out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
            rows[f"down ready launcher {name} {'TMA' if tma else 'pointer loads'}"] = (
                lambda run=run, ws=ws, out=out: run(inter, w2.codes, sf, d2, ti, ti, tw, ws, out))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("host_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = _Rows()
    for name, fn in {**linear_rows(gen), **launcher_rows(), **moe_rows(gen), **down_rows(gen)}.items():
        rows.add(name, fn, count=False)
    rows.measure()  # prints a line per row
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
