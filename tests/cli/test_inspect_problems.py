"""``inspect`` on checkpoints that load but are wrong: each case is exactly one PROBLEM line naming the file and the
tensor, the rest of the report is still printed, and the exit code is 1.

Every case is written by ``write_tiny_checkpoint`` with one tensor replaced or dropped (``tensors=``) or one
config value changed; the unchanged checkpoints report no problem (``test_cli.py``).
"""

import json

import pytest
import torch
from cli_common import edit_json, problem_lines, run_cli
from safetensors.torch import save_file

from vllm_nvfp4_sm120.tiny_checkpoint import INDEX_FILE, TinyShape

Q0 = "model.layers.0.self_attn.q_proj"
K0 = "model.layers.0.self_attn.k_proj"
O0 = "model.layers.0.self_attn.o_proj"  # N = K = 128 in the tiny shape
UP = "model.layers.1.mlp.experts.2.up_proj"
DOWN = "model.layers.0.mlp.experts.1.down_proj"
FILE = "model.safetensors"


def _one_problem(capsys, path, *needles) -> str:
    code, out, err = run_cli(capsys, "inspect", path)
    problems = problem_lines(out)
    assert code == 1, (out, err)
    assert len(problems) == 1, problems
    assert "kernel plan on sm_120" in out  # the report is complete
    for needle in needles:
        assert needle in problems[0], problems[0]
    return problems[0]


def _value(fmt: str, v: float) -> torch.Tensor:
    # ModelOpt writes 0-d globals, compressed-tensors [1]
    return torch.tensor(v) if fmt == "modelopt" else torch.tensor([v])


BAD_VALUES = [(float("nan"), "nan"), (float("inf"), "inf"), (0.0, ": 0,"), (-0.5, "-0.5")]
GLOBALS = {"modelopt": ("weight_scale_2", "input_scale"),
           "compressed-tensors": ("weight_global_scale", "input_global_scale")}


@pytest.mark.parametrize("value,shown", BAD_VALUES, ids=["nan", "inf", "zero", "negative"])
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("which,module", [(0, Q0), (1, K0), (0, UP), (1, DOWN)],
                         ids=["weight-global", "input-global", "expert-weight-global", "expert-input-global"])
def test_every_bad_global_is_one_problem(craft, capsys, fmt, which, module, value, shown):
    tensor = f"{module}.{GLOBALS[fmt][which]}"
    line = _one_problem(capsys, craft(fmt, tensors={tensor: _value(fmt, value)}), f"{FILE}: {tensor}: ", shown)
    assert "expected finite and > 0" in line


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("which", [0, 1])
def test_a_global_with_two_values_is_one_problem(craft, capsys, fmt, which):
    tensor = f"{Q0}.{GLOBALS[fmt][which]}"
    _one_problem(capsys, craft(fmt, tensors={tensor: torch.tensor([1e-3, 1e-3])}), f"{FILE}: {tensor}: ",
                 "shape [2], expected one value")


def test_an_integer_global_is_one_problem(craft, capsys):
    _one_problem(capsys, craft(tensors={f"{K0}.input_scale": torch.tensor(1, dtype=torch.int32)}),
                 f"{FILE}: {K0}.input_scale: dtype I32")


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("which,what", [(0, "weight global"), (1, "static input scale")])
def test_a_missing_global_is_one_problem(craft, capsys, fmt, which, what):
    suffix = GLOBALS[fmt][which]
    _one_problem(capsys, craft(fmt, tensors={f"{UP}.{suffix}": None}), f"{FILE}: {UP}: no {suffix}", what)


@pytest.mark.parametrize("value", [float("nan"), 0.0], ids=["nan", "zero"])
def test_a_fused_group_with_a_bad_global_is_listed_not_dropped(craft, capsys, value):
    path = craft(tensors={f"{Q0}.weight_scale_2": torch.tensor(value), f"{UP}.weight_scale_2": torch.tensor(value)})
    code, out, _ = run_cli(capsys, "inspect", path, "--json", "-")
    groups = {s["fused"]: s for s in json.loads(out)["spreads"]}
    assert code == 1 and len(groups) == 10  # 2 qkv + 8 expert gate_up groups, none dropped
    qkv, gate_up = groups["model.layers.0.self_attn.qkv_proj"], groups["model.layers.1.mlp.experts.2.gate_up_proj"]
    assert qkv["spread"] is None and qkv["decs"][0] is None and None not in qkv["decs"][1:]
    assert gate_up["spread"] is None and gate_up["decs"][1] is None
    code, out, _ = run_cli(capsys, "inspect", path)
    assert "inf%" not in out and "nan%" not in out and "2 more fused groups are not comparable" in out
    assert len(problem_lines(out)) == 2


@pytest.mark.parametrize("scale_cols", [8, 7])
def test_k_not_a_multiple_of_16_is_one_problem_with_the_right_advice(craft, capsys, scale_cols):
    """K = 120: no NVFP4 kernel can run it; the block scales' width is not what to fix."""
    codes = torch.zeros(128, 60, dtype=torch.uint8)
    scales = torch.ones(128, scale_cols).to(torch.float8_e4m3fn)
    line = _one_problem(capsys, craft(tensors={f"{O0}.weight": codes, f"{O0}.weight_scale": scales}),
                        f"{FILE}: {O0}.weight: K = 120", "not a multiple of 16", "no NVFP4 kernel",
                        "exclude it from quantization")
    assert "expected [128, 7]" not in line


@pytest.mark.parametrize("shape,dtype,expected", [
    ((128, 9), torch.float8_e4m3fn, "shape [128, 9], expected [128, 8]"),
    ((127, 8), torch.float8_e4m3fn, "shape [127, 8], expected [128, 8]"),
    ((128, 8), torch.uint8, "dtype U8, expected F8_E4M3"),
], ids=["width", "rows", "dtype"])
def test_block_scales_that_do_not_match_the_codes_are_one_problem(craft, capsys, shape, dtype, expected):
    scales = torch.ones(shape).to(dtype)
    _one_problem(capsys, craft(tensors={f"{O0}.weight_scale": scales}), f"{FILE}: {O0}.weight_scale: {expected}")


def test_a_k_tail_that_is_not_a_tile_multiple_is_no_problem(craft, capsys):
    """K = 144 (a multiple of 16, not of the 128-wide K tiles): the kernels mask the tail; only the cuBLAS route
    (K % 32) refuses the shape, which is a note, not a problem."""
    codes = torch.zeros(128, 72, dtype=torch.uint8)
    scales = torch.ones(128, 9).to(torch.float8_e4m3fn)
    code, out, _ = run_cli(capsys, "inspect", craft(tensors={f"{O0}.weight": codes, f"{O0}.weight_scale": scales}))
    assert code == 0 and problem_lines(out) == []
    assert "route cublas (--linear-backend nvfp4_sm120_cublas) refuses 1 of 3 linear shapes (first: o 128x144" in out


def test_an_expert_count_that_differs_from_the_config_is_one_problem(craft, capsys):
    _one_problem(capsys, craft(shape=TinyShape(layers=1), config={"num_experts": 8}),
                 "config.json: 8 experts per MoE layer, but model.layers.0.mlp.experts has NVFP4 weights for 4")


def test_an_index_that_places_a_tensor_in_the_wrong_shard_is_one_problem(craft, capsys):
    path = craft(shards=2)

    def move(index):
        files = sorted(set(index["weight_map"].values()))
        name = next(n for n, f in index["weight_map"].items() if f == files[0])
        index["weight_map"][name] = files[1]

    edit_json(path / INDEX_FILE, move)
    _one_problem(capsys, path, f"{INDEX_FILE}: 1 tensor(s) listed in a shard that does not hold them")


def test_an_index_entry_no_shard_holds_is_one_problem(craft, capsys):
    path = craft(shards=2)
    ghost = {"model.ghost.weight": "model-00001-of-00002.safetensors"}
    edit_json(path / INDEX_FILE, lambda index: index["weight_map"].update(ghost))
    _one_problem(capsys, path, "'model.ghost.weight' listed in model-00001-of-00002.safetensors, in no shard")


def test_a_tensor_in_two_files_is_one_problem(craft, capsys):
    path = craft(shards=2)
    (path / INDEX_FILE).unlink()  # without an index, every *.safetensors file is loaded
    save_file({"model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}, str(path / "extra.safetensors"))
    _one_problem(capsys, path, "model.norm.weight: also in extra.safetensors")


# ---- MIXED_PRECISION: the quantized_layers map against the tensors ----------------------------------------------

def _set_layer(path, module, algo):
    def edit(q):
        if algo is None:
            del q["quantization"]["quantized_layers"][module]
        else:
            q["quantization"]["quantized_layers"][module] = {"quant_algo": algo}
    edit_json(path / "hf_quant_config.json", edit)


@pytest.mark.parametrize("algo,said", [("FP8", "quantized_layers gives it FP8"),
                                       (None, "quantized_layers has no entry for it")], ids=["fp8", "missing"])
def test_nvfp4_codes_the_map_calls_something_else_are_one_problem(craft, capsys, algo, said):
    path = craft(w4a16=True)
    _set_layer(path, Q0, algo)
    _one_problem(capsys, path, f"{FILE}: {Q0}.weight: NVFP4 codes, but {said}")


def test_an_nvfp4_map_entry_on_fp8_weights_is_one_problem(craft, capsys):
    path = craft(attention="FP8")
    _set_layer(path, Q0, "NVFP4")
    _one_problem(capsys, path, f"{FILE}: {Q0}.weight: quantized_layers gives it NVFP4, but it is F8_E4M3 [128, 128]")


@pytest.mark.parametrize("suffix,value", [("weight_scale", float("nan")), ("input_scale", 0.0)])
def test_a_bad_fp8_scale_is_one_problem(craft, capsys, suffix, value):
    tensor = f"{O0}.{suffix}"
    _one_problem(capsys, craft(attention="FP8", tensors={tensor: torch.tensor(value)}), f"{FILE}: {tensor}: ",
                 "expected finite and > 0")


def test_a_bad_kv_cache_scale_is_one_problem(craft, capsys):
    tensor = "model.layers.1.self_attn.v_proj.v_scale"
    _one_problem(capsys, craft(kv_cache_quant_algo="FP8", tensors={tensor: torch.tensor(float("inf"))}),
                 f"{FILE}: {tensor}: inf")
