"""What the load-time numerics guard (``vllm_nvfp4_sm120.dispatch.guard``) costs at load on the GPU present.

    source .carry/env.sh && python benchmarks/guard_cost.py [--max-t 8192] [--routes triton,w4a16] [--dtype bf16]

For each distinct NVFP4 layer shape of Qwen3-30B-A3B at TP 1 (qkv 5120 x 2048, o 2048 x 4096, the MoE layer
H 2048 / I 768 / 128 experts / top-8), for a W4A4 checkpoint (route ``triton`` + W4A4 MoE) and a W4A16 one
(route ``w4a16`` + W4A16 MoE): the guard runs as a model load would call it, three times:

* ``cold``: the first call in the process, Triton's JIT compile of every plan included (a serving process pays
  that compile at its first call of each plan anyway, during warm-up or CUDA-graph capture);
* ``warm``: the guard's cache cleared, the kernels compiled: the guard's own cost (synthetic problem, the plans,
  the references on the GPU);
* ``cached``: a second layer of the same shape (the result is reused; what the other 47 layers of the model pay).

Prints one row per (checkpoint, shape): plans checked, the worst verdict, the three times; then the model totals
(distinct shapes only: the layers repeat them).  The goal is a warm total under 2 s for the whole 30B model.
Writes ``$OUT/guard_cost.json`` when ``OUT`` is set.  Runs without vLLM (torch and Triton only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Run as a script from anywhere: the package is the repository's.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_nvfp4_sm120.dispatch import guard as G  # noqa: E402

LINEARS = {"qkv_proj": (5120, 2048), "o_proj": (2048, 4096)}
MOE = dict(hidden=2048, intermediate=768, global_experts=128, top_k=8)
CHECKPOINTS = {"w4a4": ("triton", True), "w4a16": ("w4a16", False)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _verdict(results) -> tuple[bool, float, str]:
    worst = max(results, key=lambda r: (not r.ok, r.comparison.row_err)) if results else None
    if worst is None:
        return True, 0.0, ""
    return all(r.ok for r in results), worst.comparison.row_err, worst.describe()


def measure(checkpoint: str, name: str, run) -> dict:
    G.clear_cache()
    out, cold = _timed(run)
    G.clear_cache()
    out, warm = _timed(run)
    _, cached = _timed(run)
    results = out.results if hasattr(out, "results") else out
    ok, err, worst = _verdict(results)
    row = dict(checkpoint=checkpoint, layer=name, plans=len(results), ok=ok, worst_row_err=err, worst=worst,
               cold_s=cold, warm_s=warm, cached_s=cached,
               fallbacks=[f"{p.tier} -> {f.tier}" for p, f in getattr(out, "fallbacks", {}).items()])
    print(f"{checkpoint:6} {name:10} {len(results):5d} {'ok' if ok else 'FAIL':5} {err:10.2e} "
          f"{cold:8.2f} {warm:8.3f} {cached:9.4f}", flush=True)
    if not ok:
        print(f"       worst: {worst}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-t", type=int, default=8192, help="largest batch size whose plans are checked")
    ap.add_argument("--checkpoints", default=",".join(CHECKPOINTS), help="w4a4,w4a16")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("guard_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"GPU {props.name} (sm_{props.major}{props.minor}), driver {G.driver_version()}, torch {torch.__version__}")
    print(f"{'ckpt':6} {'layer':10} {'plans':>5} {'':5} {'row err':>10} {'cold s':>8} {'warm s':>8} {'cached s':>9}")
    rows = []
    for checkpoint in args.checkpoints.split(","):
        route, w4a4 = CHECKPOINTS[checkpoint]
        for name, (n, k) in LINEARS.items():
            rows.append(measure(checkpoint, name, lambda n=n, k=k, route=route: G.guard_linear(
                route, n, k, dtype, dev, max_t=args.max_t)))
        rows.append(measure(checkpoint, "moe", lambda w4a4=w4a4: G.guard_moe(
            **MOE, w4a4=w4a4, dtype=dtype, device=dev, max_t=args.max_t)))
    totals = {}
    for checkpoint in args.checkpoints.split(","):
        mine = [r for r in rows if r["checkpoint"] == checkpoint]
        totals[checkpoint] = {k: sum(r[k] for r in mine) for k in ("cold_s", "warm_s", "plans")}
        totals[checkpoint]["ok"] = all(r["ok"] for r in mine)
        t = totals[checkpoint]
        print(f"total {checkpoint}: {t['plans']} plans, cold {t['cold_s']:.2f} s (JIT compile included), "
              f"warm {t['warm_s']:.3f} s (goal < 2 s), {'all pass' if t['ok'] else 'FAILURES'}")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "guard_cost.json")
        with open(path, "w") as f:
            json.dump(dict(gpu=props.name, cc=f"{props.major}.{props.minor}", driver=G.driver_version(),
                           torch=torch.__version__, max_t=args.max_t, dtype=args.dtype, rows=rows, totals=totals),
                      f, indent=1)
        print(f"wrote {path}")
    return 0 if all(t["ok"] for t in totals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
