"""``vllm-nvfp4-sm120 inspect CHECKPOINT_DIR``: what an NVFP4 checkpoint holds and which of our kernels would run it.

Reads ``config.json``, the quantization config (``hf_quant_config.json`` or ``quantization_config``), the
safetensors *headers* (parsed here: 8-byte length + JSON) and the per-tensor global scales only, so a 200 GB
checkpoint is inspected in seconds without loading it.  Reports:

* the format (ModelOpt or compressed-tensors) and scheme (W4A4: static input scales, or W4A16);
* per layer kind (qkv, o, gate_up, down, MoE gate_up / down, other): count, shapes, how many carry static input
  scales;
* fused parts (q/k/v, gate/up; each expert's w1/w3) whose weight globals differ by more than 5%: vLLM merges
  them into one global for W4A4 (ModelOpt keeps the largest decode, compressed-tensors the smallest; MoE takes
  w1's), which rescales the other parts; the plugin warns at load time;
* the kernel plan per layer kind for sm_120 and for this GPU.

Problems with the input are :class:`CheckpointError` with one line naming the file.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .envinfo import linear_plan, moe_plan

# vllm/scale_policy.py SPREAD_WARN_FRACTION: the plugin warns above this spread (that module imports vLLM).
SPREAD_WARN_FRACTION = 0.05
MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit for the JSON header


class CheckpointError(Exception):
    """A problem with the checkpoint; the message is one line and names the file."""


# ---- files ---------------------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype string: U8, F8_E4M3, F32, BF16, ...
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range inside the data section


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensor table of one ``.safetensors`` file, without reading any tensor data."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
            header = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        table = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e})") from None
    out = {}
    for name, t in table.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = TensorEntry(path, t["dtype"], tuple(t["shape"]), tuple(t["data_offsets"]))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: malformed safetensors header entry {name!r} ({e})") from None
    return out


def safetensors_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted({ckpt / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: file not found (listed in {index.name})")
        return files
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no *.safetensors files")
    return files


def read_scalar(entry: TensorEntry, name: str) -> torch.Tensor:
    """One small tensor (a global scale) by name, through safetensors' ``safe_open`` (reads only that tensor)."""
    from safetensors import safe_open

    with safe_open(str(entry.file), framework="pt") as f:
        return f.get_tensor(name).to(torch.float32).reshape(-1)


# ---- quantization config -------------------------------------------------------------------------------------------

@dataclass
class QuantInfo:
    format: str  # MODELOPT | COMPRESSED_TENSORS
    scheme: str  # "W4A4" | "W4A16" | "mixed"
    source: str  # the file it came from
    algo: str  # as written: "NVFP4", "MIXED_PRECISION", "nvfp4-pack-quantized"
    excluded: list[str] = field(default_factory=list)
    per_layer_algos: dict[str, int] = field(default_factory=dict)  # MIXED_PRECISION: algo -> layer count


_NVFP4_ALGOS = {"NVFP4": "W4A4", "W4A16_NVFP4": "W4A16"}


def _modelopt(qc: dict, source: str) -> QuantInfo:
    # hf_quant_config.json nests under "quantization"; config.json's quantization_config may be flat.
    body = qc.get("quantization", qc)
    if not isinstance(body, dict):
        raise CheckpointError(f"{source}: 'quantization' is not an object")
    algo = str(body.get("quant_algo") or "").upper()
    excluded = list(body.get("exclude_modules") or body.get("ignore") or [])
    if algo in _NVFP4_ALGOS:
        return QuantInfo(MODELOPT, _NVFP4_ALGOS[algo], source, algo, excluded)
    if algo == "MIXED_PRECISION":
        layers = body.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise CheckpointError(f"{source}: MIXED_PRECISION without a 'quantized_layers' map")
        counts: dict[str, int] = defaultdict(int)
        for info in layers.values():
            counts[str(info.get("quant_algo", "?")).upper() if isinstance(info, dict) else "?"] += 1
        schemes = {_NVFP4_ALGOS.get(a) for a in counts}
        if schemes <= {None}:
            raise CheckpointError(f"{source}: not an NVFP4 checkpoint (MIXED_PRECISION layers use {sorted(counts)})")
        scheme = schemes.pop() if len(schemes) == 1 else "mixed"
        return QuantInfo(MODELOPT, scheme, source, algo, excluded, dict(counts))
    raise CheckpointError(f"{source}: not an NVFP4 checkpoint (ModelOpt quant_algo {algo or 'missing'!r}; "
                          f"expected NVFP4, W4A16_NVFP4 or MIXED_PRECISION)")


def _is_fp4(args) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 4 and args.get("type") == "float"
            and args.get("group_size") == 16)


def _compressed_tensors(qc: dict, source: str) -> QuantInfo:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{source}: compressed-tensors quantization_config has no 'config_groups'")
    schemes = set()
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise CheckpointError(f"{source}: config_groups.{name} is not an object")
        if not _is_fp4(g.get("weights")):
            continue
        schemes.add("W4A4" if _is_fp4(g.get("input_activations")) else "W4A16")
    if not schemes:
        fmt = qc.get("format")
        raise CheckpointError(f"{source}: not an NVFP4 checkpoint (compressed-tensors format {fmt!r}, no group "
                              "with 4-bit float weights in groups of 16)")
    scheme = schemes.pop() if len(schemes) == 1 else "mixed"
    return QuantInfo(COMPRESSED_TENSORS, scheme, source, str(qc.get("format")), list(qc.get("ignore") or []))


def quant_info(ckpt: Path, config: dict) -> QuantInfo:
    qc = config.get("quantization_config") or config.get("compression_config")
    source = str(ckpt / "config.json")
    if qc is None:
        hq = ckpt / "hf_quant_config.json"
        if not hq.is_file():
            raise CheckpointError(f"{source}: no quantization_config and no hf_quant_config.json next to it: "
                                  "not a quantized checkpoint")
        qc, source = _read_json(hq), str(hq)
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: the quantization config is not an object")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    producer = (qc.get("producer") or {}).get("name") if isinstance(qc.get("producer"), dict) else None
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(qc, source)
    if method.startswith("modelopt") or producer == "modelopt" or "quantization" in qc:
        return _modelopt(qc, source)
    raise CheckpointError(f"{source}: not an NVFP4 checkpoint (quant_method {qc.get('quant_method')!r})")


# ---- linears -------------------------------------------------------------------------------------------------------

# Suffixes per format: codes, block scales, weight global, input global (and the global's direction).
_NAMES = {
    MODELOPT: ("weight", "weight_scale", "weight_scale_2", "input_scale", "decode"),
    COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "encode"),
}
_EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w1": ("w13", 0), "w3": ("w13", 1)}
_KIND = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o",
         "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up", "down_proj": "down",
         "w1": "gate_up", "w3": "gate_up", "w2": "down"}


@dataclass
class Linear:
    module: str
    kind: str  # qkv, o, gate_up, down, moe_gate_up, moe_down, or the module's last name
    n: int
    k: int
    weight_dec: float  # the per-tensor decode global (ModelOpt weight_scale_2, 1 / CT weight_global_scale)
    input_dec: float | None  # static input decode global, None when absent
    problems: list[str] = field(default_factory=list)


def _kind(module: str) -> str:
    m = _EXPERT.match(module)
    proj = m.group("proj") if m else module.rsplit(".", 1)[-1]
    kind = _KIND.get(proj, proj)
    return f"moe_{kind}" if m else kind


def _fused_key(module: str) -> tuple[str, int] | None:
    """(vLLM's fused module, part index) for a part of a fused linear; None for a linear on its own."""
    parent, _, proj = module.rpartition(".")
    if proj not in _FUSED:
        return None
    fused, idx = _FUSED[proj]
    return f"{parent}.{fused}", idx


def scan_linears(tensors: dict[str, TensorEntry], fmt: str) -> list[Linear]:
    codes_sfx, sf_sfx, wg_sfx, ig_sfx, direction = _NAMES[fmt]
    linears = []
    for name, entry in sorted(tensors.items()):
        if not name.endswith("." + codes_sfx) or entry.dtype != "U8" or len(entry.shape) != 2:
            continue
        module = name[: -len(codes_sfx) - 1]
        if f"{module}.{sf_sfx}" not in tensors:
            continue  # a uint8 tensor that is not NVFP4 codes
        n, k = entry.shape[0], entry.shape[1] * 2
        problems = []
        sf = tensors[f"{module}.{sf_sfx}"]
        if sf.shape != (n, k // 16):
            problems.append(f"{module}.{sf_sfx}: shape {list(sf.shape)}, expected {[n, k // 16]} (linear e4m3 scales)")
        if sf.dtype != "F8_E4M3":
            problems.append(f"{module}.{sf_sfx}: dtype {sf.dtype}, expected F8_E4M3")
        wg = tensors.get(f"{module}.{wg_sfx}")
        if wg is None:
            problems.append(f"{module}: no {wg_sfx} (per-tensor weight global)")
            weight_dec = float("nan")
        else:
            v = read_scalar(wg, f"{module}.{wg_sfx}")
            weight_dec = float(v.max()) if direction == "decode" else float(1.0 / v.max())
        ig = tensors.get(f"{module}.{ig_sfx}")
        input_dec = None
        if ig is not None:
            v = read_scalar(ig, f"{module}.{ig_sfx}")
            input_dec = float(v.max()) if direction == "decode" else float(1.0 / v.max())
        linears.append(Linear(module, _kind(module), n, k, weight_dec, input_dec, problems))
    return linears


@dataclass
class FusedSpread:
    fused: str  # vLLM's fused module (…qkv_proj, …gate_up_proj, …experts.{e} w13)
    parts: list[str]
    decs: list[float]
    spread: float  # max / min - 1


def fused_spreads(linears: list[Linear]) -> list[FusedSpread]:
    groups: dict[str, list[tuple[int, Linear]]] = defaultdict(list)
    for lin in linears:
        key = _fused_key(lin.module)
        if key is not None:
            groups[key[0]].append((key[1], lin))
    out = []
    for fused, parts in sorted(groups.items()):
        parts.sort(key=lambda p: p[0])
        decs = [p[1].weight_dec for p in parts]
        if len(decs) < 2 or not all(d > 0 for d in decs):
            continue
        out.append(FusedSpread(fused, [p[1].module.rsplit(".", 1)[-1] for p in parts], decs,
                               max(decs) / min(decs) - 1.0))
    return out


# ---- the report ----------------------------------------------------------------------------------------------------

@dataclass
class KindSummary:
    kind: str
    count: int
    shapes: list[tuple[int, int]]  # distinct (N, K) of the parts as stored
    with_input_scale: int


@dataclass
class Report:
    path: str
    architecture: str
    quant: QuantInfo
    files: int
    tensors: int
    linears: int
    kinds: list[KindSummary]
    missing_input_scales: list[str]  # W4A4 linears without a static input scale (first few)
    spreads: list[FusedSpread]  # every fused group, largest spread first
    warn_spreads: list[FusedSpread]  # those above SPREAD_WARN_FRACTION
    problems: list[str]
    moe: dict | None  # hidden, intermediate, experts, top_k
    runtime_shapes: list[tuple[str, int, int]]  # distinct (kind, N, K) of the non-expert linears as vLLM runs them (fused)
    plans: dict[str, dict]  # "sm_120" / "this GPU (...)" -> {"linear": ..., "moe": ...}

    def to_json(self) -> dict:
        return asdict(self)


def _plans(cc: int, w4a4: bool, moe: dict | None) -> dict:
    route = "triton" if w4a4 else "w4a16"
    plan: dict = {"route": route}
    try:
        plan["linear"] = [dict(t=t, kernel=k, why=w) for t, k, w in linear_plan(cc, route)]
    except ValueError as e:
        plan["linear"] = f"vLLM's own kernels ({e})"
    if moe is not None:
        plan["moe"] = [dict(t=t, plan=p) for t, p in moe_plan((cc // 10, cc % 10), w4a4=w4a4, **moe)]
    return plan


def runtime_shapes(linears: list[Linear]) -> list[tuple[str, int, int]]:
    """Distinct ``(kind, N, K)`` of the dense linears after vLLM fuses their parts (q/k/v → qkv_proj, ...)."""
    fused: dict[str, list[Linear]] = defaultdict(list)
    for lin in linears:
        if lin.kind.startswith("moe_"):
            continue
        key = _fused_key(lin.module)
        fused[key[0] if key else lin.module].append(lin)
    shapes = {(ls[0].kind, sum(lin.n for lin in ls), ls[0].k) for ls in fused.values()}
    return sorted(shapes)


def inspect_checkpoint(ckpt: str | Path) -> Report:
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory")
    config = _read_json(ckpt / "config.json")
    quant = quant_info(ckpt, config)
    files = safetensors_files(ckpt)
    tensors: dict[str, TensorEntry] = {}
    for f in files:
        tensors.update(read_safetensors_header(f))
    linears = scan_linears(tensors, quant.format)
    if not linears:
        sfx = _NAMES[quant.format][0]
        raise CheckpointError(f"{files[0]}: no NVFP4 linears (no uint8 '*.{sfx}' with '*.weight_scale' next to it)")

    by_kind: dict[str, list[Linear]] = defaultdict(list)
    for lin in linears:
        by_kind[lin.kind].append(lin)
    order = ["qkv", "o", "gate_up", "down", "moe_gate_up", "moe_down"]
    kinds = [KindSummary(kind, len(ls), sorted({(lin.n, lin.k) for lin in ls}),
                         sum(lin.input_dec is not None for lin in ls))
             for kind, ls in sorted(by_kind.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else 99,
                                                                      kv[0]))]
    missing = [lin.module for lin in linears if lin.input_dec is None] if quant.scheme != "W4A16" else []
    spreads = sorted(fused_spreads(linears), key=lambda s: -s.spread)
    problems = [p for lin in linears for p in lin.problems]

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    moe = None
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    if by_kind.get("moe_gate_up") and experts:
        gu = by_kind["moe_gate_up"][0]
        moe = dict(hidden=gu.k, intermediate=gu.n, experts=int(experts),
                   top_k=int(text.get("num_experts_per_tok") or text.get("moe_topk") or 1))
    w4a4 = quant.scheme != "W4A16"
    plans = {"sm_120": _plans(120, w4a4, moe)}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        plans[f"this GPU ({torch.cuda.get_device_name()}, sm_{major}{minor})"] = _plans(major * 10 + minor, w4a4, moe)
    else:
        plans["this machine"] = {"route": None, "linear": "no CUDA GPU: nothing runs here"}
    return Report(
        path=str(ckpt), architecture=",".join(config.get("architectures") or ["?"]), quant=quant,
        files=len(files), tensors=len(tensors), linears=len(linears), kinds=kinds, missing_input_scales=missing[:20],
        spreads=spreads, warn_spreads=[s for s in spreads if s.spread > SPREAD_WARN_FRACTION], problems=problems,
        moe=moe, runtime_shapes=runtime_shapes(linears), plans=plans,
    )


def _fmt_shapes(shapes: list[tuple[int, int]], limit: int = 4) -> str:
    s = ", ".join(f"{n}x{k}" for n, k in shapes[:limit])
    return s + (f", … ({len(shapes)} shapes)" if len(shapes) > limit else "")


def format_report(r: Report, *, max_spreads: int = 8) -> str:
    q = r.quant
    act = "static input scales (W4A4)" if q.scheme == "W4A4" else "weight-only (W4A16)" if q.scheme == "W4A16" \
        else "mixed W4A4 / W4A16"
    lines = [f"{r.path}", f"  architecture  {r.architecture}",
             f"  format        {q.format} NVFP4, {act}  [{q.algo}, from {Path(q.source).name}]"]
    if q.per_layer_algos:
        lines.append("  per layer     " + ", ".join(f"{a}: {n}" for a, n in sorted(q.per_layer_algos.items())))
    if q.excluded:
        lines.append(f"  excluded      {', '.join(q.excluded[:6])}" + (" …" if len(q.excluded) > 6 else ""))
    lines.append(f"  tensors       {r.tensors} in {r.files} file(s); {r.linears} NVFP4 linears")
    if r.moe:
        lines.append(f"  MoE           {r.moe['experts']} experts, top-{r.moe['top_k']}, hidden {r.moe['hidden']}, "
                     f"intermediate {r.moe['intermediate']}")
    lines += ["", f"  {'layer kind':12} {'count':>6}  {'input scales':>12}  shapes (N x K, per part)"]
    for k in r.kinds:
        lines.append(f"  {k.kind:12} {k.count:6}  {k.with_input_scale:>5}/{k.count:<6}  {_fmt_shapes(k.shapes)}")
    if r.missing_input_scales:
        lines.append(f"  W4A4 linears WITHOUT a static input scale ({len(r.missing_input_scales)} shown): "
                     + ", ".join(r.missing_input_scales[:5]))
    lines.append("")
    if r.warn_spreads:
        lines.append(f"  {len(r.warn_spreads)} of {len(r.spreads)} fused groups have weight globals differing by more "
                     f"than {SPREAD_WARN_FRACTION:.0%}:")
        for s in r.warn_spreads[:max_spreads]:
            decs = " ".join(f"{p}={d:.4g}" for p, d in zip(s.parts, s.decs))
            lines.append(f"    {s.fused:48} {100 * s.spread:6.1f}%  ({decs})")
        if len(r.warn_spreads) > max_spreads:
            lines.append(f"    … {len(r.warn_spreads) - max_spreads} more (--json lists all)")
        if q.scheme != "W4A16":
            lines.append("    W4A4 kernels use one global per fused tensor (vLLM merges them), which rescales the other "
                         "parts; the plugin warns at load time.")
        else:
            lines.append("    W4A16: our kernels keep each part's own global (informational, nothing is rescaled).")
    else:
        lines.append(f"  fused groups: {len(r.spreads)}, none with weight globals differing by more than "
                     f"{SPREAD_WARN_FRACTION:.0%}")
    for p in r.problems[:10]:
        lines.append(f"  PROBLEM: {p}")
    for where, plan in r.plans.items():
        lines += ["", f"  kernel plan on {where}" + (f" (route {plan['route']})" if plan.get("route") else "") + ":"]
        if isinstance(plan["linear"], str):
            lines.append(f"    linears: {plan['linear']}")
        else:
            for i, row in enumerate(plan["linear"]):
                lines.append(f"    {'linears' if i == 0 else '':8} {row['t']:10} {row['kernel']}")
        for i, row in enumerate(plan.get("moe") or []):
            lines.append(f"    {'MoE' if i == 0 else '':8} {row['t']:28} {row['plan']}")
    return "\n".join(lines)
