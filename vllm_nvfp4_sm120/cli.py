"""``vllm-nvfp4-sm120`` (also ``python -m vllm_nvfp4_sm120``): the user's tools.

Layer 5: may import every layer.  ``selftest`` is the main command; ``env``, ``inspect`` and ``bench`` come with
the CLI issue.
"""

from __future__ import annotations

import argparse
import sys


def _selftest(args: argparse.Namespace) -> int:
    from . import selftest

    kinds = tuple(args.only.split(",")) if args.only else ("format", "compile", "gpu")
    results = selftest.run(kinds)
    print(selftest.format_table(results))
    if args.report:
        selftest.write_report(results, args.report)
        print(f"report written to {args.report}")
    return 1 if any(r.status == "FAIL" for r in results) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-nvfp4-sm120", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("selftest", help="run every check this machine can run and print a pass/fail table")
    st.add_argument("--only", help="comma list of check kinds: format,compile,gpu")
    st.add_argument("--report", default="selftest-report.json", help="JSON report path ('' to skip)")
    st.set_defaults(func=_selftest)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
