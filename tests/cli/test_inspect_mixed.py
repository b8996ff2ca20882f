"""``inspect`` on per-layer checkpoints: ModelOpt MIXED_PRECISION (FP8 attention next to NVFP4 experts, W4A16_NVFP4
layers, a map with one entry per MoE layer, an FP8 KV cache) and compressed-tensors with W4A4 and W4A16 groups.

Each layer is classified by its own entry and tensors: FP8 layers are not NVFP4 "mixed W4A4 / W4A16", W4A16_NVFP4
layers are not "W4A4 without a static input scale", layers are counted in the tensors (not map entries), a linear
plan is shown only when some linear is NVFP4, and the report says which layers vLLM keeps on its own kernels.
"""

import json

import pytest
from cli_common import edit_json, problem_lines, run_cli

Q0 = "model.layers.0.self_attn.q_proj"


def _inspect(capsys, path):
    code, out, err = run_cli(capsys, "inspect", path, "--json", "-")
    assert code == 0, (out, err)
    report = json.loads(out)
    assert report["problems"] == []
    code, text, _ = run_cli(capsys, "inspect", path)
    assert code == 0 and problem_lines(text) == []
    return report, text


def _serving(report):
    return {row["layers"]: (row["by"], row["how"]) for row in report["serving"]}


def test_fp8_attention_nvfp4_experts(craft, capsys):
    r, text = _inspect(capsys, craft(attention="FP8"))
    assert r["quant"]["algo"] == "MIXED_PRECISION" and r["quant"]["scheme"] == "W4A4"
    assert r["quant"]["layers"] == {"FP8": 8, "W4A4": 24} and r["linears"] == 24
    assert {(k["kind"], k["scheme"]): k["count"] for k in r["kinds"]} == {
        ("qkv", "FP8"): 6, ("o", "FP8"): 2, ("moe_gate_up", "W4A4"): 16, ("moe_down", "W4A4"): 8}
    assert "per layer: 8 FP8, 24 NVFP4 W4A4" in text and "mixed" not in text
    # no NVFP4 linear: no linear plan (and no dense shapes for bench); the experts' plan is W4A4
    plan = r["plans"]["sm_120"]
    assert plan["linear"] == [] and r["runtime_shapes"] == [] and [p["scheme"] for p in plan["moe"]] == ["W4A4"]
    assert "linears: none is NVFP4 (vLLM's kernels run them)" in text and "route triton" not in text
    assert _serving(r) == {"2 NVFP4 W4A4 MoE layers (24 expert projections)": ("plugin", "automatically"),
                           "8 FP8 linears": ("vLLM", "vLLM's FP8 kernels")}


def test_fp8_attention_w4a16_experts(craft, capsys):
    r, text = _inspect(capsys, craft(attention="FP8", w4a16=True))
    assert r["quant"]["layers"] == {"FP8": 8, "W4A16": 24} and r["quant"]["scheme"] == "W4A16"
    assert "WITHOUT a static input scale" not in text and "no input_scale" not in text
    assert r["moe_input_spreads"] == []
    assert [p["scheme"] for p in r["plans"]["sm_120"]["moe"]] == ["W4A16"]
    by, how = _serving(r)["2 NVFP4 W4A16 MoE layers (24 expert projections)"]
    assert by == "vLLM" and "--moe-backend nvfp4_sm120" in how


def test_w4a16_attention_w4a4_experts(craft, capsys):
    r, text = _inspect(capsys, craft(attention="W4A16_NVFP4"))
    assert r["quant"]["layers"] == {"W4A16": 8, "W4A4": 24} and r["quant"]["scheme"] == "mixed"
    plan = r["plans"]["sm_120"]
    assert [(p["scheme"], p["route"]) for p in plan["linear"]] == [("W4A16", "w4a16")]
    assert [p["scheme"] for p in plan["moe"]] == ["W4A4"]
    serving = _serving(r)
    by, how = serving["8 NVFP4 W4A16 linears"]
    assert by == "vLLM" and how.startswith("Marlin") and "--linear-backend nvfp4_sm120" in how
    assert serving["2 NVFP4 W4A4 MoE layers (24 expert projections)"][0] == "plugin"
    assert "per layer: 8 NVFP4 W4A16, 24 NVFP4 W4A4" in text


def test_layers_are_counted_in_the_tensors_not_the_map(craft, capsys):
    r, text = _inspect(capsys, craft(attention="FP8", experts_by_layer=True))
    assert r["quant"]["map_entries"] == 8 + 2  # q/k/v/o of two layers, one entry per MoE layer
    assert r["quant"]["layers"] == {"FP8": 8, "W4A4": 24}
    assert "quantized_layers has 10 entries, layers counted in the tensors" in text


@pytest.mark.parametrize("kv", [None, "FP8"])
def test_kv_cache_quantization_is_reported(craft, capsys, kv):
    r, text = _inspect(capsys, craft(attention="FP8", kv_cache_quant_algo=kv))
    assert r["quant"]["kv_cache"] == kv
    if kv:
        assert r["kv_scales"] == 4 and "KV cache      FP8; 4 k_scale / v_scale tensors" in text
    else:
        assert "KV cache      not quantized" in text


def test_kv_cache_scheme_of_a_flat_modelopt_config(craft, capsys):
    """config.json's ``quantization_config`` (flat, ``kv_cache_scheme``) instead of hf_quant_config.json."""
    ckpt = craft(attention="FP8")
    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    (ckpt / "hf_quant_config.json").unlink()
    flat = {"quant_method": "modelopt", **quant, "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    del flat["kv_cache_quant_algo"]
    edit_json(ckpt / "config.json", lambda cfg: cfg.update(quantization_config=flat))
    r, _ = _inspect(capsys, ckpt)
    assert r["quant"]["kv_cache"] == "FP8" and r["quant"]["layers"] == {"FP8": 8, "W4A4": 24}


def test_compressed_tensors_w4a4_and_w4a16_groups_by_tensors(craft, capsys):
    """Two NVFP4 groups: each layer is W4A4 when it has an input global, else W4A16."""
    attention = [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"]
    ckpt = craft("compressed-tensors", tensors={f"{m}.input_global_scale": None for m in attention})

    def add_w4a16_group(cfg):
        groups = cfg["quantization_config"]["config_groups"]
        groups["group_1"] = dict(groups["group_0"], targets=["re:.*self_attn.*"], input_activations=None)
    edit_json(ckpt / "config.json", add_w4a16_group)
    r, _ = _inspect(capsys, ckpt)
    assert r["quant"]["layers"] == {"W4A16": 8, "W4A4": 24} and r["quant"]["scheme"] == "mixed"
    assert {(k["kind"], k["scheme"]) for k in r["kinds"]} == {
        ("qkv", "W4A16"), ("o", "W4A16"), ("moe_gate_up", "W4A4"), ("moe_down", "W4A4")}


def test_a_mixed_checkpoint_without_nvfp4_is_refused(craft, capsys):
    ckpt = craft(w4a16=True)
    edit_json(ckpt / "hf_quant_config.json", lambda q: q["quantization"].update(
        quantized_layers={Q0: {"quant_algo": "FP8"}}))
    code, _, err = run_cli(capsys, "inspect", ckpt)
    assert code == 2 and "not an NVFP4 checkpoint (MIXED_PRECISION layers use ['FP8'])" in err
