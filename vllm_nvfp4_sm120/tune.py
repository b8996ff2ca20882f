"""``vllm-nvfp4-sm120 tune``: time, on the GPU present, the choices the dispatch makes between kernels and tiles,
and write the measured configs (``dispatch/configs.py``) that the dispatch then uses on this GPU model.

What is measured (pure functions, no GPU: :func:`linear_points`, :func:`moe_points`):

- the built-in table's *segments* for a layer shape: the ranges of T over which it picks one kernel and tile;
- *points*: both sides of every segment boundary (T = b - 1 and b: each threshold's two sides) and a grid of T, or
  exactly the ``--tokens`` given;
- *candidates* at a point: every tile of the kernels of its segment and of the two neighbouring segments, so both
  sides of a threshold are timed with both kernels, plus every decode kernel that serves this T (Gluon and Triton);
  for MoE layers, the BLOCK_M tiers of those segments on Triton and Gluon, W4A16 and (W4A4 layers) W4A4, and the
  decode plan (``w4a16/decode/bm0``, its tiles at the point's T) where it or its neighbour segment is the table's.

How (the bench's method, ``bench.py``): each candidate is first checked against the torch reference of ``format/``
(relative error at most :data:`REL_TOL`) and left out if it fails or cannot run; the others are timed side by side
on the same inputs as the median of CUDA-graph replays, each replay calling the kernel once per weight copy, with
copies totalling ``--min-bytes`` so that every call reads its weight from DRAM (MoE layers: one copy, their expert
banks are larger than L2).

What is written (:func:`pick_winner`, :func:`compose_rows`): the winner of each point is the built-in choice unless
another candidate is faster by more than ``--min-gain`` (a documented default is not moved on noise); consecutive
points with the same winner become one row, and T between points with different winners, or outside the measured
points, stays with the built-in table.  Files go to ``--out``, merged with the ones there, one per (device, family).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .dispatch import configs
from .dispatch.configs import choice_label
from .dispatch.hw import Capability, Family
from .dispatch.linear import GLUON_GEMV_FAMILIES, LinearKernel, table_linear
from .dispatch.moe import Impl, MoeKernel, table_moe_plan, tier_plan
from .kernels.gluon_compat import gluon_enabled
from .kernels.moe_decode import MAX_ROUTES as MAX_DECODE_ROUTES

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MOE_GRID = (1, 4, 16, 64, 256, 1024, 4096)
T_MAX = 8192  # vLLM's default max_num_batched_tokens: the largest T a call sees unless the user raises it
TUNE_ROUTES = ("w4a16", "triton")  # the vendor routes need their load-time weight preparation: not tuned yet
MIN_GAIN = 0.03
# The candidate must compute the layer: ||out - ref|| / ||ref||.  Exact decodes and fp32 sums leave bf16 rounding
# of the output (2^-9 relative) and summation order; a wrong tile or kernel is off by O(1).
REL_TOL = 1e-2
DECODE_KERNELS = (LinearKernel.W4A16_GEMV, LinearKernel.GLUON_GEMV_FMA, LinearKernel.GLUON_GEMV_MMA,
                  LinearKernel.GLUON_GEMV_STREAM)


def linear_choice(plan) -> dict:
    """What a config row records of a linear plan: the kernel and its tile, without the derived parameters."""
    return {"kernel": str(plan.kernel), "tile": {k: v for k, v in plan.params if k not in configs.DERIVED_PARAMS}}


def moe_choice(plan) -> dict:
    return {"kernel": str(plan.kernel), "impl": str(plan.impl), "block_m": plan.block_m}


@dataclass(eq=False)
class Candidate:
    choice: dict
    plan: object  # LinearPlan / MoePlan at the point's T

    @property
    def label(self) -> str:
        return choice_label(self.choice)


@dataclass(eq=False)
class Point:
    family: str  # config family (linear_w4a16, moe_w4a4, ...)
    bucket: tuple[int, ...]  # (N, K) or (E, top_k, H, I)
    name: str  # the layer, for the table ("qwen3-32b qkv")
    t: int
    builtin: dict  # the built-in table's choice at t
    candidates: list[Candidate]
    why: str
    segment: int  # index of the built-in segment holding t

    @property
    def bucket_name(self) -> str:
        if len(self.bucket) == 2:
            return configs.linear_bucket(*self.bucket)
        return configs.moe_bucket(*self.bucket)


# ---- segments and points (pure) ------------------------------------------------------------------------------------

def segments(choice_at: Callable[[int], dict], t_max: int) -> list[tuple[int, int, dict]]:
    """``[(first T, last T, choice), ...]``: the ranges of T = 1..t_max over which ``choice_at`` is constant."""
    out: list[list] = []
    for t in range(1, t_max + 1):
        c = choice_at(t)
        if out and out[-1][2] == c:
            out[-1][1] = t
        else:
            out.append([t, t, c])
    return [tuple(s) for s in out]


def point_ts(segs: list[tuple[int, int, dict]], tokens: Iterable[int] | None, grid: Iterable[int]) -> dict[int, str]:
    """``{T: why}``: ``tokens`` as given, else the grid and both sides of every boundary of ``segs``."""
    t_max = segs[-1][1]
    if tokens:
        return {t: "requested" for t in sorted(set(tokens))}
    out = {t: "grid" for t in grid if t <= t_max}
    for (_, _, before), (first, _, after) in zip(segs, segs[1:]):
        why = f"the built-in table switches from {choice_label(before)} to {choice_label(after)} at T = {first}"
        out[first - 1] = out[first] = why
    return dict(sorted(out.items()))


def _segment_of(segs, t: int) -> int:
    return next((i for i, (lo, hi, _) in enumerate(segs) if lo <= t <= hi), len(segs) - 1)


def _near(segs, i: int) -> list[dict]:
    return [segs[j][2] for j in (i - 1, i, i + 1) if 0 <= j < len(segs)]


def _linear_tiles_at(cap: Capability, kernel: str, t: int) -> list[dict]:
    """The tiles of ``kernel`` worth timing at T: every listed one, except that the CUDA-core gemv takes T tokens
    per CTA and the tensor-core gemvs at most the smallest token block that covers T (a smaller one runs two passes)."""
    tiles = configs.linear_tiles(cap.family, kernel)
    if kernel == LinearKernel.GLUON_GEMV_FMA:
        return [tile for tile in tiles if tile["block_t"] == t]
    if kernel in (LinearKernel.GLUON_GEMV_MMA, LinearKernel.GLUON_GEMV_STREAM):
        # past the largest token block (the streaming kernel's 16) every tile runs several token tiles
        widest = max((tile["block_t"] for tile in tiles), default=0)
        cover = min((tile["block_t"] for tile in tiles if tile["block_t"] >= t), default=widest)
        return [tile for tile in tiles if tile["block_t"] <= cover]
    return tiles


def _decode_kernels_at(cap: Capability, t: int) -> list[str]:
    gluon = cap.family in GLUON_GEMV_FAMILIES and gluon_enabled()
    return [k for k in DECODE_KERNELS if (gluon or not k.startswith("gluon_"))
            and t <= configs.kernel_max_t(k) and (k != LinearKernel.GLUON_GEMV_FMA or t <= 2)]


def linear_candidates(cap: Capability, route: str, t: int, n: int, k: int, near: list[dict]) -> list[Candidate]:
    """Every tile of the kernels in ``near`` (the built-in choices around T) and, at decode sizes, of every decode
    kernel that serves T, as plans for this call."""
    kernels = {c["kernel"] for c in near}
    if kernels & set(DECODE_KERNELS):
        kernels |= set(_decode_kernels_at(cap, t))
    out = []
    for kernel in configs.route_kernels(route):  # a fixed order: the table reads the same on every run
        limit = configs.kernel_max_t(kernel)
        if kernel not in kernels or (limit is not None and t > limit):
            continue
        for tile in _linear_tiles_at(cap, kernel, t):
            out.append(Candidate({"kernel": str(kernel), "tile": tile},
                                 configs.linear_plan_at(cap, kernel, tile, t, n, k)))
    return out


def linear_points(cap: Capability, route: str, n: int, k: int, *, name: str = "",
                  tokens: Iterable[int] | None = None, t_max: int = T_MAX) -> list[Point]:
    """The points and candidates to time for an ``[N, K]`` linear on ``route`` (see the module docstring)."""
    tokens = sorted(set(tokens)) if tokens else None
    segs = segments(lambda t: linear_choice(table_linear(cap, route, t, n, k)), max(t_max, *(tokens or [1])))
    points = []
    for t, why in point_ts(segs, tokens, GRID).items():
        i = _segment_of(segs, t)
        cands = linear_candidates(cap, route, t, n, k, _near(segs, i))
        builtin = linear_choice(table_linear(cap, route, t, n, k))
        if not any(c.choice == builtin for c in cands):  # the rules above admit every built-in tile; keep it certain
            cands.insert(0, Candidate(builtin, table_linear(cap, route, t, n, k)))
        points.append(Point(configs.linear_family(route), (n, k), name, t, builtin, cands, why, i))
    return points


def moe_points(cap: Capability, *, global_experts: int, top_k: int, hidden: int, intermediate: int, w4a4: bool,
               name: str = "", tokens: Iterable[int] | None = None, t_max: int = T_MAX) -> list[Point]:
    """The points and candidates to time for a MoE layer (``w4a4``: a W4A4 checkpoint's, with activation scales)."""
    shape = dict(top_k=top_k, global_experts=global_experts, hidden=hidden, intermediate=intermediate, w4a4=w4a4)
    tokens = sorted(set(tokens)) if tokens else None
    segs = segments(lambda t: moe_choice(table_moe_plan(cap, num_tokens=t, **shape)), max(t_max, *(tokens or [1])))
    valid = configs.moe_choices(cap, w4a4)
    points = []
    for t, why in point_ts(segs, tokens, MOE_GRID).items():
        i = _segment_of(segs, t)
        block_ms = {c["block_m"] for c in _near(segs, i)}
        cands = []
        for choice in valid:
            if choice["block_m"] not in block_ms or (choice["impl"] == Impl.GLUON and not gluon_enabled()):
                continue
            if choice["impl"] == Impl.DECODE and t * top_k > MAX_DECODE_ROUTES:
                continue  # more routes than the decode kernels take
            plan = tier_plan(cap, MoeKernel(choice["kernel"]), choice["block_m"], hidden=hidden,
                             intermediate=intermediate, impl=Impl(choice["impl"]), num_tokens=t)
            cands.append(Candidate(choice, plan))
        builtin = moe_choice(table_moe_plan(cap, num_tokens=t, **shape))
        points.append(Point(configs.moe_family(w4a4), (global_experts, top_k, hidden, intermediate), name, t,
                            builtin, cands, why, i))
    return points


# ---- winners and rows (pure) ---------------------------------------------------------------------------------------

@dataclass
class Outcome:
    point: Point
    us: dict[str, float] = field(default_factory=dict)  # candidate label → median microseconds
    failed: dict[str, str] = field(default_factory=dict)  # candidate label → why it was left out
    winner: Candidate | None = None
    verdict: str = ""


def pick_winner(point: Point, us: dict[str, float], min_gain: float = MIN_GAIN) -> tuple[Candidate | None, str]:
    """The point's winner and a verdict: the built-in choice unless another candidate is faster by more than
    ``min_gain``; the fastest when the built-in choice has no time (it failed)."""
    timed = [c for c in point.candidates if c.label in us]
    if not timed:
        return None, "no candidate ran"
    fastest = min(timed, key=lambda c: us[c.label])
    builtin = next((c for c in timed if c.choice == point.builtin), None)
    if builtin is None:
        return fastest, "built-in choice did not run: fastest taken"
    if fastest is builtin:
        return builtin, "built-in is fastest"
    gain = us[builtin.label] / us[fastest.label] - 1
    if gain <= min_gain:
        return builtin, f"built-in kept ({fastest.label} only {100 * gain:.1f}% faster)"
    return fastest, f"moved: {1 + gain:.2f}x faster than built-in"


def compose_rows(outcomes: list[Outcome]) -> list[dict]:
    """Config rows for one bucket from its points' winners: consecutive points with the same winner merge when they
    are neighbours (T and T + 1) or in one built-in segment; nothing between differing winners is covered."""
    rows: list[dict] = []
    last: Outcome | None = None
    for o in sorted((o for o in outcomes if o.winner is not None), key=lambda o: o.point.t):
        timing = {f"T={o.point.t} {label}": round(v, 2) for label, v in o.us.items()}
        mergeable = last is not None and last.winner.choice == o.winner.choice and (
            o.point.t == last.point.t + 1 or o.point.segment == last.point.segment)
        why = f"T = {o.point.t}: {o.verdict}" if o.verdict else f"T = {o.point.t}"
        if mergeable:
            rows[-1]["max_t"] = o.point.t
            rows[-1]["us"].update(timing)
            rows[-1]["why"] += f"; {why}"
        else:
            rows.append({"min_t": o.point.t, "max_t": o.point.t, **o.winner.choice, "us": timing, "why": why})
        last = o
    return rows


def config_document(device: str, family: str, cap: Capability, buckets: dict[str, list[dict]], measured: dict) -> dict:
    return {"schema_version": configs.SCHEMA_VERSION, "package_version": __version__,
            "device_name": configs.device_key(device), "family": family, "cc": cap.cc, "sm_count": cap.sm_count,
            "measured": measured, "buckets": buckets}


def write_configs(out_dir: Path, cap: Capability, outcomes: list[Outcome], measured: dict) -> list[Path]:
    """One file per family under ``out_dir``; buckets measured now replace the same buckets of a file already
    there (the others are kept).  Each written file is read back through ``dispatch.configs``."""
    by_family: dict[str, dict[str, list[Outcome]]] = {}
    for o in outcomes:
        by_family.setdefault(o.point.family, {}).setdefault(o.point.bucket_name, []).append(o)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for family, buckets in by_family.items():
        path = out_dir / configs.config_file_name(cap.device, family)
        old = {}
        if path.is_file():
            if (existing := configs.load_file(path)).error is None:
                old = json.loads(path.read_text())["buckets"]
            else:
                print(f"note: {path} is replaced, not merged ({existing.error})", file=sys.stderr)
        new = {name: rows for name, outs in buckets.items() if (rows := compose_rows(outs))}
        if not new:
            continue
        path.write_text(json.dumps(config_document(cap.device, family, cap, {**old, **new}, measured), indent=1) + "\n")
        if (err := configs.load_file(path).error) is not None:
            raise AssertionError(f"{path}: the file just written does not validate: {err}")
        written.append(path)
    return written


def dispatch_check(path: Path, cap: Capability, outcomes: list[Outcome]) -> list[str]:
    """Mismatches between the winners and what the written file gives the dispatch at each measured point."""
    cf = configs.load_file(path)
    bad = []
    for o in outcomes:
        if o.winner is None or o.point.family != cf.family:
            continue
        row = cf.rows(o.point.bucket, o.point.t)
        plan = None if row is None else (row.plan(cap, o.point.t, *o.point.bucket) if len(o.point.bucket) == 2
                                         else row.plan(cap, o.point.t))
        if plan != o.winner.plan:
            bad.append(f"{o.point.bucket_name} T={o.point.t}: file gives {plan}, winner {o.winner.plan}")
    return bad


# ---- reports (pure) ------------------------------------------------------------------------------------------------

def format_summary(outcomes: list[Outcome], header: str) -> str:
    lines = [header, f"{'family':13} {'shape':26} {'T':>5}  {'built-in':40} {'us':>8}  {'winner':40} {'us':>8}  "
                     "verdict"]
    for o in outcomes:
        p = o.point
        b = next((c for c in p.candidates if c.choice == p.builtin), None)
        b_us = o.us.get(b.label) if b else None
        w_us = o.us.get(o.winner.label) if o.winner else None
        cell = lambda v: f"{v:8.1f}" if v is not None else f"{'-':>8}"  # noqa: E731
        winner = "(built-in)" if o.winner is not None and o.winner.choice == p.builtin else (
            o.winner.label if o.winner else "-")
        lines.append(f"{p.family:13} {(p.name + ' ' + p.bucket_name).strip()[:26]:26} {p.t:5}  "
                     f"{choice_label(p.builtin)[:40]:40} {cell(b_us)}  {winner[:40]:40} {cell(w_us)}  {o.verdict}")
        for label, why in o.failed.items():
            lines.append(f"{'':48}left out: {label}: {why}")
    return "\n".join(lines + boundary_lines(outcomes))


def boundary_lines(outcomes: list[Outcome]) -> list[str]:
    """Per built-in boundary whose two sides were measured: kept (both sides' winners are the built-in's) or not."""
    by_key = {(o.point.family, o.point.bucket, o.point.t): o for o in outcomes}
    lines = []
    for o in outcomes:
        p = o.point
        before = by_key.get((p.family, p.bucket, p.t - 1))
        if before is None or before.point.segment == p.segment or o.winner is None or before.winner is None:
            continue
        kept = before.winner.choice == before.point.builtin and o.winner.choice == p.builtin
        lines.append(f"  {p.family} {p.bucket_name}: built-in switch at T = {p.t} "
                     f"({choice_label(before.point.builtin)} -> {choice_label(p.builtin)}): "
                     + ("kept" if kept else f"not kept (T = {p.t - 1}: {before.winner.label}; T = {p.t}: "
                                            f"{o.winner.label})"))
    return ["", "built-in switches measured on both sides:"] + lines if lines else []


def format_points(points: list[Point]) -> str:
    """``tune --list``: what would be timed."""
    lines = []
    for p in points:
        lines.append(f"{p.family:13} {(p.name + ' ' + p.bucket_name).strip():32} T={p.t:<5} built-in "
                     f"{choice_label(p.builtin)}  [{p.why}]")
        lines += [f"{'':20}{c.label}" for c in p.candidates]
    total = sum(len(p.candidates) for p in points)
    return "\n".join(lines + [f"{len(points)} points, {total} candidate runs"])


# ---- timing (GPU) --------------------------------------------------------------------------------------------------

def _rel_err(out, ref) -> float:
    import torch

    ref32 = ref.float()
    return float(torch.linalg.vector_norm(out.float() - ref32) / torch.linalg.vector_norm(ref32).clamp_min(1e-30))


def _measure(p: Point, run_once: Callable[[object], object], timed: Callable[[object], Callable[[], object]],
             calls: int, ref_of: Callable[[Candidate], object], *, repeats: int, min_gain: float, bar) -> Outcome:
    """Check every candidate of a point against its reference, time the ones that pass (``calls`` kernel calls per
    timed run), pick the winner."""
    import torch

    from . import bench

    o = Outcome(p)
    for c in p.candidates:
        bar.set_postfix_str(f"{p.bucket_name} T={p.t} {c.label}"[:60])
        try:
            err = _rel_err(run_once(c.plan), ref_of(c))
            if not math.isfinite(err) or err > REL_TOL:
                o.failed[c.label] = f"wrong result (relative error {err:.3g} > {REL_TOL})"
            else:
                o.us[c.label] = bench.time_graph(timed(c.plan), repeats=repeats) / calls * 1e6
        except Exception as e:  # a candidate that cannot run here (compile, resources, vendor) is left out
            o.failed[c.label] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            if torch.cuda.is_initialized():  # let a failed launch surface here, not at the next candidate
                torch.cuda.synchronize()
        bar.update(1)
    o.winner, o.verdict = pick_winner(p, o.us, min_gain)
    return o


def time_linear(points: list[Point], *, min_bytes: float, repeats: int, min_gain: float, bar,
                device: str = "cuda") -> list[Outcome]:
    """Time the points of one ``[N, K]`` shape (all its routes) on one weight, replicated to ``min_bytes``."""
    import torch

    from .format import GlobalScale, NvFp4, random_nvfp4

    n, k = points[0].bucket
    base = random_nvfp4((n, k), gen=torch.Generator().manual_seed(0), device=device)
    copies = max(1, math.ceil(min_bytes / (n * k // 2 + n * k // 16)))
    ws = [base] + [NvFp4(base.codes.clone(), base.scales.clone()) for _ in range(copies - 1)]
    w_gs = GlobalScale.from_decode(torch.tensor(0.01, device=device))
    outcomes = [_linear_point(p, ws, w_gs, repeats=repeats, min_gain=min_gain, bar=bar) for p in points]
    del ws, base
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return outcomes


def _linear_point(p: Point, ws: list, w_gs, **how) -> Outcome:
    import torch

    from .dispatch.registry import LINEAR_KERNELS
    from .format import GlobalScale, linear_w4a4_ref, linear_w4a16_ref

    (n, k), base, device = p.bucket, ws[0], ws[0].codes.device
    dec_rows = w_gs.dec.expand(n).contiguous()
    x = torch.randn(p.t, k, generator=torch.Generator().manual_seed(p.t)).to(device, torch.bfloat16)
    in_gs = GlobalScale.of(x)
    in_enc, alpha = in_gs.enc, (in_gs.dec * w_gs.dec).to(torch.float32)
    refs = {}

    def ref_of(c: Candidate):
        w4a4 = LinearKernel(c.plan.kernel).w4a4
        if w4a4 not in refs:
            refs[w4a4] = (linear_w4a4_ref(x, base.codes, base.scales, w_gs, in_gs) if w4a4
                          else linear_w4a16_ref(x, base.codes, base.scales, dec_rows))
        return refs[w4a4]

    def call(plan, w):
        return LINEAR_KERNELS[plan.kernel](x, w.codes, w.scales, dec_rows, None, in_enc, alpha, None, **plan.kwargs)

    return _measure(p, lambda plan: call(plan, base), lambda plan: lambda: [call(plan, w) for w in ws], len(ws),
                    ref_of, **how)


def time_moe(points: list[Point], *, repeats: int, min_gain: float, bar, device: str = "cuda") -> list[Outcome]:
    """Time the points of one MoE layer shape (both checkpoint kinds): the whole layer flow (align, GEMMs,
    activation, top-k sum), one expert bank."""
    import torch

    from .bench import gpu_nvfp4

    e, top_k, h, i = points[0].bucket
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
    decs = torch.full((e,), 0.01, device=device), torch.full((e,), 0.01, device=device)
    outcomes = [_moe_point(p, w13, w2, decs, gen, repeats=repeats, min_gain=min_gain, bar=bar) for p in points]
    del w13, w2
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return outcomes


def _moe_point(p: Point, w13, w2, decs, gen, **how) -> Outcome:
    import torch

    from .dispatch.moe_flow import nvfp4_moe
    from .format import GlobalScale, moe_ref

    (e, top_k, h, _), device, (d13, d2) = p.bucket, w13.codes.device, decs
    x = torch.randn(p.t, h, device=device, generator=gen).to(torch.bfloat16)
    tw, ti = torch.softmax(torch.randn(p.t, e, device=device, generator=gen), -1).topk(top_k, -1)
    tw, ti = (tw / tw.sum(-1, keepdim=True)).float(), ti.to(torch.int32)
    a13, a2 = GlobalScale.of(x), GlobalScale.from_amax(24.0).to(device)
    # A W4A4 checkpoint's layer has activation scales: both kernels may run it.
    scales = dict(a13_enc=a13.enc.reshape(1), a2_enc=a2.enc.reshape(1)) if p.family == configs.moe_family(True) else {}
    refs = {}

    def ref_of(c: Candidate):
        quantized = c.plan.kernel == MoeKernel.W4A4
        if quantized not in refs:
            refs[quantized] = moe_ref(x, w13, d13, w2, d2, tw, ti, a13_gs=a13 if quantized else None,
                                      a2_gs=a2 if quantized else None)
        return refs[quantized]

    def call(plan):
        return nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, plan=plan, **scales)

    return _measure(p, call, lambda plan: lambda: call(plan), 1, ref_of, **how)


# ---- the command ---------------------------------------------------------------------------------------------------

def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return values


@dataclass
class Request:
    """What ``tune`` was asked to measure: linear shapes per route, MoE layer shapes."""

    linear: list[tuple[str, str, int, int]]  # (name, route, N, K)
    moe: list[tuple[str, dict]]  # (name, moe_points keywords)


def tune_request(args: argparse.Namespace) -> Request:
    """The shapes and routes from the arguments (ValueError / CheckpointError on bad input; no GPU needed)."""
    from .bench import MODELS, MOE_SHAPES

    routes = args.routes.split(",") if args.routes else None
    unknown = sorted(set(routes or ()) - set(TUNE_ROUTES))
    if unknown:
        raise ValueError(f"--routes: {unknown} cannot be tuned; choose from {','.join(TUNE_ROUTES)}")
    linear: list[tuple[str, int, int]] = []
    moe: list[tuple[str, dict]] = []
    schemes = {"W4A16"}  # built-in shapes: the route every NVFP4 checkpoint can take (--routes adds triton)
    if args.checkpoint:
        from .inspect_ckpt import inspect_checkpoint

        report = inspect_checkpoint(args.checkpoint)
        name = Path(args.checkpoint).name
        tp = args.tp
        for kind, n, k in report.runtime_shapes:  # tensor parallel: column-parallel N, row-parallel K
            n, k = (n // tp, k) if kind in ("qkv", "gate_up") else (n, k // tp) if kind in ("o", "down") else (n, k)
            linear.append((f"{name} {kind}", n, k))
        schemes = set(report.quant.layers) & {"W4A4", "W4A16"}
        if report.moe:
            m = report.moe
            for w4a4 in sorted({lin == "W4A4" for lin in schemes}):
                moe.append((name, dict(global_experts=m["experts"], top_k=m["top_k"], hidden=m["hidden"],
                                       intermediate=m["intermediate"] // tp, w4a4=w4a4)))
    if args.shapes:
        for s in args.shapes.split(","):
            try:
                n, k = (int(v) for v in s.lower().split("x"))
            except ValueError:
                raise ValueError(f"--shapes: expected NxK items (e.g. 10240x5120), got {s!r}") from None
            if n < 1 or k < 16 or k % 16:
                raise ValueError(f"--shapes: {s}: N >= 1 and K a multiple of 16 expected")
            linear.append(("", n, k))
    models = args.models
    if models is None and not (args.checkpoint or args.shapes or args.moe_models):
        models = ",".join(MODELS)  # nothing named: the built-in linear shapes
    if models:
        for model in models.split(","):
            if model not in MODELS:
                raise ValueError(f"--models: unknown {model!r}; built in: {', '.join(MODELS)}")
            linear += [(f"{model} {layer}", n, k) for layer, n, k in MODELS[model]]
    for model in args.moe_models.split(",") if args.moe_models else ():
        if model not in MOE_SHAPES:
            raise ValueError(f"--moe-models: unknown {model!r}; built in: {', '.join(MOE_SHAPES)}")
        h, i, e, top_k = MOE_SHAPES[model]
        for w4a4 in (False, True):
            moe.append((model, dict(global_experts=e, top_k=top_k, hidden=h, intermediate=i, w4a4=w4a4)))
    if routes is None:
        routes = [r for r, scheme in (("triton", "W4A4"), ("w4a16", "W4A16")) if scheme in schemes] or ["w4a16"]
    seen = set()
    out = []
    for name, n, k in linear:
        for route in routes:
            if (route, n, k) not in seen:
                seen.add((route, n, k))
                out.append((name, route, n, k))
    if not out and not moe:
        raise ValueError("nothing to tune: give --checkpoint, --models, --shapes or --moe-models")
    return Request(out, moe)


def all_points(request: Request, cap: Capability, tokens: list[int] | None,
               moe_tokens: list[int] | None) -> list[Point]:
    from .dispatch.linear import TABLE

    points = []
    for name, route, n, k in request.linear:
        if route in TABLE.get(cap.family, {}):
            points += linear_points(cap, route, n, k, name=name, tokens=tokens)
    for name, shape in request.moe:
        points += moe_points(cap, name=name, tokens=moe_tokens, **shape)
    return points


def _list_capability(args: argparse.Namespace) -> Capability:
    import torch

    if torch.cuda.is_available():
        from .dispatch.hw import capability_of

        return capability_of(torch.device("cuda"))
    return Capability(args.cc, args.sm_count, None)


def tune_command(args: argparse.Namespace) -> int:
    import torch

    from .bench import emit_json, progress
    from .inspect_ckpt import CheckpointError

    try:
        request = tune_request(args)
        tokens = _ints(args.tokens, "--tokens") if args.tokens else None
        moe_tokens = _ints(args.moe_tokens, "--moe-tokens") if args.moe_tokens else None
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        cap = _list_capability(args)
        print(f"# {cap.device or 'no GPU'} ({cap.name}, {cap.sm_count} SMs)")
        print(format_points(all_points(request, cap, tokens, moe_tokens)))
        return 0
    if not torch.cuda.is_available():
        print("error: tune needs a CUDA GPU (none visible): it times the kernels on the GPU its configs are for "
              "(`tune --list` shows what it would time)", file=sys.stderr)
        return 2
    from .dispatch.hw import capability_of

    cap = capability_of(torch.device("cuda"))
    if cap.family is Family.OTHER:
        print(f"error: tune: the dispatch has no tables for {cap.name}", file=sys.stderr)
        return 2
    points = all_points(request, cap, tokens, moe_tokens)
    out_dir = Path(args.out)
    bar = progress(sum(len(p.candidates) for p in points), "tune")
    outcomes: list[Outcome] = []
    groups: dict[tuple, list[Point]] = {}  # one weight per shape, shared by its routes / checkpoint kinds
    for p in points:
        groups.setdefault((p.family in configs.MOE_FAMILIES, p.bucket), []).append(p)
    for (is_moe, _), pts in groups.items():
        if is_moe:
            outcomes += time_moe(pts, repeats=args.repeats, min_gain=args.min_gain, bar=bar)
        else:
            outcomes += time_linear(pts, min_bytes=args.min_bytes, repeats=args.repeats, min_gain=args.min_gain,
                                    bar=bar)
    bar.close()
    import triton

    measured = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": cap.device, "torch": torch.__version__, "triton": triton.__version__,
                "command": " ".join(["vllm-nvfp4-sm120", "tune", *sys.argv[2:]]) if sys.argv[1:2] == ["tune"]
                else " ".join(sys.argv), "min_bytes": args.min_bytes, "repeats": args.repeats,
                "min_gain": args.min_gain, "rel_tol": REL_TOL}
    header = (f"# {cap.device} ({cap.name}, {cap.sm_count} SMs), torch {torch.__version__}, Triton "
              f"{triton.__version__}; winner = built-in unless > {100 * args.min_gain:g}% faster")
    print(format_summary(outcomes, header))
    written = write_configs(out_dir, cap, outcomes, measured)
    status = 0
    for path in written:
        bad = dispatch_check(path, cap, outcomes)
        print(f"written: {path}" + ("" if not bad else f"  DISPATCH CHECK FAILED: {bad[0]}"))
        status |= bool(bad)
    if written:
        print(f"the dispatch uses them with {configs.ENV_CONFIG_DIR}={out_dir.resolve()} (or copy them into "
              f"{configs.SHIPPED_DIR} to ship them)")
    if args.json:
        emit_json({"measured": measured, "outcomes": [
            {"family": o.point.family, "bucket": o.point.bucket_name, "name": o.point.name, "t": o.point.t,
             "builtin": o.point.builtin, "winner": o.winner.choice if o.winner else None, "verdict": o.verdict,
             "us": o.us, "failed": o.failed, "why": o.point.why} for o in outcomes],
            "written": [str(p) for p in written]}, args.json)
    return status


def add_tune_args(p: argparse.ArgumentParser) -> None:
    from .bench import MODELS

    p.add_argument("--checkpoint", metavar="DIR", help="tune the linear and MoE shapes of this checkpoint")
    p.add_argument("--models", help=f"built-in linear shape lists ({', '.join(MODELS)}; all of them when no other "
                                    "shapes are named)")
    p.add_argument("--shapes", help="linear shapes NxK, comma separated (e.g. 10240x5120,8192x8192)")
    p.add_argument("--moe-models", default="", help="built-in MoE layer shapes (e.g. qwen3-30b-a3b); none by default")
    p.add_argument("--routes", help=f"linear routes to tune ({','.join(TUNE_ROUTES)}); default: the checkpoint's "
                                    "(triton for W4A4 layers, w4a16 for W4A16), w4a16 for built-in shapes")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: tune the per-rank shapes of --checkpoint")
    p.add_argument("--tokens", help="linear: time exactly these T (default: both sides of every built-in switch "
                                    f"and {','.join(map(str, GRID))})")
    p.add_argument("--moe-tokens", help=f"MoE: the same (default grid {','.join(map(str, MOE_GRID))})")
    p.add_argument("--out", default="nvfp4-sm120-configs", help="folder for the config files (merged with what is "
                                                                "there); point VLLM_NVFP4_SM120_CONFIG_DIR at it")
    p.add_argument("--min-gain", type=float, default=MIN_GAIN, help="how much faster than the built-in choice a "
                                                                    "candidate must be to replace it (0.03 = 3%%)")
    p.add_argument("--min-bytes", type=float, default=2e9, help="linear weight bytes per timed run (defeats the L2)")
    p.add_argument("--repeats", type=int, default=20, help="graph replays per measurement (median)")
    p.add_argument("--json", metavar="PATH", help="also write every timing as JSON ('-': stdout)")
    p.add_argument("--list", action="store_true", help="print the points and candidates and time nothing")
    p.add_argument("--cc", type=int, default=120, help="--list without a GPU: the compute capability to plan for")
    p.add_argument("--sm-count", type=int, default=170, help="--list without a GPU: its SM count")
    p.set_defaults(func=tune_command)
