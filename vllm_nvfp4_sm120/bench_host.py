"""``python -m vllm_nvfp4_sm120.bench host [--cold]``: host time per call of the plugin's ops, and cold start.

Prefill runs outside CUDA graphs, so every call pays its Python dispatch and launch cost on the host; when that
exceeds the layer's GPU time the GPU idles.  Method (eager, tiny shapes so the GPU work is negligible):
- each candidate is called ``CALLS`` times back to back and timed with a CPU clock; ``host us`` is the loop's time
  per call *before* the final ``torch.cuda.synchronize()`` (what the host spent), ``synced us`` includes it (if it is
  much larger, the GPU, not the host, bounded the loop); median over ``ROUNDS`` rounds, after warm-up calls.  The
  rounds interleave the candidates (round r times every candidate once, in order), and each ratio below is the
  median of the per-round ratios: the host's speed drifts within a run (the same trivial launch measured 19 and 26
  us minutes apart on one H200 machine), and a drift then moves a row and its reference together;
- kernels per call are counted in a separate, untimed pass with the torch profiler (Triton kernels, cuBLAS, memsets);
- a cuBLAS ``x @ w.t()`` and trivial Triton launches are measured in the same run: host speed varies by machine, so
  the ratios to them are what compare across machines (goal: an op ≤ 2 x a trivial launch per kernel it launches);
- ``JIT-path launches/call``: the launches of the plugin's ready kernels (``kernels/launch.py``) that went through
  Triton's JIT path instead of the fast path, per call (about 0 when the fast path is in effect; >= 1 means a
  ready kernel falls back on every call); one Triton launch, the decode gate_up kernel, is also timed both ways.

``--cold``: compile time of two Qwen3-30B-A3B linear shapes and one of its MoE layers over vLLM's capture sizes
(and 1k-8k), in a child process with an empty ``TRITON_CACHE_DIR`` (cold: what a first start pays), then again with
that cache (warm); then, with another empty cache, ``warmup --jobs N``'s way (``warmup.compile_parallel``: the
variants compiled in N processes, then every call once in the child).  Needs torch and Triton only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

CALLS = 200
ROUNDS = 5
LINEAR_SHAPE = (512, 512)  # N, K: tiny, so the kernels take a few microseconds
LINEAR_TOKENS = (1, 16, 128, 512)
MOE_SHAPE = (256, 128, 8, 2)  # H, I, E, top_k
# The cold-start case: Qwen3-30B-A3B's qkv and o projections and one MoE layer (H, I, E, top_k).
COLD_LINEARS = [("qkv", 5120, 2048), ("o", 2048, 4096)]
COLD_MOE = [(2048, 768, 128, 8)]
# Child-process limits of --cold: the cold run (default; --timeout), the warm one and the parallel one.
COLD_TIMEOUT_S = 110.0
WARM_TIMEOUT_S = 35.0
PARALLEL_TIMEOUT_S = 60.0
COLD_JOBS = 8


@triton.jit
def _trivial(ptr):
    tl.store(ptr, 1.0)


@triton.jit
def _trivial_12(p0, p1, p2, p3, p4, p5, n0, n1, n2, n3, n4, n5, BLOCK: tl.constexpr):
    tl.store(p0, (n0 + n1 + n2 + n3 + n4 + n5).to(tl.float32))


def kernels_per_call(fn, calls: int = 4) -> float | None:
    """GPU activities (kernels, memsets, copies) per call of ``fn``, from the torch profiler; None if it fails."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
        return n / calls if n else None
    except Exception:  # the profiler is a diagnostic here; its absence must not lose the timings
        return None


def _noop_ops():
    """A no-op op registered the direct way (``torch.library.Library``) and one with ``torch.library.custom_op``."""
    from torch.library import Library

    lib = Library("nvfp4_sm120_bench", "FRAGMENT")
    lib.define("noop(Tensor x) -> ()")
    lib.impl("noop", lambda x: None, "CUDA")

    @torch.library.custom_op("nvfp4_sm120_bench::noop_custom", mutates_args=())
    def noop_custom(x: torch.Tensor) -> None:
        return None

    return lib, torch.ops.nvfp4_sm120_bench.noop, noop_custom


class _Rows:
    """The candidates of one run, timed in interleaved rounds (see the module docstring).  :meth:`add` warms a
    candidate up (a route this GPU cannot run is reported then, as a row that did not run); :meth:`measure` times
    them all and fills the rows."""

    def __init__(self):
        self.rows: list[dict] = []
        self._cands: list[tuple[dict, object, bool]] = []

    def add(self, name: str, fn, *, note: str = "", kernels: float | None = None, count: bool = True) -> None:
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        except Exception as e:  # a route this GPU cannot run: say why, keep going
            self.rows.append(dict(call=name, host_us=None, synced_us=None, kernels=None,
                                  note=f"not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            print(f"{name:58} not run: {self.rows[-1]['note']}", flush=True)
            return
        row = dict(call=name, host_us=None, synced_us=None, kernels=kernels, jit_path_per_call=None, note=note)
        self.rows.append(row)
        self._cands.append((row, fn, count and kernels is None))

    def measure(self, calls: int = CALLS, rounds: int = ROUNDS) -> None:
        from .kernels import launch

        host: list[list[float]] = [[] for _ in self._cands]
        synced: list[list[float]] = [[] for _ in self._cands]
        jit = [0] * len(self._cands)
        for _ in range(rounds):
            for j, (_, fn, _) in enumerate(self._cands):
                jit0 = launch.jit_launches
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                jit[j] += launch.jit_launches - jit0
                host[j].append((t1 - t0) / calls * 1e6)
                synced[j].append((t2 - t0) / calls * 1e6)
        for j, (row, fn, count) in enumerate(self._cands):
            row["host_us"], row["synced_us"] = statistics.median(host[j]), statistics.median(synced[j])
            row["round_us"] = host[j]
            # Ready-kernel launches that took Triton's JIT path, per timed call: about 0 where the fast path is in
            # effect, >= 1 per ready kernel of the call where it is not.
            row["jit_path_per_call"] = jit[j] / (calls * rounds)
            if count:
                row["kernels"] = kernels_per_call(fn)
            k = f"{row['kernels']:4.1f}" if row["kernels"] is not None else "   ?"
            print(f"{row['call']:58} {row['host_us']:8.1f} us  (synced {row['synced_us']:8.1f})  kernels/call {k}  "
                  f"JIT-path launches/call {row['jit_path_per_call']:5.2f}  {row['note']}", flush=True)


def _ratio(row: dict, ref: dict | None) -> float | None:
    """Median over rounds of ``row``'s host time over ``ref``'s in the same round."""
    if ref is None or row.get("round_us") is None or ref.get("round_us") is None:
        return None
    return statistics.median(a / b for a, b in zip(row["round_us"], ref["round_us"]))


def _fast(ready) -> bool:
    """Whether a ready kernel's last call took (and its next will take) the fast path."""
    return ready._variant is not None


def _decode_gate_up_rows(rows: "_Rows", plan, x, w13, d13, ti) -> None:
    """One heavy kernel (the decode gate_up, ~45 arguments with its constexprs) launched by Triton's JIT path and by
    the ready kernel's fast path: the same ready launcher, built with the fast path off and on."""
    from .kernels import launch
    from .kernels.moe_decode import prepare_moe_decode_gate_up

    t, h = x.shape
    e, two_i = w13.codes.shape[:2]
    sf = w13.scales.view(torch.uint8)
    for fast in (False, True):
        launch.ENABLED = fast
        try:
            run = prepare_moe_decode_gate_up(t, h, two_i // 2, e, ti.shape[1], e, x.device, tile=plan.gate_up,
                                             activation="silu", has_map=False, zero_numel=None)
        finally:
            launch.ENABLED = True
        out = torch.empty((t * ti.shape[1], two_i // 2), dtype=x.dtype, device=x.device)
        rows.add(f"  decode gate_up ready launcher, {'fast' if fast else 'JIT'} path T={t}",
             lambda run=run, out=out: run(x, w13.codes, sf, d13, ti, ti, out), count=False, kernels=1.0,
             note="TMA descriptors made per call" if plan.gate_up.use_tma else "")


def bench_host() -> dict:
    from .bench import gpu_nvfp4
    from .dispatch import moe_ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.moe)
    from .dispatch import ops  # noqa: F401  (registers torch.ops.nvfp4_sm120.linear)
    from .dispatch.hw import capability_of
    from .dispatch.linear import ROUTES, Route, select_linear
    from .dispatch.moe_flow import plan_for
    from .dispatch.registry import LINEAR_KERNELS
    from .format.swizzle import swizzle_128x4
    from .kernels.launch import ReadyKernel
    from .kernels.moe_decode import DecodeTile

    dev = torch.device("cuda")
    cap = capability_of(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} ({cap.name}), torch {torch.__version__}, triton {triton.__version__}; "
          f"{CALLS} calls x {ROUNDS} rounds per row", flush=True)
    rows = _Rows()

    # References: what a launch costs on this host.
    n, k = LINEAR_SHAPE
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    buf = torch.zeros(16, device=dev)
    rows.add("cublas x @ w.t() (T=1, bf16)", lambda: x1 @ w.t())
    rows.add("trivial Triton launch (1 arg)", lambda: _trivial[(1,)](buf))
    rows.add("trivial Triton launch (12 args)", lambda: _trivial_12[(1,)](buf, buf, buf, buf, buf, buf,
                                                                           1, 2, 3, 4, 5, 6, BLOCK=16))
    ready_12 = ReadyKernel(_trivial_12, (1,), BLOCK=16)
    args_12 = (buf, buf, buf, buf, buf, buf, 1, 2, 3, 4, 5, 6)
    ready_12(*args_12)  # the JIT's launch: the variant the fast path then takes
    rows.add("trivial Triton launch (12 args), ReadyKernel", lambda: ready_12(*args_12),
         note="fast path" if _fast(ready_12) else "JIT path (fast path unavailable)")
    lib, noop, noop_custom = _noop_ops()
    rows.add("no-op op, torch.library.Library define + impl", lambda: noop(x1), count=False)
    rows.add("no-op op, torch.library.custom_op", lambda: noop_custom(x1), count=False)

    # The linear op, every route the GPU can run.
    q = gpu_nvfp4((n, k), gen)
    dec = torch.full((n,), 0.01, device=dev)
    one = torch.ones(1, device=dev)
    swz = swizzle_128x4(q.scales)
    for route in ROUTES:
        if route == Route.FLASHINFER_W4A16:
            continue  # its own op, on FlashInfer's prepared weight (not on the H200)
        for t in LINEAR_TOKENS:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            s = swz if route in (Route.CUBLAS, Route.B12X) else None
            try:
                plan = select_linear(cap, route, t, n, k)
            except ValueError as e:
                rows.rows.append(dict(call=f"linear {route} T={t}", host_us=None, synced_us=None, kernels=None,
                                 note=f"not run: {e}"))
                print(f"linear {route} T={t}: not run: {e}", flush=True)
                break
            tile = ",".join(f"{a}={b}" for a, b in plan.params)
            rows.add(f"torch.ops.nvfp4_sm120.linear {route} T={t}",
                 lambda x=x, s=s, route=route: torch.ops.nvfp4_sm120.linear(x, q.codes, q.scales, dec, s, one, one,
                                                                            None, route),
                 note=f"{plan.kernel}({tile})")
            rows.add(f"  its launcher (validating, no op) T={t}",
                 lambda x=x, s=s, plan=plan: LINEAR_KERNELS[plan.kernel](x, q.codes, q.scales, dec, s, one, one, None,
                                                                        **plan.kwargs), count=False)

    # The MoE op: the plans of T = 1 and 512, W4A16 and W4A4.
    h, i, e, top_k = MOE_SHAPE
    w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
    d13, d2 = torch.full((e,), 0.01, device=dev), torch.full((e,), 0.01, device=dev)
    enc = torch.full((1,), 50.0, device=dev)
    for t, w4a4 in ((1, False), (512, False), (1, True), (512, True)):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        tw, ti = torch.softmax(torch.randn(t, e, device=dev, generator=gen), -1).topk(top_k, -1)
        tw, ti = (tw / tw.sum(-1, keepdim=True)).float().contiguous(), ti.to(torch.int32).contiguous()
        out = torch.empty((t, h), device=dev, dtype=torch.bfloat16)
        a = enc if w4a4 else None
        plan = plan_for(x, w13.codes, w2.codes, ti, w4a4=w4a4)
        rows.add(f"torch.ops.nvfp4_sm120.moe {'W4A4' if w4a4 else 'W4A16'} checkpoint T={t}",
             lambda x=x, tw=tw, ti=ti, out=out, a=a: torch.ops.nvfp4_sm120.moe(
                 x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a, a, None, "silu", False, out),
             note=f"{plan.kernel} {plan.impl} block_m={plan.block_m}")
        if t == 1 and not w4a4 and plan.impl == "decode" and isinstance(plan.gate_up, DecodeTile):
            _decode_gate_up_rows(rows, plan, x, w13, d13, ti)

    print(f"# timing {len(rows._cands)} calls in {ROUNDS} interleaved rounds", flush=True)
    rows.measure()
    del lib  # the no-op ops' library: alive until their rows are timed
    trivial = next((r for r in rows.rows if r["call"].startswith("trivial Triton launch (12")), None)
    cublas = rows.rows[0]
    print("\n# ratios (median of per-round ratios): host us / trivial Triton launch (12 args); per kernel: / (kernels "
          "per call x that)", flush=True)
    for r in rows.rows:
        if r["host_us"] is None or trivial is None:
            continue
        r["x_trivial"] = _ratio(r, trivial)
        r["x_cublas"] = _ratio(r, cublas)
        per = r["x_trivial"] / r["kernels"] if r.get("kernels") else None
        r["x_trivial_per_kernel"] = per
        per_s = f"{per:5.2f}" if per is not None else "    ?"
        print(f"{r['call']:58} x trivial {r['x_trivial']:6.2f}  per kernel {per_s}  x cuBLAS {r['x_cublas']:6.2f}")
    return {"device": torch.cuda.get_device_name(), "cc": cap.cc, "torch": torch.__version__,
            "triton": triton.__version__, "calls": CALLS, "rounds": ROUNDS, "interleaved": True, "rows": rows.rows}


# ---- cold start --------------------------------------------------------------------------------------------------

def _cold_worker(sizes: tuple[int, ...], jobs: int = 1) -> dict:
    """In a child process: run the cold-start case once (compiling what the cache lacks; ``jobs > 1``: first
    ``warmup.compile_parallel`` in that many processes); seconds and calls."""
    from .dispatch.hw import capability_of
    from .warmup import Case, compile_parallel, exercise

    case = Case(linears=COLD_LINEARS, moe=COLD_MOE, w4a4=True, sizes=sizes)
    t0 = time.perf_counter()
    par = compile_parallel(case, capability_of(torch.device("cuda")), jobs) if jobs > 1 else {}
    r = exercise(case)
    return {**r, **par, "total_s": time.perf_counter() - t0}


def _files(d: Path) -> int:
    return sum(1 for p in d.rglob("*") if p.is_file())


def bench_cold(sizes: tuple[int, ...], timeout_s: float, jobs: int = COLD_JOBS) -> dict:
    """The cold-start case in a child process with an empty Triton cache, then warm with that cache; then with a
    second empty cache the parallel way (``jobs`` compiling processes first; skipped when ``jobs`` < 2)."""
    results = {"sizes": list(sizes), "linears": COLD_LINEARS, "moe": COLD_MOE, "jobs": jobs}
    with tempfile.TemporaryDirectory(prefix="triton-cold-") as cache, \
            tempfile.TemporaryDirectory(prefix="triton-par-") as par_cache:
        argv = [sys.executable, "-m", "vllm_nvfp4_sm120.bench_host", "--cold-worker", ",".join(map(str, sizes))]
        phases = [("cold", cache, 1, timeout_s), ("warm", cache, 1, WARM_TIMEOUT_S)]
        if jobs > 1:
            phases.append(("parallel", par_cache, jobs, PARALLEL_TIMEOUT_S))
        for phase, where, n, limit in phases:
            env = {**os.environ, "TRITON_CACHE_DIR": where}
            t0 = time.perf_counter()
            try:
                p = subprocess.run(argv + [str(n)], env=env, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired:
                results[phase] = {"error": f"timed out after {limit:.0f} s", "cache_files": _files(Path(where))}
                print(f"{phase}: timed out after {limit:.0f} s ({results[phase]['cache_files']} cache files by then)",
                      flush=True)
                if phase == "cold":
                    break
                continue
            if p.returncode:
                results[phase] = {"error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
                print(f"{phase}: failed: {p.stderr.strip()[-2000:]}", flush=True)
                break
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["process_s"] = time.perf_counter() - t0
            r["cache_files"] = _files(Path(where))
            results[phase] = r
            par = (f"; {r['jobs']} compiling processes {r['parallel_s']:.1f} s, then this pass"
                   + (f"; failed processes: {r['errors']}" if r.get("errors") else "")) if "parallel_s" in r else ""
            print(f"{phase}: {r['total_s']:.1f} s for {r['calls']} calls (linear {r['linear_s']:.1f} s, MoE "
                  f"{r['moe_s']:.1f} s; route {r['route']}{par}); process {r['process_s']:.1f} s; Triton cache "
                  f"{r['cache_files']} files", flush=True)
    return results


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cold", action="store_true", help="cold/warm compile time of the Qwen3-30B-A3B case instead")
    p.add_argument("--sizes", help="--cold: comma list of batch sizes (default: vLLM's capture sizes and 1k-8k)")
    p.add_argument("--timeout", type=float, default=COLD_TIMEOUT_S, help="--cold: seconds for the cold child process")
    p.add_argument("--jobs", type=int, default=COLD_JOBS, help="--cold: compiling processes of the parallel phase "
                                                                "(< 2: no parallel phase)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    from .bench import emit_json
    from .warmup import DEFAULT_SIZES

    if not torch.cuda.is_available():
        print("bench host: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cold:
        sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
        result = bench_cold(sizes, args.timeout, args.jobs)
    else:
        result = bench_host()
    if args.json:
        emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--cold-worker":
        jobs = int(sys.argv[3]) if len(sys.argv) == 4 else 1
        print(json.dumps(_cold_worker(tuple(int(s) for s in sys.argv[2].split(",")), jobs)))
        sys.exit(0)
    parser = argparse.ArgumentParser(prog="python -m vllm_nvfp4_sm120.bench host")
    add_args(parser)
    sys.exit(run(parser.parse_args()))
