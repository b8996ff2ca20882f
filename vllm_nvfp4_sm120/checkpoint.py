"""Reading a checkpoint folder without loading it: JSON configs, safetensors headers, small tensors by byte range.

Everything a tool (``inspect``, ``bench --checkpoint``) reads from a checkpoint goes through here, so a damaged
or malformed file is one :class:`CheckpointError` whose one-line message names the file (and the tensor or key
where known) instead of a traceback: a truncated shard (the usual incomplete download), a tensor whose data lies
past the end of its file, a header that is not a JSON object, an index whose ``weight_map`` is not
``{tensor: file name}``, a shard the index lists but the folder lacks, a config value of the wrong type.

Checks that find a *readable but wrong* checkpoint (a tensor the index places in a shard that does not hold it,
a tensor in two shards) are returned as problem lines instead, for the caller to report next to its own.

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` and the data section the offsets index into.  Only torch
is needed (no vLLM, no safetensors package).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit for the JSON header
INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of the safetensors dtypes a checkpoint may hold (others are read without a size check).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_TORCH_DTYPES = {**FLOAT_DTYPES, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                 "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SMALL_TENSOR_BYTES = 1 << 20  # what read_small_tensor reads at most: global scales, not weights


class CheckpointError(Exception):
    """A checkpoint that cannot be read; the message is one line and names the file (and tensor where known)."""


# ---- JSON ----------------------------------------------------------------------------------------------------------

def read_json(path: Path) -> dict:
    """A JSON file that must hold an object."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def config_int(config: dict, keys: tuple[str, ...], source: Path | str) -> int | None:
    """The first of ``keys`` that ``config`` sets (not null), as a positive integer; None when none is set."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{source}: {key} is {value!r}, expected a positive integer")
        return value
    return None


def string_list(value, what: str, source: Path | str) -> list[str]:
    """A JSON list of strings (null: empty), e.g. ``exclude_modules``."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{source}: {what} is {short_repr(value)}, expected a list of strings")
    return list(value)


def short_repr(value) -> str:
    """A JSON value as an error message quotes it (long values cut)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- safetensors headers -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: str  # safetensors dtype string: U8, F8_E4M3, F32, BF16, ...
    shape: tuple[int, ...]
    data_start: int  # absolute file offset of the tensor's first byte
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def where(self) -> str:
        """``file: tensor``, as problem lines name a tensor."""
        return f"{self.file.name}: {self.name}"


def _entry(path: Path, name: str, t, data_start: int, data_bytes: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(t, dict):
        raise CheckpointError(f"{where}: header entry is {type(t).__name__}, expected an object")
    dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype is {short_repr(dtype)}, expected a string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape is {short_repr(shape)}, expected a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"{where}: data_offsets is {short_repr(offsets)}, expected [begin, end], begin <= end")
    begin, end = offsets
    if end > data_bytes:
        raise CheckpointError(
            f"{where}: its data (bytes {begin}-{end} of the data section) lies past the end of the file, whose data "
            f"section holds {data_bytes} bytes: the file is truncated (an incomplete download?) or its header is "
            "corrupt")
    size = DTYPE_BYTES.get(dtype)
    if size is not None and (end - begin) != math.prod(shape) * size:
        raise CheckpointError(f"{where}: {end - begin} data bytes for {dtype} {shape}, expected "
                              f"{math.prod(shape) * size}")
    return TensorEntry(path, name, dtype, tuple(shape), data_start + begin, end - begin)


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensor table of one ``.safetensors`` file, checked against the file's size; no tensor data is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte "
                                      "header length; truncated?)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated: the header alone is {n} bytes but the file holds "
                                      f"{size} (an incomplete download?)")
            header = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        table = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (a JSON {type(table).__name__}, expected an "
                              "object)")
    data_start, data_bytes = 8 + n, size - 8 - n
    return {name: _entry(path, name, t, data_start, data_bytes)
            for name, t in table.items() if name != "__metadata__"}


@dataclass
class TensorTable:
    files: list[Path]
    tensors: dict[str, TensorEntry]
    problems: list[str]  # readable but inconsistent (see the module docstring)


def safetensors_files(ckpt: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The weight files vLLM would load (those the index names, else every ``*.safetensors``) and the index's
    ``weight_map`` (None without an index)."""
    index = ckpt / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object ({{tensor name: file name}})")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
                raise CheckpointError(f"{index}: weight_map[{name!r}] is {short_repr(file)}, expected a file name in "
                                      "the checkpoint folder")
        for name, file in weight_map.items():
            if not (ckpt / file).is_file():
                raise CheckpointError(f"{ckpt / file}: file not found (listed in {INDEX_FILE} for tensor {name!r}; "
                                      "an incomplete download?)")
        return sorted({ckpt / f for f in weight_map.values()}), weight_map
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no *.safetensors files")
    return files, None


def read_tensor_table(ckpt: Path) -> TensorTable:
    """Every weight file's header, merged; the index checked against what the shards hold."""
    files, weight_map = safetensors_files(ckpt)
    tensors: dict[str, TensorEntry] = {}
    problems = []
    for f in files:
        for name, entry in read_safetensors_header(f).items():
            if name in tensors:
                problems.append(f"{entry.where}: also in {tensors[name].file.name} (which copy vLLM keeps "
                                "depends on the load order)")
                continue
            tensors[name] = entry
    if weight_map is not None:
        misplaced = [(name, file) for name, file in weight_map.items()
                     if name not in tensors or tensors[name].file.name != Path(file).name]
        if misplaced:
            name, file = misplaced[0]
            held = f"held by {tensors[name].file.name}" if name in tensors else "in no shard"
            problems.append(f"{INDEX_FILE}: {len(misplaced)} tensor(s) listed in a shard that does not hold them "
                            f"(first: {name!r} listed in {file}, {held})")
    return TensorTable(files, tensors, problems)


# ---- tensor data ---------------------------------------------------------------------------------------------------

class TensorReader:
    """Reads small tensors (global scales) by byte range, keeping one open handle per file; a context manager."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The tensor's values as a flat fp32 tensor (float and integer dtypes; at most SMALL_TENSOR_BYTES)."""
        dtype = _TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r}: dtype {entry.dtype} cannot be read here")
        if entry.nbytes > SMALL_TENSOR_BYTES:
            raise ValueError(f"{entry.name}: {entry.nbytes} bytes; TensorReader reads scales, not weights")
        if entry.numel == 0:
            return torch.empty(0)
        try:
            f = self._handles.get(entry.file)
            if f is None:
                f = self._handles[entry.file] = open(entry.file, "rb")
            f.seek(entry.data_start)
            raw = f.read(entry.nbytes)
        except OSError as e:
            raise CheckpointError(f"{entry.file}: cannot read tensor {entry.name!r} ({e.strerror})") from None
        if len(raw) != entry.nbytes:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r}: the file ends inside its data (truncated "
                                  "while being read?)")
        return torch.frombuffer(bytearray(raw), dtype=dtype).to(torch.float32)
