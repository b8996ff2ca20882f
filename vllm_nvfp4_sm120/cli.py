"""``vllm-nvfp4-sm120`` (also ``python -m vllm_nvfp4_sm120``): the user's tools.

    env       this machine: GPU, versions, CUDA toolkit, and which of our kernels would serve NVFP4 layers
    inspect   an NVFP4 checkpoint: format, input scales, fused-global spreads, kernel plan (reads headers only)
    bench     our kernels next to vLLM's NVFP4 kernels and cuBLAS bf16 on this GPU, for a checkpoint's shapes
    selftest  every check this machine can run (references, sm_120 compiles, kernels on this GPU) → pass/fail table

Layer 5: may import every layer.  vLLM is imported only inside ``bench`` (for its kernels), so ``env``,
``inspect`` and ``selftest`` also run on a machine with torch and Triton alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path


def _output_path_problem(path: str) -> str | None:
    """Why a file cannot be written to ``path`` (None: it can): checked before the work that fills it."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a folder"
    if not p.parent.is_dir():
        return f"the folder {p.parent} does not exist"
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"{path} is not writable"
    return None


def _emit_json(data, dest: str) -> None:
    text = json.dumps(data, indent=2, default=str)
    if dest == "-":
        print(text)
    else:
        Path(dest).write_text(text)
        print(f"JSON written to {dest}")


# ---- env -----------------------------------------------------------------------------------------------------------

def _env(args: argparse.Namespace) -> int:
    from . import envinfo

    info = envinfo.collect()
    if args.json != "-":
        print(envinfo.format_env(info))
    if args.json:
        _emit_json(info, args.json)
    return 0


# ---- inspect -------------------------------------------------------------------------------------------------------

def _inspect(args: argparse.Namespace) -> int:
    from .inspect_ckpt import CheckpointError, format_report, inspect_checkpoint

    if args.json not in (None, "-") and (why := _output_path_problem(args.json)) is not None:
        print(f"error: --json {args.json}: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nvfp4-tiny-") as tmp:
        path = args.checkpoint
        if path is None:
            from .tiny_checkpoint import write_tiny_checkpoint

            path = write_tiny_checkpoint(Path(tmp) / "tiny", args.demo_format, w4a16=args.w4a16, tokenizer=False)
            print(f"(no CHECKPOINT_DIR given: inspecting a tiny {args.demo_format} demo checkpoint written to {path})")
        try:
            report = inspect_checkpoint(path)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.json != "-":
            print(format_report(report, max_spreads=args.max_spreads))
        if args.json:
            _emit_json(report.to_json(), args.json)
    if report.problems:
        print(f"error: {len(report.problems)} problem(s) in this checkpoint (the PROBLEM lines; 'problems' in the "
              "JSON)", file=sys.stderr)
        return 1
    return 0


# ---- bench ---------------------------------------------------------------------------------------------------------

# vLLM 0.33's NVFP4 linear kernel classes we time (``vllm.model_executor.kernels.linear``), by short name:
# (label, class name, needs activation scales).  Each is used through its public class API
# (``process_weights_after_loading`` + ``apply_weights``), i.e. exactly what a vLLM layer runs.
VLLM_LINEAR_KERNELS = (
    ("vllm-cutlass", "CutlassNvFp4LinearKernel", True),
    ("vllm-flashinfer-cutlass", "FlashInferCutlassNvFp4LinearKernel", True),
    ("vllm-flashinfer-b12x", "FlashInferB12xNvFp4LinearKernel", True),
    ("vllm-b12x", "B12xNvFp4LinearKernel", True),
    ("vllm-flashinfer-cute-dsl-w4a16", "FlashInferCuteDslNvFp4W4A16LinearKernel", False),
    ("vllm-b12x-w4a16", "B12xNvFp4W4A16LinearKernel", False),
    ("vllm-marlin", "MarlinNvFp4LinearKernel", False),
    ("vllm-emulation", "EmulationNvFp4LinearKernel", True),
)
BENCH_GROUPS = ("ours", "vllm", "cublas")


def _progress(total: int, desc: str):
    """tqdm when installed (vLLM brings it), else a plain counter on stderr (the H200 image may lack tqdm)."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)
    except ImportError:
        class _Plain:
            n = 0

            def update(self, k=1):
                self.n += k
                print(f"\r{desc}: {self.n}/{total}", end="", file=sys.stderr, flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                print(file=sys.stderr)

        return _Plain()


def _require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def bench_shapes(args: argparse.Namespace) -> tuple[list[tuple[str, str, int, int]], bool | None]:
    """``[(model, layer, N, K), ...]`` from ``--checkpoint`` (via inspect) or the built-in ``--models``.

    Also returns the checkpoint's W4A4-ness (None for the built-in list: both kinds are timed).
    """
    from .bench import MODELS

    if args.checkpoint:
        from .inspect_ckpt import inspect_checkpoint

        r = inspect_checkpoint(args.checkpoint)
        name = Path(args.checkpoint).name
        return [(name, kind, n, k) for kind, n, k in r.runtime_shapes], r.quant.scheme != "W4A16"
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; built in: {', '.join(MODELS)}")
    return [(m, layer, n, k) for m in args.models.split(",") for layer, n, k in MODELS[m]], None


def _vllm_layer(codes, scales, w_dec, in_dec, n: int, k: int):
    """A stand-in for a vLLM linear layer after the checkpoint is loaded (what a kernel class reads)."""
    import torch

    p = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer = torch.nn.Module()
    layer.weight = p(codes.clone())
    layer.weight_scale = p(scales.clone())
    layer.weight_global_scale = p(w_dec.clone())
    if in_dec is not None:
        layer.input_global_scale = p(in_dec.clone())
        layer.input_global_scale_inv = p((1.0 / in_dec).to(torch.float32))
        layer.alpha = p((in_dec * w_dec).to(torch.float32))
    layer.input_size_per_partition, layer.output_size_per_partition = k, n
    layer.input_size, layer.output_size, layer.logical_widths = k, n, [n]
    layer.params_dtype = torch.bfloat16
    return layer


def vllm_kernel_factories(w4a4: bool | None) -> tuple[dict[str, tuple[type, bool]], dict[str, str]]:
    """``({label: (class, w4a4)}, {label: why skipped})`` for vLLM's kernels that can run on this GPU."""
    skipped: dict[str, str] = {}
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.kernels import linear as L
        from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    except Exception as e:  # vLLM absent (the H200 image) or broken
        return {}, {label: f"vLLM not importable ({type(e).__name__}: {e})" for label, _, _ in VLLM_LINEAR_KERNELS}
    usable = {}
    with set_current_vllm_config(VllmConfig()):
        for label, cls_name, needs_act in VLLM_LINEAR_KERNELS:
            if w4a4 is not None and needs_act != w4a4 and label != "vllm-emulation":
                skipped[label] = "not for this checkpoint's scheme"
                continue
            cls = getattr(L, cls_name, None)
            if cls is None:
                skipped[label] = f"{cls_name} not in this vLLM"
                continue
            try:
                ok, why = cls.is_supported()
                if ok:
                    ok, why = cls.can_implement(NvFp4LinearLayerConfig())
            except Exception as e:
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok:
                skipped[label] = why or "is_supported() is False"
                continue
            usable[label] = (cls, needs_act)
    return usable, skipped


def run_bench(args: argparse.Namespace) -> dict:
    """Time every candidate for every (shape, T); returns ``{"device", "ceilings", "rows", "skipped"}``."""
    import torch

    from .bench import Row, cublas_bf16_tflops, dram_read_tbs, time_graph
    from .dispatch.hw import capability_of
    from .dispatch.linear import select_linear
    from .dispatch.registry import LINEAR_KERNELS
    from .format import NvFp4, random_nvfp4, unit_values

    shapes, ckpt_w4a4 = bench_shapes(args)
    tokens = [int(t) for t in args.tokens.split(",")]
    groups = set(args.kernels.split(","))
    cap = capability_of(torch.device("cuda"))
    vllm_kernels, skipped = vllm_kernel_factories(ckpt_w4a4) if "vllm" in groups else ({}, {})
    ceilings = {"dram_read_tbs": dram_read_tbs(), "cublas_bf16_tflops_8192": cublas_bf16_tflops()}
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    bar = _progress(len(shapes) * len(tokens), "bench")
    w_dec, in_dec = torch.tensor(0.01, device="cuda"), torch.tensor(0.01, device="cuda")
    for model, layer, n, k in shapes:
        wbytes = n * k // 2 + n * k // 16
        copies = max(1, -(-int(args.min_bytes) // wbytes))  # every call reads its weight from DRAM, not L2
        base = random_nvfp4((n, k), gen=gen, device="cuda")
        ws = [base] + [NvFp4(base.codes.clone(), base.scales.clone()) for _ in range(copies - 1)]
        dec_rows = w_dec.expand(n).contiguous()
        in_enc, alpha = 1.0 / in_dec, in_dec * w_dec
        vlayers: dict[str, list] = {}
        for label, (cls, needs_act) in vllm_kernels.items():
            try:
                from vllm.config import VllmConfig, set_current_vllm_config
                from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

                with set_current_vllm_config(VllmConfig()):
                    built = []
                    for w in ws:
                        kern = cls(NvFp4LinearLayerConfig())
                        lay = _vllm_layer(w.codes, w.scales, w_dec, in_dec if needs_act else None, n, k)
                        kern.process_weights_after_loading(lay)
                        built.append((kern, lay))
                vlayers[label] = built
            except Exception as e:
                skipped[f"{label} ({layer} {n}x{k})"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        w_bf16 = None
        if "cublas" in groups:
            wb = unit_values(base.codes, base.scales).to(torch.bfloat16)
            w_bf16 = [wb] + [wb.clone() for _ in range(max(1, -(-int(args.min_bytes) // (2 * n * k))) - 1)]
        for t in tokens:
            x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
            cands: dict[str, tuple[Callable[[], object], int, int]] = {}  # name -> (fn, calls, bytes per call)
            if "ours" in groups:
                routes = {"triton": ckpt_w4a4 is not False, "w4a16": True}
                for route, wanted in routes.items():
                    if not wanted:
                        continue
                    plan = select_linear(cap, route, t, n, k)
                    fn = LINEAR_KERNELS[plan.kernel]
                    cands[f"ours-{route} ({plan.kernel})"] = (
                        lambda fn=fn, plan=plan: [fn(x, w.codes, w.scales, dec_rows, None, in_enc, alpha, None,
                                                     **plan.kwargs) for w in ws], copies, wbytes)
            for label, built in vlayers.items():
                cands[label] = (lambda built=built: [kern.apply_weights(lay, x) for kern, lay in built], copies, wbytes)
            if w_bf16 is not None:
                cands["cublas-bf16"] = (lambda: [x @ w.t() for w in w_bf16], len(w_bf16), 2 * n * k)
            for name, (fn, calls, nbytes) in cands.items():
                bar.set_postfix_str(f"{layer} {n}x{k} T={t} {name}"[:60])
                try:
                    sec = time_graph(fn, repeats=args.repeats) / calls
                except Exception as e:
                    skipped[f"{name} ({layer} {n}x{k} T={t})"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    torch.cuda.synchronize()
                    continue
                rows.append(Row(model, layer, n, k, t, name, sec * 1e6, 2 * t * n * k / sec / 1e12, nbytes / sec / 1e12))
            bar.update(1)
        del ws, vlayers, w_bf16
        torch.cuda.empty_cache()
    bar.close()
    return {"device": f"{torch.cuda.get_device_name()} ({cap.name})", "torch": torch.__version__,
            "ceilings": ceilings, "rows": [asdict(r) for r in rows], "skipped": skipped}


def speedups(rows: list[dict]) -> list[dict]:
    """Per (model, layer, T): our best kernel against vLLM's best NVFP4 kernel and against cuBLAS bf16."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r["model"], r["layer"], r["n"], r["k"], r["t"]), {})[r["kernel"]] = r["us"]
    out = []
    for (model, layer, n, k, t), us in by_key.items():
        ours = {kk: v for kk, v in us.items() if kk.startswith("ours")}
        vllm = {kk: v for kk, v in us.items() if kk.startswith("vllm-") and kk != "vllm-emulation"}
        best_ours = min(ours.items(), key=lambda kv: kv[1]) if ours else None
        best_vllm = min(vllm.items(), key=lambda kv: kv[1]) if vllm else None
        out.append(dict(
            model=model, layer=layer, n=n, k=k, t=t,
            ours=best_ours[0] if best_ours else None, ours_us=best_ours[1] if best_ours else None,
            vllm=best_vllm[0] if best_vllm else None, vllm_us=best_vllm[1] if best_vllm else None,
            cublas_us=us.get("cublas-bf16"),
            vs_vllm=best_vllm[1] / best_ours[1] if best_ours and best_vllm else None,
            vs_cublas=us["cublas-bf16"] / best_ours[1] if best_ours and "cublas-bf16" in us else None,
        ))
    return out


def format_bench_table(result: dict) -> str:
    rows = result["rows"]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    lines = [f"# {result['device']}  torch {result['torch']}  DRAM read {result['ceilings']['dram_read_tbs']:.2f} TB/s, "
             f"cuBLAS bf16 {result['ceilings']['cublas_bf16_tflops_8192']:.0f} TFLOP/s",
             "# microseconds per call (weight read from DRAM); speedup = best vLLM NVFP4 kernel (or cuBLAS bf16) / ours"]
    head = f"{'model':14} {'layer':8} {'N':>6} {'K':>6} {'T':>5} " + " ".join(f"{k[:24]:>24}" for k in kernels)
    lines.append(head + f" {'vs vLLM':>8} {'vs bf16':>8}")
    sp = {(s["model"], s["layer"], s["n"], s["k"], s["t"]): s for s in speedups(rows)}
    us = {(r["model"], r["layer"], r["n"], r["k"], r["t"], r["kernel"]): r["us"] for r in rows}
    for key, s in sp.items():
        cells = " ".join(f"{us[(*key, kk)]:24.1f}" if (*key, kk) in us else f"{'-':>24}" for kk in kernels)
        fmt = lambda v: f"{v:7.2f}x" if v else f"{'-':>8}"  # noqa: E731
        lines.append(f"{key[0][:14]:14} {key[1][:8]:8} {key[2]:6} {key[3]:6} {key[4]:5} {cells} "
                     f"{fmt(s['vs_vllm'])} {fmt(s['vs_cublas'])}")
    if result["skipped"]:
        lines.append("# not run:")
        lines += [f"#   {k}: {v}" for k, v in result["skipped"].items()]
    return "\n".join(lines)


def plot_speedups(result: dict, path: str, plt) -> None:
    sp = speedups(result["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    for ax, key, title in ((axes[0], "vs_vllm", "ours vs vLLM's best NVFP4 kernel"),
                           (axes[1], "vs_cublas", "ours vs cuBLAS bf16")):
        series: dict[str, list[tuple[int, float]]] = {}
        for s in sp:
            if s[key]:
                series.setdefault(f"{s['model']} {s['layer']} {s['n']}x{s['k']}", []).append((s["t"], s[key]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (T)")
        ax.set_ylabel("speedup (x)")
        ax.set_title(title)
        if series:
            ax.legend(fontsize=7)
    fig.suptitle(result["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .inspect_ckpt import CheckpointError

    unknown = set(args.kernels.split(",")) - set(BENCH_GROUPS)
    if unknown:
        print(f"error: --kernels: unknown {sorted(unknown)}; choose from {','.join(BENCH_GROUPS)}", file=sys.stderr)
        return 2
    plt = None
    if args.plot:
        plt = _require_matplotlib()
        if plt is None:
            print("error: --plot needs matplotlib, which is not installed (pip install matplotlib); "
                  "run without --plot, or with --json and plot later", file=sys.stderr)
            return 2
    try:
        bench_shapes(args)  # validate the shapes source before asking for a GPU
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench needs a CUDA GPU (none visible); `env` and `selftest` run without one", file=sys.stderr)
        return 2
    result = run_bench(args)
    print(format_bench_table(result))
    if args.json:
        _emit_json(dict(result, speedups=speedups(result["rows"])), args.json)
    if plt is not None:
        plot_speedups(result, args.plot, plt)
        print(f"plot written to {args.plot}")
    return 0


# ---- selftest ------------------------------------------------------------------------------------------------------

def _selftest(args: argparse.Namespace) -> int:
    import torch

    from . import selftest

    kinds = tuple(args.only.split(",")) if args.only else selftest.KINDS
    unknown = set(kinds) - set(selftest.KINDS)
    if unknown:
        print(f"error: --only: unknown kinds {sorted(unknown)}; choose from {','.join(selftest.KINDS)}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(f"{kind:8} {name}" for kind, name, _ in selftest.selected(kinds, args.match)))
        return 0
    if args.only and "gpu" in kinds and not torch.cuda.is_available():
        print("error: --only gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False), so the gpu checks "
              "cannot run; without --only, selftest runs the checks this machine can", file=sys.stderr)
        return 2
    if not selftest.selected(kinds, args.match):
        print(f"error: --match {args.match!r}: none of the {len(selftest.selected(kinds))} {'/'.join(kinds)} checks "
              "has it in its name (--list shows them)", file=sys.stderr)
        return 2
    if args.report and (why := _output_path_problem(args.report)) is not None:
        print(f"error: --report {args.report}: {why} (nothing was run)", file=sys.stderr)
        return 2
    results = selftest.run(kinds, progress=not args.quiet, match=args.match)
    print(selftest.format_table(results))
    not_run = [r for r in results if r.status == "SKIP"]
    if not_run:
        print(f"could not run here ({len(not_run)}): " + "; ".join(sorted({r.detail for r in not_run})))
    if args.report:
        try:
            selftest.write_report(results, args.report)
        except OSError as e:
            print(f"error: --report {args.report}: cannot write it ({e.strerror}); the table above has the results",
                  file=sys.stderr)
            return 2
        print(f"report written to {args.report} (share it: it has the GPU, driver, versions and every result)")
    return 1 if any(r.status == "FAIL" for r in results) else 0


# ---- parser --------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from .bench import MODELS

    parser = argparse.ArgumentParser(prog="vllm-nvfp4-sm120", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="GPU, versions, CUDA toolkit, Gluon, and the kernel plan on this GPU")
    env.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-': JSON only, to stdout)")
    env.set_defaults(func=_env)

    ins = sub.add_parser("inspect", help="format, input scales, fused-global spreads and kernel plan of a checkpoint")
    ins.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: a tiny demo checkpoint)")
    ins.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-': JSON only, to stdout)")
    ins.add_argument("--max-spreads", type=int, default=8, help="fused groups listed in the text report")
    ins.add_argument("--demo-format", default="modelopt", choices=["modelopt", "compressed-tensors"],
                     help="format of the demo checkpoint (no CHECKPOINT_DIR)")
    ins.add_argument("--w4a16", action="store_true", help="demo checkpoint: weight-only (W4A16)")
    ins.set_defaults(func=_inspect)

    b = sub.add_parser("bench", help="our kernels vs vLLM's NVFP4 kernels and cuBLAS bf16 on this GPU")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="time the linear shapes of this checkpoint")
    src.add_argument("--models", default=",".join(MODELS), help=f"built-in shape lists: {', '.join(MODELS)}")
    b.add_argument("--tokens", default="1,4,16,64,256,2048,8192", help="batch sizes T")
    b.add_argument("--kernels", default=",".join(BENCH_GROUPS), help=f"groups: {','.join(BENCH_GROUPS)}")
    b.add_argument("--min-bytes", type=float, default=2e9, help="weight bytes per timed run (defeats the L2)")
    b.add_argument("--repeats", type=int, default=20, help="graph replays per measurement (median)")
    b.add_argument("--plot", metavar="PNG", help="write a speedup-vs-tokens plot (needs matplotlib)")
    b.add_argument("--json", metavar="PATH", help="write rows, speedups and skips as JSON ('-': stdout)")
    b.set_defaults(func=_bench)

    st = sub.add_parser("selftest", help="run every check this machine can run and print a pass/fail table")
    st.add_argument("--only", help="comma list of check kinds: format,compile,gpu")
    st.add_argument("--report", default="selftest-report.json", help="JSON report path ('' to skip)")
    st.add_argument("--match", help="only checks whose name contains this text (case-insensitive)")
    st.add_argument("--quiet", action="store_true", help="no progress line per check")
    st.add_argument("--list", action="store_true", help="list the checks (of --only, --match) and run none")
    st.set_defaults(func=_selftest)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
