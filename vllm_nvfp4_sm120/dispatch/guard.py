"""Load-time numerics guard: every plan a layer will run is checked once on this GPU before it serves.

The native sm_120 paths (block-scaled FP4 MMA, ``cvt`` e2m1 decode and encode, cuBLAS FP4, b12x) are proven by
compile checks and by proxies on other GPUs, not by a run on the user's GPU, driver and library versions.  The
guard closes that gap at load: for a layer shape it lists the plans the dispatch will pick over the batch sizes
vLLM can run (:func:`linear_plans`, :func:`moe_plans`), runs each one on a small deterministic problem of that
shape through the plan's registry launcher (what the custom op runs for that T) and compares it with the exact
torch reference of the same plan computed on the same GPU (the op's CPU path, on device tensors).

* One check per distinct ``(kernel and tile plan, N, K, dtype, GPU)`` in the process (:data:`_results`); the
  glue calls it from ``process_weights_after_loading``, before vLLM captures CUDA graphs.
* Tolerance (:func:`compare`): the kernel tests' elementwise bound, ``|got - ref| <= 2^-8 max|ref| + 2^-7 |ref|``
  (fp32 summation order and one 16-bit rounding of the output).  Plans that quantize activations are tie-aware:
  a value within fp32 jitter of an e2m1 rounding midpoint may round the other way in the kernel, so there the
  check is each row's error norm, ``<= 2^-6`` of the row's norm (one flipped code moves a row by far less; a wrong
  kernel by tens of percent).  Non-finite outputs always fail.
* A failure is returned to the glue, which logs one line (layer, kernel, GPU, driver, error) and falls back:
  linears to the next kernel of vLLM's own list, MoE layers to the portable Triton plan of the same tier
  (:func:`portable_moe_plan`, recorded as a substitution the MoE selector applies, ``dispatch/policy.py``).
  :class:`GuardMode` ``strict`` raises :class:`NumericsGuardError` instead; ``off`` skips the guard.
* Without a GPU the guard does nothing unless forced (tests: it then runs the registry entries on CPU tensors).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from ..format import GlobalScale
from .hw import SM120_REFERENCE, Capability, capability_of
from .linear import LinearPlan, Route, select_linear
from .moe import Impl, MoeKernel, MoePlan, moe_guard_key, select_moe_plan, tier_plan, tiers_moe_plan
from .policy import set_substitute


class GuardMode(StrEnum):
    ON = "on"  # check; a failing kernel falls back with one error line
    STRICT = "strict"  # check; a failing kernel fails the load
    OFF = "off"  # no check


_MODE_VALUES = {"": GuardMode.ON, "1": GuardMode.ON, "on": GuardMode.ON, "true": GuardMode.ON,
                "strict": GuardMode.STRICT, "0": GuardMode.OFF, "off": GuardMode.OFF, "false": GuardMode.OFF}


def parse_mode(value: str | None, source: str = "guard") -> GuardMode:
    """``1`` / ``on`` (default), ``strict``, ``0`` / ``off``; anything else a ValueError naming ``source``."""
    v = (value or "").strip().lower()
    if v not in _MODE_VALUES:
        raise ValueError(f"{source}={value!r}: expected 1 (check, fall back), strict (check, fail the load) or 0 "
                         "(skip)")
    return _MODE_VALUES[v]


class NumericsGuardError(RuntimeError):
    """A kernel failed the guard in strict mode (or no fallback passed it)."""


# ---- tolerance --------------------------------------------------------------------------------------------------

ATOL_OF_MAX = 2.0**-8
RTOL = 2.0**-7
TIE_ROW_TOL = 2.0**-6


@dataclass(frozen=True)
class Comparison:
    row_err: float  # worst row: ||got - ref|| / ||ref||
    outside: int  # elements beyond the elementwise bound
    numel: int
    finite: bool
    ok: bool


def compare(got: torch.Tensor, ref: torch.Tensor, *, ties: bool) -> Comparison:
    """The guard's verdict on ``got`` against ``ref`` (see the module docstring); ``ties`` for plans that
    quantize activations."""
    g, r = got.float(), ref.float()
    finite = bool(torch.isfinite(g).all())
    diff = (g - r).abs()
    amax = float(r.abs().max()) if r.numel() else 0.0
    outside = int((~(diff <= ATOL_OF_MAX * amax + RTOL * r.abs())).sum())  # NaN counts as outside
    row_norm = r.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    row_err = float(((g - r).norm(dim=-1) / row_norm).max()) if r.numel() else 0.0
    if row_err != row_err:
        row_err = float("inf")
    ok = finite and (outside == 0 or (ties and row_err <= TIE_ROW_TOL))
    return Comparison(row_err, outside, r.numel(), finite, ok)


# ---- results ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GuardResult:
    key: tuple
    what: str  # the kernel and its tile, as the log line names it
    t: int  # the batch size it ran at
    comparison: Comparison
    gpu: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.comparison.ok

    def describe(self) -> str:
        c = self.comparison
        err = "non-finite output" if not c.finite else f"worst row error {c.row_err:.3g} of the row's norm"
        return (f"kernel {self.what} at T = {self.t}: {err}, {c.outside} of {c.numel} outputs beyond "
                f"{ATOL_OF_MAX:g} max|ref| + {RTOL:g} |ref| on {self.gpu}")


_results: dict[tuple, GuardResult] = {}


def clear_cache() -> None:
    """Forget every guard result (tests)."""
    _results.clear()


@functools.cache
def driver_version() -> str:
    """The NVIDIA driver version (NVML), else the CUDA driver API version torch sees, else ``"?"``."""
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001  (no NVML: fall through to the CUDA driver API)
        pass
    try:
        v = torch._C._cuda_getDriverVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001
        return "?"


def gpu_description(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU (forced)"
    cap = capability_of(device)
    return f"{cap.device} ({cap.name}), driver {driver_version()}"


@contextlib.contextmanager
def _exact_fp32():
    """The references' fp32 matmuls in full fp32 (no TF32), whatever the process set."""
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = old


def _cap(device: torch.device) -> Capability:
    return capability_of(device) if device.type == "cuda" else SM120_REFERENCE


def should_run(mode: GuardMode, device: torch.device, force: bool) -> bool:
    return mode is not GuardMode.OFF and (device.type == "cuda" or force)


# ---- which batch sizes and plans --------------------------------------------------------------------------------

def probe_ts(max_t: int) -> list[int]:
    """Batch sizes that reach every plan of the tables: each T up to 64 (the small-T rows and tiles), every 16th up
    to 1024 (the linear rows, the MoE tiers by tokens per expert), every 128th up to ``max_t`` (tile rules in units
    of 128 rows), and ``max_t``.  The selectors are pure functions, so probing costs microseconds per T."""
    ts = set(range(1, min(64, max_t) + 1)) | set(range(65, min(1024, max_t) + 1, 16))
    ts |= set(range(1025, max_t + 1, 128)) | {max_t}
    return sorted(ts)


def linear_plans(cap: Capability, route: Route | str, n: int, k: int, max_t: int) -> dict[LinearPlan, int]:
    """Each plan the op picks for this shape over ``probe_ts(max_t)``, with the smallest T that picks it."""
    plans: dict[LinearPlan, int] = {}
    for t in probe_ts(max_t):
        plans.setdefault(select_linear(cap, route, t, n, k), t)
    return plans


def moe_plans(cap: Capability, *, top_k: int, global_experts: int, hidden: int, intermediate: int, w4a4: bool,
              max_t: int) -> dict[MoePlan, int]:
    plans: dict[MoePlan, int] = {}
    for t in probe_ts(max_t):
        plan = select_moe_plan(cap, num_tokens=t, top_k=top_k, global_experts=global_experts, hidden=hidden,
                               intermediate=intermediate, w4a4=w4a4)
        plans.setdefault(plan, t)
    return plans


# ---- deterministic problems ---------------------------------------------------------------------------------------

SEED = 20240601


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(SEED)


def _weight(shape: list[int], gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (every byte value) and e4m3 block scales ``2^u (1 + m/8)``, u in [-3, 1], drawn on ``device``."""
    *lead, k = shape
    codes = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, generator=gen, device=device)
    exp = torch.randint(-3, 2, (*lead, k // 16), generator=gen, device=device).float()
    mant = torch.randint(0, 8, (*lead, k // 16), generator=gen, device=device).float()
    return codes, (torch.exp2(exp) * (1 + mant / 8)).to(torch.float8_e4m3fn)


def _activations(t: int, k: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(t, k, generator=gen, device=device).to(dtype)


WEIGHT_DEC = 2.0**-8  # keeps sums over K ~ 4096 of the random weights within a few units


# ---- linears ----------------------------------------------------------------------------------------------------

def _route_weight(route: Route, codes: torch.Tensor, scales: torch.Tensor):
    """``(codes, swizzled scales or None)`` as the route's layer keeps them after load."""
    from ..kernels import fp4_routes

    if route is Route.CUBLAS:
        return fp4_routes.prepare_cublas_weight(codes, scales)
    if route is Route.B12X:
        return fp4_routes.prepare_b12x_weight(codes, scales)
    return codes, None


def run_linear_plan(plan: LinearPlan, x, codes, scales, dec_rows, swizzled, in_enc, alpha):
    """The plan on its registry launcher, as the op runs it on a GPU."""
    from .registry import LINEAR_KERNELS

    return LINEAR_KERNELS[plan.kernel](x, codes, scales, dec_rows, swizzled, in_enc, alpha, None, **plan.kwargs)


def guard_linear(route: Route | str, n: int, k: int, dtype: torch.dtype, device: torch.device | str, *,
                 mode: GuardMode = GuardMode.ON, force: bool = False, max_t: int = 8192) -> list[GuardResult]:
    """Check every plan the linear op runs for an ``[N, K]`` layer of ``route`` on ``device``; the results of
    this call (cached ones included), failures first.  ``strict`` raises on a failure."""
    device = torch.device(device)
    route = Route(route)
    if not should_run(mode, device, force) or route is Route.FLASHINFER_W4A16:
        return []  # flashinfer_w4a16 runs its own op on FlashInfer's prepared weight (a comparison route)
    from .linear_call import plan_reference

    cap = _cap(device)
    gpu = gpu_description(device)
    results = []
    todo = {}
    for plan, t in linear_plans(cap, route, n, k, max_t).items():
        key = ("linear", plan, n, k, str(dtype), gpu)
        if key in _results:
            results.append(_results[key])
        else:
            todo[key] = (plan, t)
    if todo:
        gen = _generator(device)
        codes, scales = _weight([n, k], gen, device)
        codes_r, swizzled = _route_weight(route, codes, scales)
        dec_rows = torch.full((n,), WEIGHT_DEC, dtype=torch.float32, device=device)
        x_all = _activations(max(t for _, t in todo.values()), k, dtype, gen, device)
        in_gs = GlobalScale.of(x_all)
        in_enc = in_gs.enc.to(device).reshape(())
        alpha = (in_gs.dec.to(device) * WEIGHT_DEC).reshape(()).to(torch.float32)
        for key, (plan, t) in todo.items():
            start = time.perf_counter()
            x = x_all[:t]
            got = run_linear_plan(plan, x, codes_r, scales, dec_rows, swizzled, in_enc, alpha)
            with _exact_fp32():
                ref = plan_reference(plan, x, codes, scales, dec_rows, in_enc, alpha, None)
            c = compare(got, ref, ties=plan.is_w4a4)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            what = f"{plan.kernel}({', '.join(f'{a}={v}' for a, v in plan.params)}) N={n} K={k} {dtype}"
            _results[key] = GuardResult(key, what, t, c, gpu, time.perf_counter() - start)
            results.append(_results[key])
    results.sort(key=lambda r: r.ok)
    if mode is GuardMode.STRICT and results and not results[0].ok:
        raise NumericsGuardError(f"numerics guard (strict): {results[0].describe()}")
    return results


# ---- MoE --------------------------------------------------------------------------------------------------------

GUARD_EXPERTS = 8  # the synthetic problem's experts: the plan, not E, decides the kernels and tiles
GUARD_TOP_K = 2


def portable_moe_plan(cap: Capability, plan: MoePlan, *, hidden: int, intermediate: int) -> MoePlan:
    """What a failing MoE plan falls back to: the Triton plan of its tier, and below that the same plan without
    the native sm_120 pieces (the exact FP4 self-decode instead of the FP4 MMA, no inline-PTX e2m1 decode)."""
    if plan.impl == Impl.DECODE:
        # The align-free decode kernels have no portable variant of their own: today's path, the smallest tier.
        return tiers_moe_plan(cap, num_tokens=1, top_k=1, global_experts=1, hidden=hidden, intermediate=intermediate,
                              w4a4=False)
    if plan.impl == Impl.GLUON:
        triton_plan = tier_plan(cap, MoeKernel(plan.kernel), plan.block_m, hidden=hidden, intermediate=intermediate)
        if triton_plan is not None:
            return triton_plan
    if plan.kernel == MoeKernel.W4A4 and not plan.decode:
        return replace(plan, impl=Impl.TRITON, decode=True, tier=plan.tier + "/exact-decode")
    if plan.kernel == MoeKernel.W4A16 and plan.fast_decode:
        return replace(plan, impl=Impl.TRITON, fast_decode=False, tier=plan.tier + "/exact-decode")
    return plan  # nothing left to take out


def _moe_tokens(plan: MoePlan) -> int:
    """Enough tokens for a few BLOCK_M tiles per expert of the synthetic problem; for the align-free decode plan
    (no BLOCK_M) two routes per expert, so its gate_up reads an expert once for several tokens."""
    return 2 * max(plan.block_m, 1) * GUARD_EXPERTS // GUARD_TOP_K


def _check_moe_plan(plan: MoePlan, hidden: int, intermediate: int, dtype, device, gpu: str, problem) -> GuardResult:
    from .moe_flow import _reference, nvfp4_moe

    key = moe_guard_key(plan, hidden, intermediate) + (str(dtype), gpu)
    if key in _results:
        return _results[key]
    x_all, w13, w2, dec, tw_all, ti_all, a13, a2 = problem
    t = min(_moe_tokens(plan), x_all.shape[0])
    x, tw, ti = x_all[:t], tw_all[:t], ti_all[:t]
    w4a4 = plan.kernel == MoeKernel.W4A4
    a13, a2 = (a13, a2) if w4a4 else (None, None)
    start = time.perf_counter()
    got = nvfp4_moe(x, *w13, dec, *w2, dec, tw, ti, a13_enc=a13, a2_enc=a2, plan=plan)
    with _exact_fp32():
        ref = _reference(x, *w13, dec, *w2, dec, tw, ti, a13, a2, None, "silu", plan)
    c = compare(got, ref, ties=w4a4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    what = (f"moe {plan.kernel}/{plan.impl} tier {plan.tier} block_m={plan.block_m} H={hidden} I={intermediate} "
            f"{dtype}")
    _results[key] = GuardResult(key, what, t, c, gpu, time.perf_counter() - start)
    return _results[key]


def _moe_problem(hidden: int, intermediate: int, dtype, device, max_tokens: int):
    from ..format import topk_route

    gen = _generator(device)
    w13 = _weight([GUARD_EXPERTS, 2 * intermediate, hidden], gen, device)
    w2 = _weight([GUARD_EXPERTS, hidden, intermediate], gen, device)
    dec = torch.full((GUARD_EXPERTS,), WEIGHT_DEC, dtype=torch.float32, device=device)
    x = _activations(max_tokens, hidden, dtype, gen, device)
    logits = torch.randn(max_tokens, GUARD_EXPERTS, generator=gen, device=device)
    tw, ti = topk_route(logits, GUARD_TOP_K)
    a13 = GlobalScale.of(x).enc.to(device).reshape(1).to(torch.float32)
    a2 = GlobalScale.from_amax(16.0).enc.to(device).reshape(1).to(torch.float32)
    return x, w13, w2, dec, tw, ti, a13, a2


@dataclass(frozen=True)
class MoeGuardOutcome:
    results: list[GuardResult]  # every plan checked (fallbacks included), failures first
    fallbacks: dict[MoePlan, MoePlan]  # failing plan → the plan now run instead
    depths: dict[MoePlan, int]  # every plan the layer runs → how many portable_moe_plan steps it took (0: passed)


def fall_back(cap: Capability, plan: MoePlan, depth: int, *, hidden: int, intermediate: int) -> MoePlan:
    """Run ``plan`` ``depth`` portable steps down at this shape from now on (what another rank's guard found, so
    that every rank runs the same kernels); returns the plan now run."""
    target = plan
    for _ in range(depth):
        target = portable_moe_plan(cap, target, hidden=hidden, intermediate=intermediate)
    if target != plan:
        set_substitute(moe_guard_key(plan, hidden, intermediate), target)
    return target


def guard_moe(*, hidden: int, intermediate: int, global_experts: int, top_k: int, w4a4: bool, dtype: torch.dtype,
              device: torch.device | str, mode: GuardMode = GuardMode.ON, force: bool = False,
              max_t: int = 8192) -> MoeGuardOutcome:
    """Check every plan the MoE flow runs for this layer shape; a failing plan is replaced, for every later
    call at this shape, by :func:`portable_moe_plan` (checked in turn).  ``strict`` raises on a failure; so does
    a layer for which no fallback passes."""
    device = torch.device(device)
    if not should_run(mode, device, force):
        return MoeGuardOutcome([], {}, {})
    cap = capability_of(device)  # the MoE flow plans for the tensors' device (no GPU: the portable tiers)
    gpu = gpu_description(device)
    plans = moe_plans(cap, top_k=top_k, global_experts=global_experts, hidden=hidden, intermediate=intermediate,
                      w4a4=w4a4, max_t=max_t)
    problem = None
    results, fallbacks, depths = [], {}, {}
    for plan in plans:
        key = moe_guard_key(plan, hidden, intermediate) + (str(dtype), gpu)
        if problem is None and key not in _results:
            problem = _moe_problem(hidden, intermediate, dtype, device, max(_moe_tokens(p) for p in plans) + 1)
        res = _check_moe_plan(plan, hidden, intermediate, dtype, device, gpu, problem)
        results.append(res)
        current, depths[plan] = plan, 0
        while not res.ok:
            if mode is GuardMode.STRICT:
                raise NumericsGuardError(f"numerics guard (strict): {res.describe()}")
            nxt = portable_moe_plan(cap, current, hidden=hidden, intermediate=intermediate)
            if nxt == current:
                raise NumericsGuardError(f"numerics guard: {res.describe()}; no portable plan left to fall back to")
            if problem is None:
                problem = _moe_problem(hidden, intermediate, dtype, device, _moe_tokens(nxt) + 1)
            res = _check_moe_plan(nxt, hidden, intermediate, dtype, device, gpu, problem)
            results.append(res)
            current = nxt
            depths[plan] += 1
        if current != plan:
            fallbacks[plan] = current
            set_substitute(moe_guard_key(plan, hidden, intermediate), current)
    results.sort(key=lambda r: r.ok)
    return MoeGuardOutcome(results, fallbacks, depths)
