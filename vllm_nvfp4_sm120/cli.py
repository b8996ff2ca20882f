"""``vllm-nvfp4-sm120`` (also ``python -m vllm_nvfp4_sm120``): the user's tools.

    env       this machine: GPU, versions, CUDA toolkit, and which of our kernels would serve NVFP4 layers
    inspect   an NVFP4 checkpoint: format, input scales, fused-global spreads, kernel plan (reads headers only)
    bench     our kernels next to vLLM's NVFP4 kernels and cuBLAS bf16 on this GPU, for a checkpoint's shapes;
              --e2e: vLLM serving the checkpoint with our kernels and with its own (TTFT, decode tokens/s, outputs)
    selftest  every check this machine can run (references, sm_120 compiles, kernels on this GPU) → pass/fail table
    tune      time the dispatch's choices on this GPU and write measured configs the dispatch then uses
    warmup    compile ahead the kernel variants a checkpoint's shapes meet (--dry-run: list them, no GPU needed)

Layer 5: may import every layer.  vLLM is imported only inside ``bench`` (for its kernels; ``--e2e`` in a child
process per arm), so ``env``, ``inspect``, ``selftest`` and ``tune`` also run on a machine with torch and Triton
alone, and so does ``warmup``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .bench import add_compare_args
from .bench import emit_json as _emit_json  # one JSON writer for every tool
from .e2e import add_e2e_args
from .tune import add_tune_args


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


def _warmup(args) -> int:
    from .checkpoint import CheckpointError
    from .warmup import main as warmup_main

    try:
        return warmup_main(args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


# ---- parser --------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
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

    bench = sub.add_parser("bench", help="our kernels vs vLLM's NVFP4 kernels and cuBLAS bf16 on this GPU; --e2e: "
                                         "vLLM serving a checkpoint with ours vs its own")
    add_compare_args(bench)
    add_e2e_args(bench)

    st = sub.add_parser("selftest", help="run every check this machine can run and print a pass/fail table")
    st.add_argument("--only", help="comma list of check kinds: format,compile,gpu")
    st.add_argument("--report", default="selftest-report.json", help="JSON report path ('' to skip)")
    st.add_argument("--match", help="only checks whose name contains this text (case-insensitive)")
    st.add_argument("--quiet", action="store_true", help="no progress line per check")
    st.add_argument("--list", action="store_true", help="list the checks (of --only, --match) and run none")
    st.set_defaults(func=_selftest)

    add_tune_args(sub.add_parser("tune", help="time the dispatch's choices on this GPU and write measured configs"))

    wu = sub.add_parser("warmup", help="compile the kernel variants a checkpoint's shapes meet across vLLM's capture "
                                       "sizes into $TRITON_CACHE_DIR (--dry-run: list them)")
    wu.add_argument("--checkpoint", required=True, help="checkpoint directory (its shapes, read as inspect does)")
    wu.add_argument("--dry-run", action="store_true", help="list the variants, compile nothing (no GPU needed)")
    wu.add_argument("--sizes", help="comma list of batch sizes (default: vLLM's capture sizes and 1k-8k)")
    wu.add_argument("--route", help="linear route (default: the one vLLM's auto choice takes first on this GPU)")
    wu.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes compiling in parallel (default: min(8, CPUs); 1: one after another)")
    wu.set_defaults(func=_warmup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
