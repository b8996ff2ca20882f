"""Measured configs: per GPU model, the plan ``tune`` found fastest for a layer shape and a range of T.

The built-in tables (``dispatch/linear.py``, ``dispatch/moe.py``) are the documented default; a measured config
replaces their choice only where it has a row, the way vLLM ships tuned fused-MoE configs per device.

Files.  One JSON file per (device, kernel family), named like vLLM's tuned MoE configs:
``device_name=NVIDIA_H200,family=linear_w4a16.json`` (the CUDA device name, every character outside
``[A-Za-z0-9_.-]`` replaced by ``_``).  Families: ``linear_<route>`` (one per ``Route``) and ``moe_w4a16`` /
``moe_w4a4`` (the MoE layers of W4A16 / W4A4 checkpoints).  They are read from the user folder
``$VLLM_NVFP4_SM120_CONFIG_DIR`` and from the package's ``configs/`` folder; for each call the first file with a row
for its shape and T serves (user folder first), else the built-in table.

Schema (``schema_version`` 1)::

    {"schema_version": 1, "package_version": "0.1.0", "device_name": "NVIDIA_H200", "family": "linear_w4a16",
     "cc": 90, "sm_count": 132, "measured": {... how: date, versions, command ...},
     "buckets": {"N=10240,K=5120": [ROW, ...]}}                         # MoE: "E=128,top_k=8,H=2048,I=768"

    linear ROW: {"min_t": 2, "max_t": 8, "kernel": "gluon_gemv_mma", "tile": {"block_t": 8, "num_warps": 4, ...},
                 "us": {"candidate": microseconds, ...}, "why": "..."}
    MoE ROW:    {"min_t": 1, "max_t": 64, "kernel": "w4a16", "impl": "triton", "block_m": 16, "us": ..., "why": ...}
                (the decode plan: "kernel": "w4a16", "impl": "decode", "block_m": 0, its tiles per T from moe.py)

``min_t`` / ``max_t`` bound the batch size T (tokens of the call; ``max_t`` null: no upper bound); rows of a bucket
do not overlap.  A linear row's ``tile`` is one of its kernel's tiles on the file's architecture (:func:`linear_tiles`;
each compile-checked for sm_120 by the kernels' tests) without the parameters derived from the shape
(``split_k``, ``chunk_n``), which the dispatch's rules add per call.  A MoE row names a tier of the built-in tier
tables by its kernel and BLOCK_M, and the implementation (``dispatch.moe.tier_plan``).

A file that cannot be used as a whole (bad JSON, an unknown key, another schema version, a kernel that no longer
exists, a tile that is not one of its kernel's, rows that overlap, measured on another architecture than the GPU
asking) gives one :class:`MeasuredConfigWarning` naming the file and the reason, and the built-in table serves.
Files are read once per process, at the first lookup for their device and family (:func:`clear_cache` forgets
them, e.g. after changing ``$VLLM_NVFP4_SM120_CONFIG_DIR``).

The validation reads the tables of ``linear.py`` and ``moe.py``, which call this module's lookups from their
selectors: those modules are imported inside the functions here (once per file read, never per lookup).
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.moe_decode import MAX_ROUTES as MAX_DECODE_ROUTES
from .hw import Capability, Family

ENV_CONFIG_DIR = "VLLM_NVFP4_SM120_CONFIG_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "configs"
SCHEMA_VERSION = 1
MOE_FAMILIES = ("moe_w4a16", "moe_w4a4")
# Parameters the dispatch derives per call from the shape and the SM count: not part of a measured tile.
DERIVED_PARAMS = ("split_k", "chunk_n", "ctas")
# Where the Gluon MoE GEMMs run: sm_120 (their target) and sm_90 (the H200 proofs, portable decode).
GLUON_MOE_FAMILIES = (Family.SM120, Family.SM90)

_TOP_KEYS = {"schema_version", "package_version", "device_name", "family", "cc", "sm_count", "measured", "buckets"}
_LINEAR_ROW_KEYS = {"min_t", "max_t", "kernel", "tile", "us", "why"}
_MOE_ROW_KEYS = {"min_t", "max_t", "kernel", "impl", "block_m", "us", "why"}
_FILE_NAME = re.compile(r"^device_name=(?P<device>[A-Za-z0-9_.-]+),family=(?P<family>[a-z0-9_]+)\.json$")
_LINEAR_BUCKET = re.compile(r"^N=(\d+),K=(\d+)$")
_MOE_BUCKET = re.compile(r"^E=(\d+),top_k=(\d+),H=(\d+),I=(\d+)$")


class MeasuredConfigWarning(UserWarning):
    """A measured config file is ignored (the message names the file and why); the built-in table serves."""


class ConfigError(ValueError):
    """Why a measured config file cannot be used (one line)."""


@functools.cache
def device_key(device: str) -> str:
    """A device name as config file names spell it (vLLM's convention: spaces → underscores)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", device.strip())


def config_file_name(device: str, family: str) -> str:
    return f"device_name={device_key(device)},family={family}.json"


def linear_family(route: str) -> str:
    return f"linear_{route}"


def moe_family(w4a4: bool) -> str:
    return MOE_FAMILIES[1] if w4a4 else MOE_FAMILIES[0]


def linear_bucket(n: int, k: int) -> str:
    return f"N={n},K={k}"


def moe_bucket(global_experts: int, top_k: int, hidden: int, intermediate: int) -> str:
    return f"E={global_experts},top_k={top_k},H={hidden},I={intermediate}"


_SHORT = {"block_m": "m", "block_n": "n", "block_k": "k", "block_t": "t", "num_warps": "w", "num_stages": "s",
          "group_m": "g", "rows_per_warp": "r", "row_warps": "rw", "swap_ab": "swap", "max_regs": "regs",
          "overlap_runs": "ov"}


def choice_label(choice: dict) -> str:
    """A row's choice in a table cell: ``w4a16_gemm k128 m64 n64 g8 s3 w4 swap0``, ``w4a16/gluon/bm64``."""
    if "impl" in choice:
        return f"{choice['kernel']}/{choice['impl']}/bm{choice['block_m']}"
    tile = choice.get("tile", {})
    parts = [f"{_SHORT.get(key, key + '=')}{int(v) if isinstance(v, bool) else v}" for key, v in sorted(tile.items())
             if not (key == "block_m" and choice["kernel"] == "gluon_gemv_mma")]  # always one m16 tile
    return " ".join([choice["kernel"], *parts])


def config_dirs() -> tuple[tuple[str, Path], ...]:
    """``((source, folder), ...)`` in precedence order: the user folder (when set), then the package's."""
    user = os.environ.get(ENV_CONFIG_DIR, "").strip()
    return ((("user", Path(user)),) if user else ()) + (("shipped", SHIPPED_DIR),)


# ---- what a file holds, once validated ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MeasuredRow:
    min_t: int
    max_t: int | None
    choice: dict  # as the file writes it, without the timings: kernel and tile, or kernel, impl and block_m
    us: dict[str, float]
    why: str
    # The plan for a call (cap, t, shape...), or None where it cannot run now (a Gluon row with Gluon switched off).
    plan: Callable = field(compare=False, repr=False)

    def covers(self, t: int) -> bool:
        return self.min_t <= t and (self.max_t is None or t <= self.max_t)

    def t_range(self) -> str:
        if self.max_t is None:
            return f"T >= {self.min_t}"
        return f"T = {self.min_t}" if self.min_t == self.max_t else f"T {self.min_t}-{self.max_t}"


@dataclass
class ConfigFile:
    path: Path
    source: str  # "user" | "shipped" | "file" (read directly)
    device: str  # as in the file name
    family: str
    cc: int | None = None
    sm_count: int | None = None
    package_version: str | None = None
    buckets: dict[tuple[int, ...], list[MeasuredRow]] = field(default_factory=dict)
    error: str | None = None  # why the file is ignored

    @property
    def arch(self) -> Family:
        return Capability(self.cc).family

    def rows(self, bucket: tuple[int, ...], t: int) -> MeasuredRow | None:
        return next((r for r in self.buckets.get(bucket, ()) if r.covers(t)), None)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rows_in_order(rows: list[MeasuredRow], bucket: str) -> None:
    for prev, row in zip(rows, rows[1:]):
        if prev.max_t is None or row.min_t <= prev.max_t:
            raise ConfigError(f"bucket {bucket}: rows {prev.t_range()} and {row.t_range()} overlap or are out of order")


def _t_bounds(row: dict, where: str) -> tuple[int, int | None]:
    lo, hi = row.get("min_t"), row.get("max_t", "missing")
    if not _is_int(lo) or lo < 1:
        raise ConfigError(f"{where}: min_t is {lo!r}, expected an integer >= 1")
    if hi is not None and (not _is_int(hi) or hi < lo):
        raise ConfigError(f"{where}: max_t is {hi!r}, expected null or an integer >= min_t ({lo})")
    return lo, hi


def _timings(row: dict, where: str) -> dict[str, float]:
    us = row.get("us", {})
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if not isinstance(us, dict) or not all(isinstance(k, str) and number(v) for k, v in us.items()):
        raise ConfigError(f"{where}: us is not an object of candidate → microseconds")
    if not isinstance(row.get("why", ""), str):
        raise ConfigError(f"{where}: why is not a string")
    return {k: float(v) for k, v in us.items()}


def _check_keys(obj: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} (this package reads {sorted(allowed)})")


# ---- linear rows ---------------------------------------------------------------------------------------------------

def linear_tiles(arch: Family, kernel: str) -> list[dict]:
    """Every tile ``kernel`` may run with on ``arch`` (without the derived parameters), as the dispatch lists them;
    ``[{}]`` for a kernel without tile parameters; ``[]`` where the kernel does not run on ``arch``."""
    from . import linear as L

    kernel = L.LinearKernel(kernel)
    if kernel is L.LinearKernel.W4A16_GEMM:  # the Hopper-only tile spills on sm_120
        return [cfg for kind, cfg in L.w4a16_configs(arch) if kind == "gemm"]
    gluon = (L.LinearKernel.GLUON_GEMV_FMA, L.LinearKernel.GLUON_GEMV_MMA, L.LinearKernel.GLUON_GEMV_STREAM)
    if kernel in gluon and arch not in L.GLUON_GEMV_FAMILIES:
        return []
    tiles = []
    for plan in L.all_linear_plans():
        if plan.kernel == kernel:
            tile = {k: v for k, v in plan.params if k not in DERIVED_PARAMS}
            if tile not in tiles:
                tiles.append(tile)
    return tiles


def route_kernels(route: str) -> tuple[str, ...]:
    """The kernels a route's rows may name: its prefill GEMM and the W4A16 kernels (they read any NVFP4 weight,
    without activation scales); route flashinfer_w4a16 only its own (its weight is FlashInfer's layout)."""
    from . import linear as L

    prefill = L.ROUTE_PREFILL[L.Route(route)]
    if prefill is L.LinearKernel.FI_W4A16:
        return (prefill,)
    w4a16 = tuple(k for k in L.LinearKernel if not k.w4a4 and k is not L.LinearKernel.FI_W4A16)
    return tuple(dict.fromkeys((*w4a16, prefill)))


def kernel_max_t(kernel: str) -> int | None:
    """The largest T a measured row may give a kernel (None: any).  The decode kernels run any T, in token blocks,
    but re-read the weight per block: they stop at the largest mma token block (``GLUON_GEMV_MAX_T``, two blocks of
    the Triton gemv), past the tables' decode rows, so a measurement can move that switch either way."""
    from . import linear as L

    decode = (L.LinearKernel.W4A16_GEMV, L.LinearKernel.GLUON_GEMV_FMA, L.LinearKernel.GLUON_GEMV_MMA,
              L.LinearKernel.GLUON_GEMV_STREAM)
    return L.GLUON_GEMV_MAX_T if L.LinearKernel(kernel) in decode else None


def linear_plan_at(cap: Capability, kernel: str, tile: dict, t: int, n: int, k: int):
    """The full plan of ``kernel`` with ``tile`` for a call: the derived parameters added by the dispatch's rules."""
    from . import linear as L

    kernel = L.LinearKernel(kernel)
    params = dict(tile)
    if kernel is L.LinearKernel.W4A16_GEMV:
        params["split_k"] = L.gemv_split_k(n, k, tile["block_n"], tile["block_k"], cap.sm_count, t)
    elif kernel is L.LinearKernel.W4A16_DEQUANT_MM:
        params["chunk_n"] = L.dequant_mm_chunk_n(t, n, k, cap.sm_count)
    elif kernel is L.LinearKernel.GLUON_GEMV_STREAM:
        params["ctas"] = L.stream_wave_ctas(cap, params, t)
    return L.LinearPlan(kernel, tuple(sorted(params.items())))


def _linear_row(row, where: str, route: str, arch: Family) -> MeasuredRow:
    from ..kernels.gluon_compat import gluon_enabled
    from . import linear as L

    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row is {type(row).__name__}, expected an object")
    _check_keys(row, _LINEAR_ROW_KEYS, where)
    lo, hi = _t_bounds(row, where)
    kernel, tile = row.get("kernel"), row.get("tile", {})
    if kernel not in [str(k) for k in L.LinearKernel]:
        raise ConfigError(f"{where}: kernel {kernel!r} does not exist in this package "
                          f"(kernels: {', '.join(L.LinearKernel)})")
    if kernel not in route_kernels(route):
        raise ConfigError(f"{where}: kernel {kernel} cannot serve route {route} (it may name "
                          f"{', '.join(route_kernels(route))})")
    valid = linear_tiles(arch, kernel)
    if not isinstance(tile, dict) or tile not in valid:
        raise ConfigError(f"{where}: tile {tile!r} is not one of {kernel}'s tiles on {arch}: {valid}")
    limit = kernel_max_t(kernel)
    if limit is not None and (hi is None or hi > limit):
        raise ConfigError(f"{where}: {kernel} serves T <= {limit}, the row reaches {'any T' if hi is None else hi}")
    gluon = kernel.startswith("gluon_")

    def plan(cap: Capability, t: int, n: int, k: int):
        if gluon and not gluon_enabled():
            return None
        return linear_plan_at(cap, kernel, tile, t, n, k)

    return MeasuredRow(lo, hi, {"kernel": kernel, "tile": dict(tile)}, _timings(row, where), row.get("why", ""), plan)


# ---- MoE rows ------------------------------------------------------------------------------------------------------

def moe_choices(cap: Capability, w4a4: bool) -> list[dict]:
    """Every ``{kernel, impl, block_m}`` a MoE row may name on ``cap``'s architecture for a W4A16 (``w4a4`` False)
    or W4A4 layer: the built-in tiers, each on Triton and, where the Gluon GEMMs run and have its BLOCK_M, Gluon."""
    from . import moe as M

    kernels = (M.MoeKernel.W4A16, M.MoeKernel.W4A4) if w4a4 else (M.MoeKernel.W4A16,)
    impls = (M.Impl.TRITON, M.Impl.GLUON) if cap.family in GLUON_MOE_FAMILIES else (M.Impl.TRITON,)
    if cap.family in M.DECODE_FAMILIES:  # the decode plan: w4a16 / decode / BLOCK_M 0, its tiles chosen per T
        impls += (M.Impl.DECODE,)
    block_ms = sorted({p.block_m for p in M.all_moe_plans(cap)})
    # The shape only decides the TMA and epilogue-warp choices inside a plan, not whether the tier exists.
    return [{"kernel": str(kernel), "impl": str(impl), "block_m": block_m}
            for kernel in kernels for block_m in block_ms for impl in impls
            if M.tier_plan(cap, kernel, block_m, hidden=4096, intermediate=4096, impl=impl) is not None]


def _moe_row(row, where: str, w4a4: bool, file_cap: Capability, shape: tuple[int, ...]) -> MeasuredRow:
    from ..kernels.gluon_compat import gluon_enabled
    from . import moe as M

    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row is {type(row).__name__}, expected an object")
    _check_keys(row, _MOE_ROW_KEYS, where)
    lo, hi = _t_bounds(row, where)
    choice = {key: row.get(key) for key in ("kernel", "impl", "block_m")}
    if choice["kernel"] not in [str(k) for k in M.MoeKernel] or choice["impl"] not in [str(i) for i in M.Impl]:
        raise ConfigError(f"{where}: kernel {choice['kernel']!r} / impl {choice['impl']!r} does not exist in this "
                          f"package (kernels {', '.join(M.MoeKernel)}; impls {', '.join(M.Impl)})")
    valid = moe_choices(file_cap, w4a4)
    if choice not in valid:
        names = ", ".join("{kernel}/{impl}/{block_m}".format(**c) for c in valid)
        raise ConfigError(f"{where}: {choice} is not a tier this layer can run on {file_cap.family} (choices: {names})")
    kernel, impl, block_m = M.MoeKernel(choice["kernel"]), M.Impl(choice["impl"]), choice["block_m"]
    _, top_k, hidden, intermediate = shape
    if impl is M.Impl.DECODE and (hi is None or hi * top_k > MAX_DECODE_ROUTES):
        raise ConfigError(f"{where}: the decode kernels take at most {MAX_DECODE_ROUTES} routes (T * top_k), the row "
                          f"reaches {'any T' if hi is None else f'T = {hi}'} at top_k {top_k}")

    def plan(cap: Capability, t: int):
        if impl is M.Impl.GLUON and not gluon_enabled():
            return None
        return M.tier_plan(cap, kernel, block_m, hidden=hidden, intermediate=intermediate, impl=impl, num_tokens=t)

    return MeasuredRow(lo, hi, choice, _timings(row, where), row.get("why", ""), plan)


# ---- reading a file ------------------------------------------------------------------------------------------------

def _family_kind(family: str) -> tuple[str, str | None]:
    """``("linear", route)`` or ``("moe", None)``; ConfigError for an unknown family."""
    from . import linear as L

    if family in MOE_FAMILIES:
        return "moe", None
    route = family.removeprefix("linear_")
    if family.startswith("linear_") and route in [str(r) for r in L.ROUTES]:
        return "linear", route
    raise ConfigError(f"family {family!r} is not one this package tunes "
                      f"({', '.join([linear_family(r) for r in L.ROUTES] + list(MOE_FAMILIES))})")


def _parse(data, cf: ConfigFile) -> None:
    from . import linear as L

    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object, got {type(data).__name__}")
    _check_keys(data, _TOP_KEYS, "top level")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(f"schema_version {data.get('schema_version')!r}, this package reads {SCHEMA_VERSION} "
                          "(re-run `vllm-nvfp4-sm120 tune`)")
    for key, want in (("device_name", cf.device), ("family", cf.family)):
        if data.get(key) != want:
            raise ConfigError(f"{key} {data.get(key)!r} differs from the file name's {want!r}")
    kind, route = _family_kind(cf.family)
    cc, sm_count = data.get("cc"), data.get("sm_count")
    if not _is_int(cc) or Capability(cc).family is Family.OTHER:
        raise ConfigError(f"cc {cc!r} is not a compute capability the dispatch knows (e.g. 120, 90)")
    if not _is_int(sm_count) or sm_count < 1:
        raise ConfigError(f"sm_count {sm_count!r}, expected a positive integer")
    if not isinstance(data.get("package_version"), str) or not isinstance(data.get("measured", {}), dict):
        raise ConfigError("package_version must be a string and measured an object")
    cf.cc, cf.sm_count, cf.package_version = cc, sm_count, data["package_version"]
    arch = cf.arch
    if route is not None and route not in L.TABLE.get(arch, {}):
        raise ConfigError(f"route {route} has no kernels on {arch}")
    buckets = data.get("buckets")
    if not isinstance(buckets, dict) or not buckets:
        raise ConfigError("buckets is missing or empty (expected {shape: [rows]})")
    for name, rows in buckets.items():
        m = (_LINEAR_BUCKET if kind == "linear" else _MOE_BUCKET).match(name)
        if m is None:
            raise ConfigError(f"bucket {name!r} is not "
                              f"{'N=<int>,K=<int>' if kind == 'linear' else 'E=<int>,top_k=<int>,H=<int>,I=<int>'}")
        shape = tuple(int(g) for g in m.groups())
        if min(shape) < 1 or (kind == "linear" and shape[1] % 16) or (kind == "moe" and shape[2] % 16 + shape[3] % 16):
            raise ConfigError(f"bucket {name}: not an NVFP4 shape (sizes >= 1, K multiple of 16)")
        if not isinstance(rows, list) or not rows:
            raise ConfigError(f"bucket {name}: expected a non-empty list of rows")
        parsed = [_linear_row(r, f"bucket {name} row {i}", route, arch) if kind == "linear"
                  else _moe_row(r, f"bucket {name} row {i}", cf.family == MOE_FAMILIES[1], Capability(cc), shape)
                  for i, r in enumerate(rows)]
        _rows_in_order(parsed, name)
        cf.buckets[shape] = parsed


def load_file(path: Path | str, source: str = "file") -> ConfigFile:
    """Read and validate one config file; its ``error`` says why it cannot be used (None: it can)."""
    path = Path(path)
    m = _FILE_NAME.match(path.name)
    cf = ConfigFile(path, source, m.group("device") if m else "?", m.group("family") if m else "?")
    try:
        if m is None:
            raise ConfigError("the file name is not device_name=<device>,family=<family>.json")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read it ({e})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"malformed JSON ({e})") from None
        _parse(data, cf)
    except ConfigError as e:
        cf.error, cf.buckets = str(e), {}
    return cf


def scan() -> list[ConfigFile]:
    """Every config file in the search folders, validated (for ``env``)."""
    out = []
    for source, folder in config_dirs():
        if folder.is_dir():
            out += [load_file(p, source) for p in sorted(folder.glob("device_name=*.json"))]
    return out


@functools.cache
def _files(device: str, family: str, arch: Family) -> tuple[ConfigFile, ...]:
    """The usable files for (device, family) in precedence order; one warning per file that is not.  Cached per
    process: the folders are those of the first lookup (``clear_cache`` reads them again)."""
    usable = []
    for source, folder in config_dirs():
        path = folder / config_file_name(device, family)
        if not path.is_file():
            continue
        cf = load_file(path, source)
        if cf.error is None and cf.arch is not arch:
            cf.error = f"measured on {cf.arch} (cc {cf.cc}), this GPU is {arch}"
        if cf.error is not None:
            warnings.warn(f"{path}: measured config ignored ({cf.error}); the built-in table serves instead",
                          MeasuredConfigWarning, stacklevel=2)
            continue
        usable.append(cf)
    return tuple(usable)


def clear_cache() -> None:
    """Forget the files read (after writing one, or changing ``$VLLM_NVFP4_SM120_CONFIG_DIR``), and the linear op's
    cached plans chosen from them (and the MoE flow's)."""
    from . import linear_call, moe_flow

    _files.cache_clear()
    linear_call.clear()
    moe_flow.clear()


def files_for(cap: Capability, family: str) -> tuple[ConfigFile, ...]:
    if cap.device is None:
        return ()
    return _files(cap.device, family, cap.family)


def measured_row(cap: Capability, family: str, bucket: tuple[int, ...],
                 t: int) -> tuple[ConfigFile, MeasuredRow] | None:
    """The first file's row for this bucket and T, with the file (for ``env`` / ``inspect``)."""
    for cf in files_for(cap, family):
        if (row := cf.rows(bucket, t)) is not None:
            return cf, row
    return None


# ---- the selectors' hooks ------------------------------------------------------------------------------------------

def measured_linear_plan(cap: Capability, route: str, t: int, n: int, k: int):
    """A measured config's plan for this linear call, or None (the built-in table serves)."""
    if cap.device is None:
        return None
    found = measured_row(cap, linear_family(route), (n, k), t)
    return None if found is None else found[1].plan(cap, t, n, k)


def measured_moe_plan(cap: Capability, *, num_tokens: int, top_k: int, global_experts: int, hidden: int,
                      intermediate: int, w4a4: bool):
    """A measured config's plan for this MoE layer call, or None (the built-in tiers serve)."""
    if cap.device is None:
        return None
    found = measured_row(cap, moe_family(w4a4), (global_experts, top_k, hidden, intermediate), num_tokens)
    return None if found is None else found[1].plan(cap, num_tokens)


# ---- what env and inspect report -----------------------------------------------------------------------------------

def bucket_rows(cap: Capability, family: str, bucket: tuple[int, ...]) -> list[tuple[ConfigFile, MeasuredRow]]:
    """Every measured row for this bucket on ``cap``'s GPU, in precedence order (a later file's row serves only
    the T that earlier files' rows leave uncovered)."""
    return [(cf, row) for cf in files_for(cap, family) for row in cf.buckets.get(bucket, ())]


def describe(cap: Capability | None) -> dict:
    """The search folders, every config file in them (usable or why not, and whether it is for ``cap``'s GPU), and
    the measured rows this GPU gets (``env``)."""
    dirs = dict(config_dirs())
    key = device_key(cap.device) if cap is not None and cap.device else None
    files = []
    for cf in scan():
        mine = key is not None and cf.device == key
        if mine and cf.error is None and cf.arch is not cap.family:
            cf.error = f"measured on {cf.arch} (cc {cf.cc}), this GPU is {cap.family}"
        files.append({"path": str(cf.path), "source": cf.source, "device": cf.device, "family": cf.family,
                      "buckets": len(cf.buckets), "for_this_gpu": mine, "error": cf.error})
    usable = []
    if key is not None:
        with warnings.catch_warnings():  # the files' problems are in the listing
            warnings.simplefilter("ignore", MeasuredConfigWarning)
            for family in sorted({f["family"] for f in files if f["for_this_gpu"] and f["error"] is None}):
                usable += files_for(cap, family)
    rows = [{"family": cf.family, "bucket": linear_bucket(*b) if len(b) == 2 else moe_bucket(*b), "t": r.t_range(),
             "choice": choice_label(r.choice), "source": cf.source}
            for cf in usable for b, bucket_rows_ in cf.buckets.items() for r in bucket_rows_]
    return {"env": ENV_CONFIG_DIR, "user_dir": str(dirs["user"]) if "user" in dirs else None,
            "shipped_dir": str(dirs["shipped"]), "device": key, "files": files, "rows": rows}
