"""Does a decode MoE layer's down kernel run during its gate_up kernel?  Kernel start / end times inside CUDA-graph
replays, from the profiler's CUPTI records (which keep concurrent kernels' real times).

    source .carry/env.sh && python benchmarks/moe_decode_overlap.py --out $OUT \
        --pairs qwen3-30b-a3b:1:gu-n16k256-kw4-st3-shift+exp-n64k256-w2-st2-shift-pdl,...

A ``-pdl`` down tile is launched as a programmatic dependent of the gate_up kernel, which signals its dependents as
each of its programs starts: the down programs may then start, route and prefetch their weights into L2 while the
gate_up programs still run, and wait (``griddepcontrol.wait``) only before they read the intermediate.  Whether that
happens under graph capture, and how long before the gate_up's end the down kernel starts, is what this prints, per
pair: the layer's graph time (median), each kernel's median duration in the profile, and the median of
``gate_up end - down start`` (positive: the two overlapped by that much; negative: the gap between them).  (Eager
calls tell nothing here: the validating launchers' host time puts ~0.2 ms between the kernels.)  Every pair is
checked against ``format.moe_ref`` first.  Each call of the graph runs on its own copy of the banks (several L2
sizes in all), as in ``moe_decode_sweep.py``, whose tables and helpers this uses.  Runs without vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_decode_sweep as sweep  # noqa: E402

from vllm_nvfp4_sm120.bench import dram_read_tbs, time_graph  # noqa: E402
from vllm_nvfp4_sm120.format import NvFp4, moe_ref  # noqa: E402
from vllm_nvfp4_sm120.kernels.moe_decode import moe_decode  # noqa: E402


def kernel_spans(trace: dict) -> list[tuple[str, float, float]]:
    """``(name, start µs, end µs)`` of every GPU kernel in a chrome trace of ``torch.profiler``, by start time."""
    spans = [(ev["name"], float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
             for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel" and "dur" in ev]
    return sorted(spans, key=lambda s: s[1])


def layer_overlaps(spans, gate_key: str = "moe_decode_gate_up", down_key: str = "moe_decode_down") -> list[dict]:
    """For each gate_up kernel, its layer's down kernel (the first that starts after it, before the next gate_up
    kernel starts; none: the layer is skipped): both durations and ``gate_up end - down start`` (positive: overlap)."""
    out = []
    for j, (name, g0, g1) in enumerate(spans):
        if gate_key not in name:
            continue
        nxt = None
        for s in spans[j + 1:]:
            if gate_key in s[0]:
                break
            if down_key in s[0]:
                nxt = s
                break
        if nxt is None:
            continue
        out.append({"gate_up_us": g1 - g0, "down_us": nxt[2] - nxt[1], "overlap_us": g1 - nxt[1],
                    "span_us": nxt[2] - g0})
    return out


def measure(shape: str, t: int, gname: str, dname: str, copies: int, repeats: int, device) -> dict:
    h, i, e, k = sweep.SHAPES[shape]
    kind, det, dtile = sweep.DOWN[dname]
    gtile = sweep.GATE_UP[gname]
    gen = torch.Generator(device=device).manual_seed(0)
    banks = [(sweep._bank(e, 2 * i, h, gen, device), sweep._bank(e, h, i, gen, device)) for _ in range(copies)]
    routes = [sweep._routing(t, e, k, gen, device) for _ in range(copies)]
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(x)

    def layer(c):
        (c13, s13, d13), (c2, s2, d2) = banks[c]
        return moe_decode(x, c13, s13, d13, c2, s2, d2, *routes[c], gate_up_tile=gtile, down_tile=dtile, down=kind,
                          deterministic=det, out=out)

    (c13, s13, d13), (c2, s2, d2) = banks[0]
    ok, err = sweep._close(layer(0).clone(), moe_ref(x, NvFp4(c13, s13), d13, NvFp4(c2, s2), d2, *routes[0]))
    row = {"shape": shape, "T": t, "pair": f"{gname}+{dname}", "ok": ok, "max_rel_error": err}
    if not ok:
        return row
    calls = lambda: [layer(c) for c in range(copies)]  # noqa: E731
    row["layer_us"] = time_graph(calls, repeats) / copies * 1e6
    graph = torch.cuda.CUDAGraph()
    calls()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            spans = kernel_spans(json.load(f))
    pairs = layer_overlaps(spans)
    row["profiled_layers"] = len(pairs)
    for key in ("gate_up_us", "down_us", "overlap_us", "span_us"):
        vals = [p[key] for p in pairs]
        row[key] = statistics.median(vals) if vals else math.nan
        row[key.replace("_us", "_min_us")] = min(vals) if vals else math.nan
        row[key.replace("_us", "_max_us")] = max(vals) if vals else math.nan
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", required=True, help="SHAPE:T:GATE_UP+DOWN,... (the sweep's tile names)")
    ap.add_argument("--copies", type=int, default=8, help="calls per graph, each on its own bank copy")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for moe_decode_overlap.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_decode_overlap.py: needs a CUDA GPU (kernel times come from CUPTI)")
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  DRAM read {dram_read_tbs():.2f} TB/s",
          flush=True)
    rows = []
    for spec in args.pairs.split(","):
        shape, t, pair = spec.split(":")
        gname, dname = pair.split("+")
        row = measure(shape, int(t), gname, dname, args.copies, args.repeats, device)
        rows.append(row)
        if not row["ok"]:
            print(f"FAIL {spec}: max error {row['max_rel_error']:.3g} of max |ref|", flush=True)
            continue
        print(f"{shape} T={t} {pair}: layer {row['layer_us']:.1f} us; profiled ({row['profiled_layers']} layers): "
              f"gate_up {row['gate_up_us']:.1f}, down {row['down_us']:.1f}, gate_up end - down start "
              f"{row['overlap_us']:.2f} (min {row['overlap_min_us']:.2f}, max {row['overlap_max_us']:.2f}), "
              f"span {row['span_us']:.1f}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_decode_overlap.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
