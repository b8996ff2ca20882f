"""Checkpoints that cannot be read: one ``error:`` line on stderr naming the file (and the tensor or key where
known), exit code 2, no traceback, from ``inspect`` and from ``bench --checkpoint`` (the same reader).

Each case starts from a checkpoint written by ``write_tiny_checkpoint`` and damages it the way real downloads and
exports do: a truncated file, a header that lies (``edit_safetensors_header``), a malformed index or config.
"""

import json

import pytest
from cli_common import edit_json, one_line_error, run_cli

from vllm_nvfp4_sm120.checkpoint import CheckpointError, read_safetensors_header
from vllm_nvfp4_sm120.tiny_checkpoint import INDEX_FILE, SAFETENSORS_FILE, edit_safetensors_header

COMMANDS = {"inspect": ("inspect",), "bench": ("bench", "--checkpoint")}
Q0 = "model.layers.0.self_attn.q_proj"
SHARD1 = "model-00001-of-00002.safetensors"


def _expect(capsys, command, path, *needles) -> str:
    line = one_line_error(*run_cli(capsys, *COMMANDS[command], path))
    for needle in needles:
        assert needle in line, line
    return line


def _cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


def _last_tensor(header: dict) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


def _truncated_data(ckpt):
    _cut(ckpt / SAFETENSORS_FILE, lambda n: n // 2)


def _truncated_header(ckpt):
    _cut(ckpt / SAFETENSORS_FILE, lambda n: 100)


def _offset_past_end(ckpt):
    def edit(header):
        header[f"{Q0}.weight_scale_2"]["data_offsets"][1] += 10**6
        return header
    edit_safetensors_header(ckpt / SAFETENSORS_FILE, edit)


def _edit_entry(name, key, value):
    def damage(ckpt):
        def edit(header):
            header[name][key] = value
            return header
        edit_safetensors_header(ckpt / SAFETENSORS_FILE, edit)
    return damage


def _header_list(ckpt):
    edit_safetensors_header(ckpt / SAFETENSORS_FILE, lambda header: list(header))


def _header_not_json(ckpt):
    (ckpt / SAFETENSORS_FILE).write_bytes((10).to_bytes(8, "little") + b"{not json}")


def _tiny_file(ckpt):
    _cut(ckpt / SAFETENSORS_FILE, lambda n: 6)


# (damage, needles of the error line); ModelOpt, one file.
FILE_CASES = {
    "truncated-data": (_truncated_data, [SAFETENSORS_FILE, "lies past the end of the file", "truncated"]),
    "truncated-header": (_truncated_header, [SAFETENSORS_FILE, "truncated: the header alone is"]),
    "shorter-than-8-bytes": (_tiny_file, [SAFETENSORS_FILE, "not a safetensors file (6 bytes"]),
    "offset-past-end": (_offset_past_end, [SAFETENSORS_FILE, f"tensor '{Q0}.weight_scale_2'", "past the end"]),
    "header-is-a-list": (_header_list, [SAFETENSORS_FILE, "a JSON list, expected an object"]),
    "header-not-json": (_header_not_json, [SAFETENSORS_FILE, "malformed safetensors header"]),
    "entry-not-object": (lambda c: edit_safetensors_header(c / SAFETENSORS_FILE, lambda h: {**h, Q0 + ".x": 5}),
                         [f"tensor '{Q0}.x'", "header entry is int"]),
    "shape-not-a-list": (_edit_entry(f"{Q0}.weight", "shape", "128x64"), [f"'{Q0}.weight'", "shape is '128x64'"]),
    "bytes-do-not-match": (_edit_entry(f"{Q0}.weight_scale_2", "dtype", "F16"),
                           [f"'{Q0}.weight_scale_2'", "4 data bytes for F16 [], expected 2"]),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", FILE_CASES)
def test_damaged_safetensors_file(craft, capsys, command, case):
    damage, needles = FILE_CASES[case]
    ckpt = craft()
    damage(ckpt)
    _expect(capsys, command, ckpt, *needles)


def _missing_shard(ckpt):
    (ckpt / SHARD1).unlink()


def _weight_map_value(value):
    def damage(ckpt):
        edit_json(ckpt / INDEX_FILE, lambda index: index["weight_map"].update({f"{Q0}.weight": value}))
    return damage


INDEX_CASES = {
    "missing-shard": (_missing_shard, [SHARD1, "file not found (listed in", "for tensor"]),
    "weight-map-number": (_weight_map_value(3), [INDEX_FILE, f"weight_map['{Q0}.weight'] is 3"]),
    "weight-map-list": (_weight_map_value(["a"]), [INDEX_FILE, f"weight_map['{Q0}.weight'] is ['a']"]),
    "weight-map-outside": (_weight_map_value("../x.safetensors"), [INDEX_FILE, "expected a file name in the"]),
    "no-weight-map": (lambda c: edit_json(c / INDEX_FILE, lambda index: index.pop("weight_map")),
                      [INDEX_FILE, "no 'weight_map' object"]),
    "index-not-json": (lambda c: (c / INDEX_FILE).write_text("{"), [INDEX_FILE, "malformed JSON"]),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", INDEX_CASES)
def test_damaged_index(craft, capsys, command, case):
    damage, needles = INDEX_CASES[case]
    ckpt = craft(shards=2)
    damage(ckpt)
    _expect(capsys, command, ckpt, *needles)


def _quant_config(edit):
    return lambda ckpt: edit_json(ckpt / "hf_quant_config.json", lambda q: edit(q["quantization"]))


CONFIG_CASES = {
    "num-experts-four": (dict(config={"num_experts": "four"}), None,
                         ["config.json: num_experts is 'four', expected a positive integer"]),
    "top-k-zero": (dict(config={"num_experts_per_tok": 0}), None, ["config.json: num_experts_per_tok is 0"]),
    "architectures-string": (dict(config={"architectures": "Qwen3MoeForCausalLM"}), None,
                             ["config.json: architectures is 'Qwen3MoeForCausalLM', expected a list of strings"]),
    "config-not-json": (dict(), lambda c: (c / "config.json").write_text('{"architectures": ['),
                        ["config.json", "malformed JSON"]),
    "config-a-list": (dict(), lambda c: (c / "config.json").write_text("[]"),
                      ["config.json: expected a JSON object, got list"]),
    "no-config": (dict(), lambda c: (c / "config.json").unlink(), ["config.json: file not found"]),
    "exclude-modules-string": (dict(), _quant_config(lambda q: q.update(exclude_modules="lm_head")),
                               ["hf_quant_config.json: exclude_modules is 'lm_head', expected a list of strings"]),
    "kv-cache-algo-number": (dict(), _quant_config(lambda q: q.update(kv_cache_quant_algo=8)),
                             ["hf_quant_config.json: kv_cache_quant_algo is 8"]),
    "layer-entry-string": (dict(w4a16=True), _quant_config(lambda q: q["quantized_layers"].update({Q0: "NVFP4"})),
                           ["hf_quant_config.json", f"quantized_layers['{Q0}'] is 'NVFP4', expected an object"]),
    "fp8-checkpoint": (dict(), _quant_config(lambda q: q.update(quant_algo="FP8")),
                       ["hf_quant_config.json", "not an NVFP4 checkpoint", "FP8"]),
    "unquantized": (dict(), lambda c: (c / "hf_quant_config.json").unlink(), ["not a quantized checkpoint"]),
    "no-weights": (dict(), lambda c: (c / SAFETENSORS_FILE).unlink(), ["no *.safetensors files"]),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CONFIG_CASES)
def test_malformed_config(craft, capsys, command, case):
    options, damage, needles = CONFIG_CASES[case]
    ckpt = craft(**options)
    if damage is not None:
        damage(ckpt)
    _expect(capsys, command, ckpt, *needles)


def test_compressed_tensors_without_fp4_groups(craft, capsys):
    ckpt = craft("compressed-tensors")

    def to_int4(cfg):
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    edit_json(ckpt / "config.json", to_int4)
    _expect(capsys, "inspect", ckpt, "config.json", "not an NVFP4 checkpoint")


def test_not_a_directory(tmp_path, capsys):
    _expect(capsys, "inspect", tmp_path / "nope", "nope", "not a directory")


def test_the_reader_raises_checkpoint_error(craft):
    """The library call (what bench and other tools use) raises CheckpointError, not a parser's exception."""
    ckpt = craft()
    _truncated_data(ckpt)
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_header(ckpt / SAFETENSORS_FILE)


def test_json_destination_is_checked_before_inspecting(tiny, tmp_path, capsys):
    line = one_line_error(*run_cli(capsys, "inspect", tiny[("modelopt", "w4a4")], "--json", tmp_path / "no" / "r.json"))
    assert "does not exist" in line
    code, out, _ = run_cli(capsys, "inspect", tiny[("modelopt", "w4a4")], "--json", tmp_path / "r.json")
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["problems"] == []
