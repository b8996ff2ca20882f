"""``vllm-nvfp4-sm120 inspect CHECKPOINT_DIR``: what an NVFP4 checkpoint holds, what is wrong with it, and which
kernels would run each layer.

Reads ``config.json``, the quantization config (``hf_quant_config.json`` or ``quantization_config``), the
safetensors headers and the global scales only (through :mod:`.checkpoint`), so a 200 GB checkpoint is inspected
in seconds without loading it.  Reports:

* the format (ModelOpt or compressed-tensors) and each layer's scheme: NVFP4 W4A4 (static input scales), NVFP4
  W4A16 (weight-only) or, in a ModelOpt MIXED_PRECISION checkpoint, the algorithm its ``quantized_layers`` entry
  names (e.g. FP8 attention next to NVFP4 experts), with layers counted in the tensors, not map entries; the
  KV-cache quantization;
* per layer kind and scheme: count, shapes, how many carry static input scales;
* PROBLEM lines, each naming the file and the tensor: a global scale that is not one finite value > 0 (ModelOpt
  ``weight_scale_2`` / ``input_scale``, compressed-tensors ``weight_global_scale`` / ``input_global_scale``, FP8
  and KV-cache scales), a W4A4 layer without its input scale, K not a multiple of 16, block scales whose shape
  does not match the codes, tensors that disagree with the ``quantized_layers`` entry, an expert count that
  differs from ``config.json``, an index that places a tensor in the wrong shard;
* fused parts (q/k/v, gate/up; each expert's w1/w3) whose weight globals differ by more than 5%: vLLM merges
  them into one global for W4A4 (ModelOpt keeps the largest decode, compressed-tensors the smallest; MoE takes
  w1's), which rescales the other parts; the plugin warns at load time;
* per W4A4 MoE layer, the spread of the experts' static input scales: vLLM and the plugin quantize every
  expert's input with the layer's largest one;
* which layers the plugin takes on sm_120 and which stay on vLLM's kernels, and the plugin's kernel plan for
  sm_120 and for this GPU.

No vLLM import: it runs on a machine with torch and Triton alone.  A checkpoint that cannot be read is a
:class:`CheckpointError` with one line naming the file.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .checkpoint import (
    FLOAT_DTYPES,
    SMALL_TENSOR_BYTES,
    CheckpointError,
    TensorEntry,
    TensorReader,
    config_int,
    read_json,
    read_tensor_table,
    short_repr,
    string_list,
)
from .dispatch import configs
from .dispatch.hw import Capability, capability_of
from .envinfo import AUTO_BACKEND, MOE_BACKEND, backend_name, linear_plan, moe_plan
from .format import BLOCK_SIZE
from .format.scales import SPREAD_WARN_FRACTION

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
W4A4, W4A16 = "W4A4", "W4A16"
# ModelOpt's algorithms of the NVFP4 family (top level or per layer) and the scheme each means.
NVFP4_ALGOS = {"NVFP4": W4A4, "W4A16_NVFP4": W4A16}
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")

__all__ = ["CheckpointError", "Report", "format_report", "inspect_checkpoint"]


# ---- quantization config -------------------------------------------------------------------------------------------

@dataclass
class QuantInfo:
    format: str  # MODELOPT | COMPRESSED_TENSORS
    algo: str  # as written: "NVFP4", "MIXED_PRECISION", "nvfp4-pack-quantized"
    source: str  # the file it came from
    excluded: list[str] = field(default_factory=list)
    kv_cache: str | None = None  # the KV-cache quantization ("FP8"); None: not quantized
    map_entries: int = 0  # MIXED_PRECISION: entries of the quantized_layers map
    # From the tensors (inspect_checkpoint):
    scheme: str = ""  # of the NVFP4 layers: "W4A4" | "W4A16" | "mixed"
    layers: dict[str, int] = field(default_factory=dict)  # quantized layers per scheme: W4A4, W4A16, FP8, ...


@dataclass
class LayerAlgos:
    """How a layer's scheme is decided: one for every NVFP4 layer, a MIXED_PRECISION map, or (neither) the layer's
    own tensors (compressed-tensors with W4A4 and W4A16 groups: an input global means W4A4)."""

    default: str | None = None  # W4A4 | W4A16
    by_module: dict[str, str] | None = None  # quantized_layers: module -> algo (upper case)
    _moe_cache: dict[str, str | None] = field(default_factory=dict, repr=False)

    def resolve(self, module: str) -> str | None:
        """The ``quantized_layers`` algo vLLM 0.33 (``ModelOptMixedPrecisionConfig._resolve_quant_algo``) gives the
        layer holding ``module`` (a Hugging Face name); None when it has none (vLLM leaves it unquantized)."""
        layers = self.by_module or {}
        m = _EXPERT.match(module)
        if m is None:
            fused = _fused_key(module)
            return layers.get(module) or (layers.get(fused[0]) if fused else None)
        # vLLM resolves a MoE layer once, by its "…experts" prefix: that key, else the first key below it, else the
        # first key below the layer's parent module.
        moe = m.group("moe")
        if moe not in self._moe_cache:
            parent = moe.rsplit(".experts", 1)[0] + "."
            self._moe_cache[moe] = layers.get(moe) or next(
                (a for key, a in layers.items() if key.startswith(moe + ".")), None) or next(
                (a for key, a in layers.items() if key.startswith(parent)), None)
        return self._moe_cache[moe]


def _kv_scheme(scheme: dict) -> str:
    """``kv_cache_scheme`` (compressed-tensors style) as an algorithm name."""
    if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
        return "FP8"
    return f"{scheme.get('type')}{scheme.get('num_bits')}"


def _modelopt(qc: dict, source: str) -> tuple[QuantInfo, LayerAlgos]:
    # hf_quant_config.json nests under "quantization"; config.json's quantization_config may be flat.
    body = qc.get("quantization", qc)
    if not isinstance(body, dict):
        raise CheckpointError(f"{source}: 'quantization' is not an object")
    algo = str(body.get("quant_algo") or "").upper()
    key = "exclude_modules" if "exclude_modules" in body else "ignore"
    excluded = string_list(body.get(key), key, source)
    kv = body.get("kv_cache_quant_algo")
    if kv is None and isinstance(body.get("kv_cache_scheme"), dict):
        kv = _kv_scheme(body["kv_cache_scheme"])
    elif kv is not None and not isinstance(kv, str):
        raise CheckpointError(f"{source}: kv_cache_quant_algo is {short_repr(kv)}, expected a string or null")
    kv = kv.upper() if kv else None
    if algo in NVFP4_ALGOS:
        return QuantInfo(MODELOPT, algo, source, excluded, kv), LayerAlgos(default=NVFP4_ALGOS[algo])
    if algo == "MIXED_PRECISION":
        layers = body.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise CheckpointError(f"{source}: MIXED_PRECISION without a 'quantized_layers' map")
        by_module = {}
        for name, info in layers.items():
            layer_algo = info.get("quant_algo") if isinstance(info, dict) else None
            if not isinstance(layer_algo, str) or not layer_algo:
                raise CheckpointError(f"{source}: quantized_layers[{name!r}] is {short_repr(info)}, expected an "
                                      "object with a 'quant_algo' string")
            by_module[name] = layer_algo.upper()
        if not set(by_module.values()) & set(NVFP4_ALGOS):
            raise CheckpointError(f"{source}: not an NVFP4 checkpoint (MIXED_PRECISION layers use "
                                  f"{sorted(set(by_module.values()))})")
        return (QuantInfo(MODELOPT, algo, source, excluded, kv, map_entries=len(by_module)),
                LayerAlgos(by_module=by_module))
    raise CheckpointError(f"{source}: not an NVFP4 checkpoint (ModelOpt quant_algo {algo or 'missing'!r}; "
                          f"expected NVFP4, W4A16_NVFP4 or MIXED_PRECISION)")


def _is_fp4(args) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 4 and args.get("type") == "float"
            and args.get("group_size") == 16)


def _compressed_tensors(qc: dict, source: str) -> tuple[QuantInfo, LayerAlgos]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{source}: compressed-tensors quantization_config has no 'config_groups'")
    schemes = set()
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise CheckpointError(f"{source}: config_groups.{name} is not an object")
        if _is_fp4(g.get("weights")):
            schemes.add(W4A4 if _is_fp4(g.get("input_activations")) else W4A16)
    if not schemes:
        fmt = qc.get("format")
        raise CheckpointError(f"{source}: not an NVFP4 checkpoint (compressed-tensors format {fmt!r}, no group "
                              "with 4-bit float weights in groups of 16)")
    kv = qc.get("kv_cache_scheme")
    info = QuantInfo(COMPRESSED_TENSORS, str(qc.get("format")), source, string_list(qc.get("ignore"), "ignore", source),
                     _kv_scheme(kv) if isinstance(kv, dict) else None)
    return info, LayerAlgos(default=schemes.pop() if len(schemes) == 1 else None)


def quant_info(ckpt: Path, config: dict) -> tuple[QuantInfo, LayerAlgos]:
    qc = config.get("quantization_config") or config.get("compression_config")
    source = str(ckpt / "config.json")
    if qc is None:
        hq = ckpt / "hf_quant_config.json"
        if not hq.is_file():
            raise CheckpointError(f"{source}: no quantization_config and no hf_quant_config.json next to it: "
                                  "not a quantized checkpoint")
        qc, source = read_json(hq), str(hq)
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: the quantization config is not an object")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    producer = (qc.get("producer") or {}).get("name") if isinstance(qc.get("producer"), dict) else None
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(qc, source)
    if method.startswith("modelopt") or producer == "modelopt" or "quantization" in qc:
        return _modelopt(qc, source)
    raise CheckpointError(f"{source}: not an NVFP4 checkpoint (quant_method {qc.get('quant_method')!r})")


# ---- layers --------------------------------------------------------------------------------------------------------

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
KIND_ORDER = ("qkv", "o", "gate_up", "down", "moe_gate_up", "moe_down")


@dataclass
class Linear:
    """One NVFP4 linear as stored: a fused part (q_proj, gate_proj, ...) or one expert's projection."""

    module: str
    kind: str  # qkv, o, gate_up, down, moe_gate_up, moe_down, or the module's last name
    scheme: str  # W4A4 | W4A16
    n: int
    k: int
    weight_dec: float | None  # per-tensor decode global (ModelOpt weight_scale_2, 1 / CT weight_global_scale)
    input_dec: float | None  # static input decode global
    has_input_scale: bool  # the tensor exists (its value may still be invalid: then input_dec is None)


@dataclass
class OtherLayer:
    """A quantized layer of a MIXED_PRECISION checkpoint that is not NVFP4 (FP8, ...): vLLM's kernels run it."""

    module: str
    kind: str
    algo: str
    n: int
    k: int
    has_input_scale: bool


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


def _scale_problem(reader: TensorReader, entry: TensorEntry, *, one_value: bool = True) -> tuple[str | None, list]:
    """``(why the tensor is not a valid scale, its values)``: float, finite and > 0; one value unless told."""
    if entry.dtype not in FLOAT_DTYPES:
        return f"{entry.where}: dtype {entry.dtype}, expected F32 (a float scale)", []
    if one_value and entry.numel != 1:
        return f"{entry.where}: shape {list(entry.shape)}, expected one value (shape [] or [1])", []
    if entry.nbytes > SMALL_TENSOR_BYTES:
        return None, []  # a large block-scale tensor (FP8 per block): not read
    values = reader.read(entry)
    bad = values[~(torch.isfinite(values) & (values > 0))]
    if bad.numel():
        first = f"{float(bad[0]):g}"
        what = first if values.numel() == 1 else f"{bad.numel()} of {values.numel()} values (first {first})"
        return f"{entry.where}: {what}, expected finite and > 0", []
    return None, values.tolist()


def _global_dec(reader: TensorReader, entry: TensorEntry | None, direction: str, problems: list[str]) -> float | None:
    """The decode value of a per-tensor global (None when absent or invalid; the latter adds a problem)."""
    if entry is None:
        return None
    why, values = _scale_problem(reader, entry)
    if why is not None:
        problems.append(why)
        return None
    return values[0] if direction == "decode" else 1.0 / values[0]


def _shape_problem(codes: TensorEntry, sf: TensorEntry, n: int, k: int) -> str | None:
    """What is wrong with the codes / block-scale pair of one linear (the first thing found)."""
    if k % BLOCK_SIZE:
        return (f"{codes.where}: K = {k} (codes {list(codes.shape)}) is not a multiple of {BLOCK_SIZE}: NVFP4 keeps "
                f"one e4m3 scale per {BLOCK_SIZE} weights along K, so no NVFP4 kernel (vLLM's or the plugin's) can run "
                "this layer; export it unquantized (exclude it from quantization)")
    if sf.shape != (n, k // BLOCK_SIZE):
        return (f"{sf.where}: shape {list(sf.shape)}, expected [{n}, {k // BLOCK_SIZE}]: one e4m3 scale per "
                f"{BLOCK_SIZE} weights of the codes {list(codes.shape)} (K = {k})")
    if sf.dtype != "F8_E4M3":
        return f"{sf.where}: dtype {sf.dtype}, expected F8_E4M3"
    return None


def _scheme(algos: LayerAlgos, module: str, has_input: bool) -> tuple[str, str | None]:
    """``(scheme, why the config disagrees with the tensors)`` of an NVFP4 linear."""
    by_tensors = W4A4 if has_input else W4A16
    if algos.by_module is None:
        return algos.default or by_tensors, None
    algo = algos.resolve(module)
    if algo in NVFP4_ALGOS:
        return NVFP4_ALGOS[algo], None
    if algo is None:
        return by_tensors, "NVFP4 codes, but quantized_layers has no entry for it (vLLM loads it unquantized)"
    return by_tensors, f"NVFP4 codes, but quantized_layers gives it {algo}"


def scan_linears(tensors: dict[str, TensorEntry], fmt: str, algos: LayerAlgos, reader: TensorReader,
                 problems: list[str]) -> list[Linear]:
    """Every NVFP4 linear (uint8 codes with block scales next to them), each checked; problems are appended."""
    codes_sfx, sf_sfx, wg_sfx, ig_sfx, direction = _NAMES[fmt]
    linears = []
    for name, entry in sorted(tensors.items()):
        if not name.endswith("." + codes_sfx) or entry.dtype != "U8" or len(entry.shape) != 2:
            continue
        module = name[: -len(codes_sfx) - 1]
        sf = tensors.get(f"{module}.{sf_sfx}")
        if sf is None:
            continue  # a uint8 tensor that is not NVFP4 codes
        n, k = entry.shape[0], entry.shape[1] * 2
        if (why := _shape_problem(entry, sf, n, k)) is not None:
            problems.append(why)
        wg = tensors.get(f"{module}.{wg_sfx}")
        if wg is None:
            problems.append(f"{entry.file.name}: {module}: no {wg_sfx} (its per-tensor weight global)")
        weight_dec = _global_dec(reader, wg, direction, problems)
        ig = tensors.get(f"{module}.{ig_sfx}")
        input_dec = _global_dec(reader, ig, direction, problems)
        scheme, why = _scheme(algos, module, ig is not None)
        if why is not None:
            problems.append(f"{entry.where}: {why}")
        elif scheme == W4A4 and ig is None:
            problems.append(f"{entry.file.name}: {module}: no {ig_sfx} (a W4A4 layer needs its static input scale)")
        linears.append(Linear(module, _kind(module), scheme, n, k, weight_dec, input_dec, ig is not None))
    return linears


def scan_other_layers(tensors: dict[str, TensorEntry], algos: LayerAlgos, nvfp4: set[str], reader: TensorReader,
                      problems: list[str]) -> list[OtherLayer]:
    """The MIXED_PRECISION layers that are not NVFP4 (2-D ``*.weight`` with a ``quantized_layers`` algo)."""
    if algos.by_module is None:
        return []
    out = []
    for name, entry in sorted(tensors.items()):
        if not name.endswith(".weight") or len(entry.shape) != 2 or name[: -len(".weight")] in nvfp4:
            continue
        module = name[: -len(".weight")]
        algo = algos.resolve(module)
        if algo is None:
            continue  # not quantized
        if algo in NVFP4_ALGOS:
            problems.append(f"{entry.where}: quantized_layers gives it {algo}, but it is {entry.dtype} "
                            f"{list(entry.shape)}, not NVFP4 codes (uint8 [N, K/2] next to a weight_scale)")
            continue
        if algo.startswith("FP8"):
            _check_fp8(tensors, module, entry, algo, reader, problems)
        out.append(OtherLayer(module, _kind(module), algo, entry.shape[0], entry.shape[1],
                              f"{module}.input_scale" in tensors))
    return out


def _check_fp8(tensors: dict[str, TensorEntry], module: str, weight: TensorEntry, algo: str, reader: TensorReader,
               problems: list[str]) -> None:
    if not weight.dtype.startswith("F8"):
        problems.append(f"{weight.where}: quantized_layers gives it {algo}, but its dtype is {weight.dtype}")
        return
    ws = tensors.get(f"{module}.weight_scale")
    if ws is None:
        problems.append(f"{weight.file.name}: {module}: no weight_scale (FP8 weights need their scale)")
    elif (why := _scale_problem(reader, ws, one_value=False)[0]) is not None:
        problems.append(why)
    ins = tensors.get(f"{module}.input_scale")
    if ins is not None and (why := _scale_problem(reader, ins)[0]) is not None:
        problems.append(why)


def _check_kv_scales(tensors: dict[str, TensorEntry], reader: TensorReader, problems: list[str]) -> int:
    """Check every KV-cache scale (``*.k_scale``, ``*.v_scale``); returns how many there are."""
    found = 0
    for name, entry in sorted(tensors.items()):
        if name.endswith(KV_SCALE_SUFFIXES):
            found += 1
            if (why := _scale_problem(reader, entry)[0]) is not None:
                problems.append(why)
    return found


# ---- fused groups and MoE input scales -----------------------------------------------------------------------------

@dataclass
class FusedSpread:
    fused: str  # vLLM's fused module (…qkv_proj, …gate_up_proj, …experts.{e} w13)
    scheme: str
    parts: list[str]
    decs: list[float | None]
    spread: float | None  # max / min - 1; None when a part's global is missing or invalid (a PROBLEM names it)


def fused_spreads(linears: list[Linear]) -> list[FusedSpread]:
    groups: dict[str, list[tuple[int, Linear]]] = defaultdict(list)
    for lin in linears:
        key = _fused_key(lin.module)
        if key is not None:
            groups[key[0]].append((key[1], lin))
    out = []
    for fused, parts in sorted(groups.items()):
        if len(parts) < 2:
            continue
        parts.sort(key=lambda p: p[0])
        decs = [p[1].weight_dec for p in parts]
        spread = max(decs) / min(decs) - 1.0 if None not in decs else None
        out.append(FusedSpread(fused, parts[0][1].scheme, [p[1].module.rsplit(".", 1)[-1] for p in parts], decs,
                               spread))
    return out


@dataclass
class MoeInputSpread:
    """The static input scales of one GEMM input of a W4A4 MoE layer, across its experts."""

    layer: str  # …mlp.experts
    gemm: str  # "gate_up" (w1/w3 input: the hidden states) or "down" (w2 input: the intermediate)
    experts: int  # experts with a valid input scale
    smallest: tuple[int, float]  # (expert, decode scale)
    largest: tuple[int, float]
    spread: float  # largest / smallest - 1


def moe_input_spreads(linears: list[Linear]) -> list[MoeInputSpread]:
    """Per W4A4 MoE layer and GEMM: each expert's input decode scale (the max of its parts) across the experts."""
    per_expert: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for lin in linears:
        m = _EXPERT.match(lin.module)
        if m is None or lin.scheme != W4A4 or lin.input_dec is None:
            continue
        experts = per_expert[(m.group("moe"), lin.kind.removeprefix("moe_"))]
        e = int(m.group("e"))
        experts[e] = max(experts.get(e, 0.0), lin.input_dec)
    out = []
    for (layer, gemm), decs in sorted(per_expert.items()):
        if len(decs) < 2:
            continue
        lo, hi = min(decs.items(), key=lambda kv: kv[1]), max(decs.items(), key=lambda kv: kv[1])
        out.append(MoeInputSpread(layer, gemm, len(decs), lo, hi, hi[1] / lo[1] - 1.0))
    return sorted(out, key=lambda s: -s.spread)


# ---- the report ----------------------------------------------------------------------------------------------------

@dataclass
class KindSummary:
    kind: str
    scheme: str  # W4A4 | W4A16 (NVFP4) or another MIXED_PRECISION algo (FP8, ...)
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
    linears: int  # NVFP4 linears as stored (fused parts, expert projections)
    kinds: list[KindSummary]  # every quantized layer, per kind and scheme
    kv_scales: int  # k_scale / v_scale tensors (counted when the KV cache is quantized)
    spreads: list[FusedSpread]  # every fused group, largest spread first (unknown spreads last)
    warn_spreads: list[FusedSpread]  # those above SPREAD_WARN_FRACTION
    moe_input_spreads: list[MoeInputSpread]  # largest first
    problems: list[str]  # each names the file and the tensor
    notes: list[str]  # remarks that are not problems of the checkpoint
    moe: dict | None  # hidden, intermediate, experts, top_k (of the NVFP4 MoE layers)
    runtime_shapes: list[tuple[str, int, int]]  # distinct (kind, N, K) of the NVFP4 dense linears as vLLM runs them
    serving: list[dict]  # on sm_120: {"by": "plugin" | "vLLM", "layers": ..., "how": ...}
    plans: dict[str, dict]  # "sm_120" / "this GPU (...)" -> {"linear": [...], "moe": [...]} or {"note": ...}
    # Per layer shape on this GPU: the rows measured config files give it ({"note": ...} without a GPU).
    measured: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _plans(cc: int, dense: list[str], moe_schemes: list[str], moe: dict | None) -> dict:
    """The plugin's plan on compute capability ``cc`` for the NVFP4 schemes present (dense linears, MoE)."""
    plan: dict = {"linear": [], "moe": []}
    for scheme in dense:
        route = "triton" if scheme == W4A4 else "w4a16"
        try:
            rows = [dict(t=t, kernel=k, why=w) for t, k, w in linear_plan(cc, route)]
        except ValueError as e:
            rows = f"vLLM's own kernels ({e})"
        plan["linear"].append(dict(scheme=scheme, route=route, rows=rows))
    for scheme in moe_schemes if moe is not None else ():
        try:
            rows = [dict(t=t, plan=p) for t, p in moe_plan((cc // 10, cc % 10), w4a4=scheme == W4A4, **moe)]
        except ValueError as e:
            rows = f"vLLM's own kernels ({e})"
        plan["moe"].append(dict(scheme=scheme, rows=rows))
    return plan


def _measured(cap: Capability, dense: list[str], shapes: list[tuple[str, int, int]], moe_schemes: list[str],
              moe: dict | None) -> dict:
    """Per layer shape (TP = 1) on this GPU: the measured config rows that serve it; none → the built-in table."""
    layers = []
    for scheme in dense:
        route = "triton" if scheme == W4A4 else "w4a16"
        for kind, n, k in shapes:
            found = configs.bucket_rows(cap, configs.linear_family(route), (n, k))
            layers.append(dict(layer=f"{kind} {n}x{k}", route=route, rows=_measured_rows(found)))
    for scheme in moe_schemes if moe is not None else ():
        bucket = (moe["experts"], moe["top_k"], moe["hidden"], moe["intermediate"])
        found = configs.bucket_rows(cap, configs.moe_family(scheme == W4A4), bucket)
        layers.append(dict(layer=f"{scheme} MoE {configs.moe_bucket(*bucket)}", route="moe",
                           rows=_measured_rows(found)))
    return {"gpu": cap.device, "layers": layers}


def _measured_rows(found) -> list[dict]:
    return [dict(t=row.t_range(), choice=configs.choice_label(row.choice), file=cf.path.name, source=cf.source)
            for cf, row in found]


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


def _serving(linears: list[Linear], others: list[OtherLayer]) -> list[dict]:
    """Who runs which layers on sm_120 with the plugin installed (vLLM 0.33's selection, as the plugin patches it)."""
    rows = []
    for scheme, by, how in (
            (W4A4, "plugin", "automatically (route triton)"),
            (W4A16, "vLLM", f"Marlin (vLLM's choice for W4A16); the plugin's with --linear-backend {AUTO_BACKEND} "
                            f"(or {backend_name('w4a16')})")):
        dense = [lin for lin in linears if not lin.kind.startswith("moe_") and lin.scheme == scheme]
        if dense:
            rows.append(dict(by=by, layers=f"{len(dense)} NVFP4 {scheme} linears", how=how))
    for scheme, by, how in (
            (W4A4, "plugin", "automatically"),
            (W4A16, "vLLM", f"vLLM's own NVFP4 MoE kernels; the plugin's with --moe-backend {MOE_BACKEND}")):
        experts = [lin for lin in linears if lin.kind.startswith("moe_") and lin.scheme == scheme]
        if experts:
            layers = {_EXPERT.match(lin.module).group("moe") for lin in experts}
            rows.append(dict(by=by, layers=f"{len(layers)} NVFP4 {scheme} MoE layers ({len(experts)} expert "
                                           "projections)", how=how))
    for (algo, moe), count in sorted(Counter((o.algo, o.kind.startswith("moe_")) for o in others).items()):
        what = "expert projections" if moe else "linears"
        rows.append(dict(by="vLLM", layers=f"{count} {algo} {what}",
                         how="vLLM's FP8 kernels" if algo.startswith("FP8") else f"vLLM's {algo} kernels"))
    return rows


def _kinds(linears: list[Linear], others: list[OtherLayer]) -> list[KindSummary]:
    groups: dict[tuple[str, str], list[Linear | OtherLayer]] = defaultdict(list)
    for layer in [*linears, *others]:
        groups[(layer.kind, layer.scheme if isinstance(layer, Linear) else layer.algo)].append(layer)
    order = lambda kv: (KIND_ORDER.index(kv[0][0]) if kv[0][0] in KIND_ORDER else 99, kv[0])  # noqa: E731
    return [KindSummary(kind, scheme, len(ls), sorted({(x.n, x.k) for x in ls}), sum(x.has_input_scale for x in ls))
            for (kind, scheme), ls in sorted(groups.items(), key=order)]


def _moe_shape(linears: list[Linear], text: dict, source: Path, problems: list[str]) -> tuple[dict | None, list[str]]:
    """The NVFP4 MoE layers' shape for the plan (None without experts), checked against config.json."""
    experts_of: dict[str, set[int]] = defaultdict(set)
    for lin in linears:
        if (m := _EXPERT.match(lin.module)) is not None:
            experts_of[m.group("moe")].add(int(m.group("e")))
    if not experts_of:
        return None, []
    experts = config_int(text, ("num_experts", "num_local_experts", "n_routed_experts"), source)
    top_k = config_int(text, ("num_experts_per_tok", "moe_topk"), source)
    for layer, idx in sorted(experts_of.items()):
        if experts is not None and len(idx) != experts:
            problems.append(f"{source.name}: {experts} experts per MoE layer, but {layer} has NVFP4 weights for "
                            f"{len(idx)} (experts {min(idx)}-{max(idx)})")
    if top_k is None:
        return None, [f"{source.name} has no num_experts_per_tok: the MoE plan is not shown"]
    gu = next((lin for lin in linears if lin.kind == "moe_gate_up"), None)
    if gu is None:
        return None, []
    return dict(hidden=gu.k, intermediate=gu.n, experts=experts or max(map(len, experts_of.values())),
                top_k=top_k), []


def _route_notes(linears: list[Linear]) -> list[str]:
    """Shapes a W4A4 route taken by name refuses (per layer, with a log line; vLLM's choice runs those)."""
    from .dispatch.hw import SM120_REFERENCE
    from .dispatch.vendor import cublas_refusal

    # K % 16 != 0 is a problem of its own (no kernel runs it).
    shapes = [s for s in runtime_shapes([lin for lin in linears if lin.scheme == W4A4]) if s[2] % BLOCK_SIZE == 0]
    # The shape limits only: an sm_120 GPU with a CUDA build that has cuBLAS FP4.
    refused = [(kind, n, k, why) for kind, n, k in shapes
               if (why := cublas_refusal(SM120_REFERENCE, n, k, cuda_version="12.8")) is not None]
    if not refused:
        return []
    kind, n, k, why = refused[0]
    return [f"route cublas (--linear-backend {backend_name('cublas')}) refuses {len(refused)} of {len(shapes)} linear "
            f"shapes (first: {kind} {n}x{k}: {why}); vLLM's choice runs those layers"]


def inspect_checkpoint(ckpt: str | Path) -> Report:
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory")
    config_path = ckpt / "config.json"
    config = read_json(config_path)
    quant, algos = quant_info(ckpt, config)
    table = read_tensor_table(ckpt)
    problems = list(table.problems)
    with TensorReader() as reader:
        linears = scan_linears(table.tensors, quant.format, algos, reader, problems)
        if not linears:
            sfx = _NAMES[quant.format][0]
            raise CheckpointError(f"{table.files[0]}: no NVFP4 linears (no uint8 '*.{sfx}' with '*.weight_scale' "
                                  "next to it)")
        others = scan_other_layers(table.tensors, algos, {lin.module for lin in linears}, reader, problems)
        kv_scales = _check_kv_scales(table.tensors, reader, problems) if quant.kv_cache else 0
    nvfp4_schemes = sorted({lin.scheme for lin in linears}, reverse=True)  # W4A4 first
    quant.scheme = nvfp4_schemes[0] if len(nvfp4_schemes) == 1 else "mixed"
    quant.layers = dict(Counter([lin.scheme for lin in linears] + [o.algo for o in others]))

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    moe, notes = _moe_shape(linears, text, config_path, problems)
    notes += _route_notes(linears)
    dense = sorted({lin.scheme for lin in linears if not lin.kind.startswith("moe_")}, reverse=True)
    moe_schemes = sorted({lin.scheme for lin in linears if lin.kind.startswith("moe_")}, reverse=True)
    plans = {"sm_120": _plans(120, dense, moe_schemes, moe)}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        plans[f"this GPU ({torch.cuda.get_device_name()}, sm_{major}{minor})"] = _plans(major * 10 + minor, dense,
                                                                                        moe_schemes, moe)
        measured = _measured(capability_of(torch.device("cuda")), dense, runtime_shapes(linears), moe_schemes, moe)
    else:
        plans["this machine"] = {"note": "no CUDA GPU: nothing runs here"}
        measured = {"note": "no CUDA GPU: measured configs apply per GPU model (the sm_120 plan above is the "
                            "built-in table's)"}
    spreads = sorted(fused_spreads(linears), key=lambda s: (s.spread is None, -(s.spread or 0.0)))
    architectures = string_list(config.get("architectures"), "architectures", config_path)
    return Report(
        path=str(ckpt), architecture=",".join(architectures) or "?", quant=quant, files=len(table.files),
        tensors=len(table.tensors), linears=len(linears), kinds=_kinds(linears, others), kv_scales=kv_scales,
        spreads=spreads, warn_spreads=[s for s in spreads if s.spread is not None and s.spread > SPREAD_WARN_FRACTION],
        moe_input_spreads=moe_input_spreads(linears), problems=problems, notes=notes, moe=moe,
        runtime_shapes=runtime_shapes(linears), serving=_serving(linears, others), plans=plans, measured=measured,
    )


# ---- text ----------------------------------------------------------------------------------------------------------

def _fmt_shapes(shapes: list[tuple[int, int]], limit: int = 4) -> str:
    s = ", ".join(f"{n}x{k}" for n, k in shapes[:limit])
    return s + (f", … ({len(shapes)} shapes)" if len(shapes) > limit else "")


def _format_line(q: QuantInfo) -> str:
    """What the checkpoint is: one scheme for every layer, or the per-layer counts."""
    if q.layers.keys() == {W4A4}:
        what = "NVFP4, static input scales (W4A4)"
    elif q.layers.keys() == {W4A16}:
        what = "NVFP4, weight-only (W4A16)"
    else:
        names = {W4A4: "NVFP4 W4A4", W4A16: "NVFP4 W4A16"}
        what = "per layer: " + ", ".join(f"{n} {names.get(s, s)}" for s, n in sorted(q.layers.items()))
    where = f"{q.algo}, from {Path(q.source).name}"
    if q.map_entries:
        where += f"; quantized_layers has {q.map_entries} entries, layers counted in the tensors"
    return f"  format        {q.format} {what}  [{where}]"


def _kv_line(r: Report) -> str:
    q = r.quant
    if q.kv_cache is None:
        return "  KV cache      not quantized"
    return f"  KV cache      {q.kv_cache}; {r.kv_scales} k_scale / v_scale tensors"


def _spread_lines(r: Report, max_spreads: int) -> list[str]:
    lines = []
    unknown = sum(s.spread is None for s in r.spreads)
    if r.warn_spreads:
        lines.append(f"  {len(r.warn_spreads)} of {len(r.spreads)} fused groups have weight globals differing by more "
                     f"than {SPREAD_WARN_FRACTION:.0%}:")
        for s in r.warn_spreads[:max_spreads]:
            decs = " ".join(f"{p}={d:.4g}" for p, d in zip(s.parts, s.decs))
            lines.append(f"    {s.fused:48} {100 * s.spread:6.1f}%  ({decs})")
        if len(r.warn_spreads) > max_spreads:
            lines.append(f"    … {len(r.warn_spreads) - max_spreads} more (--json lists all)")
        if any(s.scheme == W4A4 for s in r.warn_spreads):
            lines.append("    W4A4 kernels use one global per fused tensor (vLLM merges them), which rescales the "
                         "other parts; the plugin warns at load time.")
        if any(s.scheme == W4A16 for s in r.warn_spreads):
            lines.append("    W4A16: the plugin's kernels keep each part's own global (informational, nothing is "
                         "rescaled).")
    else:
        lines.append(f"  fused groups: {len(r.spreads)}, none with weight globals differing by more than "
                     f"{SPREAD_WARN_FRACTION:.0%}" + (f" ({unknown} not comparable)" if unknown else ""))
    if unknown and r.warn_spreads:
        lines.append(f"    {unknown} more fused groups are not comparable: a part's weight global is missing or "
                     "invalid (PROBLEM below)")
    elif unknown:
        lines.append("    (a part's weight global is missing or invalid: PROBLEM below)")
    return lines


def _moe_input_lines(r: Report, max_spreads: int) -> list[str]:
    if not r.moe_input_spreads:
        return []
    lines = ["  MoE static input scales per layer (vLLM and the plugin quantize every expert's input with the "
             "layer's largest):"]
    for s in r.moe_input_spreads[:max_spreads]:
        lines.append(f"    {s.layer:40} {s.gemm:8} {s.experts:4} experts  decode {s.smallest[1]:.4g} (expert "
                     f"{s.smallest[0]}) - {s.largest[1]:.4g} (expert {s.largest[0]}), {1 + s.spread:.2f}x")
    if len(r.moe_input_spreads) > max_spreads:
        lines.append(f"    … {len(r.moe_input_spreads) - max_spreads} more (--json lists all)")
    return lines


def _plan_rows(rows: list[dict] | str, cells) -> list[str]:
    """A plan's rows (``cells(row)`` each), or the one line saying why it has none."""
    return [f"      {rows}"] if isinstance(rows, str) else [f"      {cells(row)}" for row in rows]


def _plan_lines(where: str, plan: dict) -> list[str]:
    lines = ["", f"  kernel plan on {where}:"]
    if "note" in plan:
        return lines + [f"    {plan['note']}"]
    if not plan["linear"]:
        lines.append("    linears: none is NVFP4 (vLLM's kernels run them)")
    for p in plan["linear"]:
        lines.append(f"    NVFP4 {p['scheme']} linears (route {p['route']}):")
        lines += _plan_rows(p["rows"], lambda row: f"{row['t']:10} {row['kernel']}")
    for p in plan["moe"]:
        lines.append(f"    NVFP4 {p['scheme']} MoE experts:")
        lines += _plan_rows(p["rows"], lambda row: f"{row['t']:28} {row['plan']}")
    return lines


def format_report(r: Report, *, max_spreads: int = 8, max_problems: int = 20) -> str:
    q = r.quant
    lines = [f"{r.path}", f"  architecture  {r.architecture}", _format_line(q), _kv_line(r)]
    if q.excluded:
        lines.append(f"  excluded      {', '.join(q.excluded[:6])}" + (" …" if len(q.excluded) > 6 else ""))
    lines.append(f"  tensors       {r.tensors} in {r.files} file(s); {r.linears} NVFP4 linears")
    if r.moe:
        lines.append(f"  MoE           {r.moe['experts']} experts, top-{r.moe['top_k']}, hidden {r.moe['hidden']}, "
                     f"intermediate {r.moe['intermediate']}")
    lines += ["", f"  {'layer kind':12} {'scheme':8} {'count':>6}  {'input scales':>12}  shapes (N x K, per part)"]
    for k in r.kinds:
        lines.append(f"  {k.kind:12} {k.scheme:8} {k.count:6}  {k.with_input_scale:>5}/{k.count:<6}  "
                     f"{_fmt_shapes(k.shapes)}")
    lines.append("")
    lines += _spread_lines(r, max_spreads)
    lines += _moe_input_lines(r, max_spreads)
    lines += [f"  note: {n}" for n in r.notes]
    lines += [f"  PROBLEM: {p}" for p in r.problems[:max_problems]]
    if len(r.problems) > max_problems:
        lines.append(f"  … {len(r.problems) - max_problems} more problems (--json lists all)")
    lines += ["", "  on sm_120 with the plugin installed:"]
    lines += [f"    {row['by']:7} {row['layers']}: {row['how']}" for row in r.serving]
    lines.append(f"    (other GPUs: vLLM's kernels for every layer unless the plugin's are named: --linear-backend "
                 f"{AUTO_BACKEND}, --moe-backend {MOE_BACKEND})")
    for where, plan in r.plans.items():
        lines += _plan_lines(where, plan)
    return "\n".join(lines + _measured_lines(r.measured))


def _measured_lines(m: dict) -> list[str]:
    lines = ["", "  measured configs (`vllm-nvfp4-sm120 tune`) on this GPU:"]
    if "note" in m:
        return lines + [f"    {m['note']}"]
    for layer in m["layers"]:
        if not layer["rows"]:
            lines.append(f"    {layer['layer']:28} ({layer['route']}): none, the built-in table serves every T")
            continue
        lines.append(f"    {layer['layer']:28} ({layer['route']}): measured rows (other T: the built-in table)")
        lines += [f"      {row['t']:14} {row['choice']}  [{row['source']}: {row['file']}]" for row in layer["rows"]]
    return lines
