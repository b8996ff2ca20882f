"""``vllm-nvfp4-sm120 warmup``: compile, ahead of serving, the kernel variants a checkpoint's shapes meet.

With an empty Triton cache (a new user, a fresh container) the first start compiles every variant the model's
layer shapes meet across vLLM's CUDA-graph capture sizes, before the first request.  ``warmup`` runs the plugin's
ops once per (layer shape, capture size) on random weights of the checkpoint's shapes, so the variants land in
``$TRITON_CACHE_DIR`` (a container image can carry it); ``--dry-run`` lists them without a GPU.

The shapes are ``inspect``'s: the NVFP4 dense linears as vLLM runs them (fused, unsharded) and the MoE layer.
Needs torch and Triton only (vLLM is not imported).

Compiling is single-threaded CPU work, one variant after another in one process.  ``--jobs N`` first splits the
(layer, size) calls into groups that meet disjoint variants (:func:`work_units`: per layer shape, plan, and the
compile-time arguments that follow T: the activation quantizer's tile, the decode kernels' route-vector width) and
runs them in N child processes that share ``$TRITON_CACHE_DIR`` (Triton writes its cache entries atomically); then
this process runs every call once more, so whatever a child did not compile is compiled here and every call has run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

# vLLM's default cudagraph_capture_sizes (max_num_seqs 256, max 512 captured): 1, 2, 4, then 8..256 by 8, then
# 272..512 by 16; plus the prefill chunk sizes up to the default max_num_batched_tokens (8192), run eagerly.
CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))
PREFILL_SIZES: tuple[int, ...] = (1024, 2048, 4096, 8192)
DEFAULT_SIZES: tuple[int, ...] = CAPTURE_SIZES + PREFILL_SIZES


@dataclass
class Case:
    """What to warm: dense linear shapes ``(kind, N, K)``, MoE layers ``(H, I, E, top_k)``, the batch sizes."""

    linears: list[tuple[str, int, int]]
    moe: list[tuple[int, int, int, int]]
    w4a4: bool
    sizes: tuple[int, ...] = DEFAULT_SIZES
    route: str | None = None  # None: the route vLLM's auto choice takes first on the GPU

    def linear_route(self, cap) -> str:
        from .dispatch.vendor import auto_routes

        return self.route or str(auto_routes(cap, self.w4a4)[0])


def case_from_checkpoint(ckpt, sizes: tuple[int, ...] = DEFAULT_SIZES, route: str | None = None) -> Case:
    from .inspect_ckpt import inspect_checkpoint

    r = inspect_checkpoint(ckpt)
    moe = [] if r.moe is None else [(r.moe["hidden"], r.moe["intermediate"], r.moe["experts"], r.moe["top_k"])]
    return Case(linears=list(r.runtime_shapes), moe=moe, w4a4=r.quant.scheme != "W4A16", sizes=sizes, route=route)


@dataclass
class Variants:
    """Distinct plans per layer shape, with the batch sizes each serves (what ``--dry-run`` prints)."""

    linear: dict[tuple, list[int]] = field(default_factory=lambda: defaultdict(list))
    moe: dict[tuple, list[int]] = field(default_factory=lambda: defaultdict(list))

    def lines(self) -> list[str]:
        out = []
        for (kind, n, k, plan), sizes in self.linear.items():
            tile = ",".join(f"{a}={b}" for a, b in plan.params)
            out.append(f"linear {kind} N={n} K={k}: {plan.kernel}({tile}) at T={_ranges(sizes)}")
        for (shape, plan), sizes in self.moe.items():
            h, i, e, top_k = shape
            out.append(f"moe H={h} I={i} E={e} top_k={top_k}: {plan.kernel} {plan.impl} block_m={plan.block_m} "
                       f"tier={plan.tier} at T={_ranges(sizes)}")
        return out


def _ranges(sizes: list[int]) -> str:
    return f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"


def variants(case: Case, cap) -> Variants:
    """The plans ``case`` meets on ``cap``'s GPU (no GPU needed)."""
    from .dispatch.linear import select_linear
    from .dispatch.moe import select_moe_plan

    v = Variants()
    route = case.linear_route(cap)
    for kind, n, k in case.linears:
        for t in case.sizes:
            v.linear[(kind, n, k, select_linear(cap, route, t, n, k))].append(t)
    for shape in case.moe:
        h, i, e, top_k = shape
        for t in case.sizes:
            plan = select_moe_plan(cap, num_tokens=t, top_k=top_k, global_experts=e, hidden=h, intermediate=i,
                                   w4a4=case.w4a4)
            v.moe[(shape, plan)].append(t)
    return v


def _random_codes(shape, device, gen):
    """Random codes and finite e4m3 scales (what a checkpoint holds; values do not change what compiles)."""
    from .bench import gpu_nvfp4

    q = gpu_nvfp4(shape, gen)
    return q.codes, q.scales


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exercise(case: Case, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
             progress=None) -> dict:
    """Run every (layer, size) of ``case`` once through the plugin's ops on ``device`` (compiling what is not in
    the Triton cache); returns seconds per part and the calls made.  On CPU the ops compute their references
    (nothing compiles): the tests use that to check the calls."""
    from .dispatch import moe_ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.moe)
    from .dispatch import ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.linear)
    from .dispatch.hw import capability_of

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    cap = capability_of(device)
    route = case.linear_route(cap)
    one = torch.ones(1, device=device)
    swizzled = route in ("cublas", "b12x")
    sizes = sorted(case.sizes)
    times = {"linear_s": 0.0, "moe_s": 0.0}
    calls = 0
    for _, n, k in case.linears:
        codes, scales = _random_codes((n, k), device, gen)
        dec = torch.full((n,), 0.01, device=device)
        swz = None
        if swizzled:
            from .format.swizzle import swizzle_128x4

            swz = swizzle_128x4(scales)
        x_all = torch.randn(max(sizes), k, device=device, generator=gen).to(dtype)
        t0 = time.perf_counter()
        for t in sizes:
            torch.ops.nvfp4_sm120.linear(x_all[:t], codes, scales, dec, swz, one, one, None, route)
            calls += 1
            if progress:
                progress(1)
        _sync(device)
        times["linear_s"] += time.perf_counter() - t0
    for h, i, e, top_k in case.moe:
        w13, s13 = _random_codes((e, 2 * i, h), device, gen)
        w2, s2 = _random_codes((e, h, i), device, gen)
        d13 = torch.full((e,), 0.01, device=device)
        d2 = torch.full((e,), 0.01, device=device)
        enc = torch.full((1,), 50.0, device=device) if case.w4a4 else None
        x_all = torch.randn(max(sizes), h, device=device, generator=gen).to(dtype)
        logits = torch.randn(max(sizes), e, device=device, generator=gen)
        tw_all, ti_all = torch.softmax(logits, -1).topk(top_k, -1)
        tw_all, ti_all = (tw_all / tw_all.sum(-1, keepdim=True)).float(), ti_all.to(torch.int32)
        t0 = time.perf_counter()
        for t in sizes:
            out = torch.empty((t, h), dtype=dtype, device=device)
            torch.ops.nvfp4_sm120.moe(x_all[:t], w13, s13, d13, w2, s2, d2, tw_all[:t].contiguous(),
                                      ti_all[:t].contiguous(), enc, enc, None, "silu", False, out)
            calls += 1
            if progress:
                progress(1)
        _sync(device)
        times["moe_s"] += time.perf_counter() - t0
    return {**times, "calls": calls, "route": route}


# ---- parallel compilation ------------------------------------------------------------------------------------------

def work_units(case: Case, cap) -> list[Case]:
    """``case`` as sub-cases (one layer each) whose calls meet disjoint groups of kernel variants: per layer shape
    and plan, split further by what the plan's kernels take as compile-time arguments that follow T (the W4A4
    plans' activation-quantizer tile; the decode kernels' route-vector width and whether their grid is per expert).
    Kernels several groups share (the MoE align and sum kernels) may compile in more than one child; the union of
    the sub-cases' calls is ``case``'s, each once."""
    from .dispatch.linear import act_quant_config, select_linear
    from .dispatch.moe import select_moe_plan
    from .kernels.moe_decode import route_block

    route = case.linear_route(cap)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for layer in case.linears:
        _, n, k = layer
        for t in case.sizes:
            plan = select_linear(cap, route, t, n, k)
            groups[("linear", layer, plan, str(act_quant_config(t, k)) if plan.is_w4a4 else "")].append(t)
    for shape in case.moe:
        h, i, e, top_k = shape
        for t in case.sizes:
            plan = select_moe_plan(cap, num_tokens=t, top_k=top_k, global_experts=e, hidden=h, intermediate=i,
                                   w4a4=case.w4a4)
            decode = (route_block(t * top_k), t * top_k > e) if plan.impl == "decode" else None
            groups[("moe", shape, plan, decode)].append(t)
    units = []
    for (kind, layer, *_), sizes in groups.items():
        linears, moe = ([layer], []) if kind == "linear" else ([], [layer])
        units.append(Case(linears=linears, moe=moe, w4a4=case.w4a4, sizes=tuple(sizes), route=route))
    return units


def _bins(units: list[Case], jobs: int) -> list[list[Case]]:
    """Units into at most ``jobs`` bins of about equal work (a unit's work: one compile group; the MoE ones hold
    several kernels, so they count three times), largest first into the least loaded bin."""
    weight = lambda u: 3 if u.moe else 1  # noqa: E731
    bins: list[list[Case]] = [[] for _ in range(max(1, min(jobs, len(units))))]
    load = [0] * len(bins)
    for u in sorted(units, key=weight, reverse=True):
        j = load.index(min(load))
        bins[j].append(u)
        load[j] += weight(u)
    return [b for b in bins if b]


def _worker(spec: str) -> int:
    """A child of :func:`compile_parallel`: run its sub-cases (JSON, each with its device)."""
    for d in json.loads(spec):
        exercise(Case(linears=[tuple(x) for x in d["linears"]], moe=[tuple(x) for x in d["moe"]], w4a4=d["w4a4"],
                      sizes=tuple(d["sizes"]), route=d["route"]), device=d.get("device", "cuda"))
    return 0


def compile_parallel(case: Case, cap, jobs: int, device: str = "cuda", timeout_s: float | None = None) -> dict:
    """Run ``case``'s work units in ``jobs`` child processes (sharing this environment's Triton cache); returns
    seconds, the number of children and the errors of any that failed (their calls then compile in the caller's
    serial pass)."""
    t0 = time.perf_counter()
    bins = _bins(work_units(case, cap), jobs)
    argv = [sys.executable, "-m", "vllm_nvfp4_sm120.warmup", "--worker"]
    procs = [subprocess.Popen(argv + [json.dumps([asdict(u) | {"device": device} for u in b])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for b in bins]
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = f"timed out after {timeout_s} s"
        if p.returncode:
            errors.append((err or "").strip().splitlines()[-1:] or [f"exit {p.returncode}"])
    return {"parallel_s": time.perf_counter() - t0, "jobs": len(bins), "errors": errors}


def main(args) -> int:
    """The CLI's ``warmup``: ``args.checkpoint``, ``args.dry_run``, ``args.sizes`` (comma list or None)."""
    from .dispatch.hw import SM120_REFERENCE, capability_of

    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
    case = case_from_checkpoint(args.checkpoint, sizes, getattr(args, "route", None))
    on_gpu = torch.cuda.is_available()
    cap = capability_of(torch.device("cuda")) if on_gpu else SM120_REFERENCE
    v = variants(case, cap)
    where = f"{cap.device or cap.name}" if on_gpu else f"{cap.name} (no GPU here: the sm_120 table)"
    print(f"# {args.checkpoint}: {len(case.linears)} linear shapes, {len(case.moe)} MoE layer shapes, "
          f"{len(sizes)} batch sizes, route {case.linear_route(cap)}, on {where}")
    for line in v.lines():
        print(line)
    print(f"# {len(v.linear)} linear plans, {len(v.moe)} MoE plans")
    if args.dry_run:
        return 0
    if not on_gpu:
        print("warmup: compiling needs a CUDA GPU (use --dry-run to list the variants)")
        return 1
    t0 = time.perf_counter()
    jobs = getattr(args, "jobs", 1) or 1
    if jobs > 1:
        par = compile_parallel(case, cap, jobs)
        print(f"# {par['jobs']} processes compiled in {par['parallel_s']:.1f} s"
              + "".join(f"\n# a process failed (its calls compile below): {e}" for e in par["errors"]))
    r = exercise(case)
    cache = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache"
    print(f"# compiled and ran {r['calls']} calls in {time.perf_counter() - t0:.1f} s "
          f"(this process: linear {r['linear_s']:.1f} s, MoE {r['moe_s']:.1f} s); Triton cache: {cache}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        raise SystemExit(_worker(sys.argv[2]))
    raise SystemExit("usage: python -m vllm_nvfp4_sm120.warmup --worker JSON (the CLI is vllm-nvfp4-sm120 warmup)")
