"""The tiny checkpoint has the exporters' tensor names, dtypes, shapes and global-scale conventions."""

import json

import pytest
import torch
from safetensors import safe_open

from vllm_nvfp4_sm120.checkpoint import read_safetensors_header
from vllm_nvfp4_sm120.format import NVFP4_AMAX_DIVISOR
from vllm_nvfp4_sm120.inspect_ckpt import inspect_checkpoint
from vllm_nvfp4_sm120.tiny_checkpoint import INDEX_FILE, SAFETENSORS_FILE, TinyShape, edit_safetensors_header

S = TinyShape()
Q = "model.layers.1.self_attn.q_proj"
UP = "model.layers.0.mlp.experts.3.up_proj"
DOWN = "model.layers.0.mlp.experts.3.down_proj"


def _header(path):
    return read_safetensors_header(path / SAFETENSORS_FILE)


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_modelopt_names(tiny, act):
    h = _header(tiny[("modelopt", act)])
    n_q = S.heads * S.head_dim
    assert (h[f"{Q}.weight"].dtype, h[f"{Q}.weight"].shape) == ("U8", (n_q, S.hidden // 2))
    assert (h[f"{Q}.weight_scale"].dtype, h[f"{Q}.weight_scale"].shape) == ("F8_E4M3", (n_q, S.hidden // 16))
    assert (h[f"{Q}.weight_scale_2"].dtype, h[f"{Q}.weight_scale_2"].shape) == ("F32", ())
    assert h[f"{DOWN}.weight"].shape == (S.hidden, S.moe_intermediate // 2)
    assert (f"{UP}.input_scale" in h) == (act == "w4a4")
    assert h["model.layers.0.mlp.gate.weight"].dtype == "BF16"  # the router is not quantized
    assert h["lm_head.weight"].dtype == "BF16"
    qc = json.loads((tiny[("modelopt", act)] / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_algo"] == ("NVFP4" if act == "w4a4" else "MIXED_PRECISION")
    assert "kv_cache_quant_algo" in qc  # vLLM rejects a ModelOpt config without it


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_compressed_tensors_names(tiny, act):
    ckpt = tiny[("compressed-tensors", act)]
    h = _header(ckpt)
    assert h[f"{Q}.weight_packed"].dtype == "U8" and f"{Q}.weight" not in h
    assert h[f"{Q}.weight_scale"].dtype == "F8_E4M3"
    assert (h[f"{Q}.weight_global_scale"].dtype, h[f"{Q}.weight_global_scale"].shape) == ("F32", (1,))
    assert (f"{UP}.input_global_scale" in h) == (act == "w4a4")
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    assert (qc["config_groups"]["group_0"]["input_activations"] is None) == (act == "w4a16")


def test_same_weights_opposite_global_conventions(tiny):
    """Same seed → same codes; ModelOpt stores decode globals, compressed-tensors their reciprocals (encode)."""
    mo, ct = tiny[("modelopt", "w4a4")], tiny[("compressed-tensors", "w4a4")]
    with safe_open(str(mo / "model.safetensors"), "pt") as a, safe_open(str(ct / "model.safetensors"), "pt") as b:
        assert torch.equal(a.get_tensor(f"{UP}.weight"), b.get_tensor(f"{UP}.weight_packed"))
        dec, enc = a.get_tensor(f"{UP}.weight_scale_2"), b.get_tensor(f"{UP}.weight_global_scale")
        torch.testing.assert_close(dec.reshape(1), 1.0 / enc, rtol=1e-6, atol=0)
        torch.testing.assert_close(a.get_tensor(f"{UP}.input_scale").reshape(1),
                                   1.0 / b.get_tensor(f"{UP}.input_global_scale"), rtol=1e-6, atol=0)
        # The decode global is amax / 2688: the largest block scale reaches the e4m3 maximum.
        top = a.get_tensor(f"{UP}.weight_scale").float().max()
        assert float(top) == 448.0 and 0.0 < float(dec) * NVFP4_AMAX_DIVISOR < 1.0


def test_gate_up_share_an_input_scale(tiny):
    # vLLM's compressed-tensors MoE loader raises when w1 and w3 input scales differ; one input, one amax.
    with safe_open(str(tiny[("compressed-tensors", "w4a4")] / "model.safetensors"), "pt") as f:
        gate = f.get_tensor(UP.replace("up_proj", "gate_proj") + ".input_global_scale")
        assert torch.equal(gate, f.get_tensor(f"{UP}.input_global_scale"))


def test_tokenizer_round_trips(tiny):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny[("modelopt", "w4a4")]))
    ids = tok("Héllo, sm_120!")["input_ids"]
    assert tok.decode(ids) == "Héllo, sm_120!" and max(ids) < S.vocab
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                               add_generation_prompt=True)


def test_vllm_accepts_the_quant_configs(tiny):
    """vLLM's own config classes parse what we wrote (the full model load was checked by hand, see the report)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig, ModelOptNvFp4Config

    cfg = ModelOptNvFp4Config.from_config(json.loads((tiny[("modelopt", "w4a4")] / "hf_quant_config.json").read_text()))
    assert cfg.get_name() == "modelopt_fp4"
    mixed = json.loads((tiny[("modelopt", "w4a16")] / "hf_quant_config.json").read_text())
    m = ModelOptMixedPrecisionConfig.from_config(mixed)
    assert m._resolve_quant_algo("model.layers.0.self_attn.qkv_proj") == "W4A16_NVFP4"
    assert m._resolve_quant_algo("model.layers.0.mlp.experts") == "W4A16_NVFP4"
    for act in ("w4a4", "w4a16"):
        qc = json.loads((tiny[("compressed-tensors", act)] / "config.json").read_text())["quantization_config"]
        assert CompressedTensorsConfig.from_config(qc).get_name() == "compressed-tensors"


def test_fp8_attention_is_modelopt_fp8(craft):
    ckpt = craft(attention="FP8", kv_cache_quant_algo="FP8")
    h = _header(ckpt)
    assert (h[f"{Q}.weight"].dtype, h[f"{Q}.weight"].shape) == ("F8_E4M3", (S.heads * S.head_dim, S.hidden))
    assert (h[f"{Q}.weight_scale"].dtype, h[f"{Q}.weight_scale"].shape) == ("F32", ())
    assert (h[f"{Q}.input_scale"].dtype, h[f"{Q}.input_scale"].shape) == ("F32", ())
    assert f"{Q}.weight_scale_2" not in h and h[f"{UP}.weight"].dtype == "U8"  # the experts stay NVFP4
    assert h["model.layers.1.self_attn.k_proj.k_scale"].shape == ()
    qc = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["kv_cache_quant_algo"] == "FP8"
    assert qc["quantized_layers"][Q] == {"quant_algo": "FP8"}
    assert qc["quantized_layers"][UP] == {"quant_algo": "NVFP4", "group_size": 16}


def test_shards_hold_the_same_tensors_as_one_file(craft):
    one, three = craft(), craft(shards=3)
    index = json.loads((three / INDEX_FILE).read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) == 3 and not (three / SAFETENSORS_FILE).exists()
    held = {name: f for f in files for name in read_safetensors_header(three / f)}
    assert held == index and held.keys() == _header(one).keys()
    with safe_open(str(one / SAFETENSORS_FILE), "pt") as a, safe_open(str(three / index[f"{UP}.weight"]), "pt") as b:
        assert torch.equal(a.get_tensor(f"{UP}.weight"), b.get_tensor(f"{UP}.weight"))


def test_tensors_and_config_overrides(craft):
    ckpt = craft(tensors={f"{Q}.input_scale": None, f"{UP}.weight_scale_2": torch.tensor(2.0)},
                 config={"num_experts": 8})
    h = _header(ckpt)
    assert f"{Q}.input_scale" not in h and f"{Q}.weight_scale_2" in h
    with safe_open(str(ckpt / SAFETENSORS_FILE), "pt") as f:
        assert float(f.get_tensor(f"{UP}.weight_scale_2")) == 2.0
    assert json.loads((ckpt / "config.json").read_text())["num_experts"] == 8


def test_edit_safetensors_header_keeps_the_data(craft):
    ckpt = craft()
    with safe_open(str(ckpt / SAFETENSORS_FILE), "pt") as f:
        before = {name: f.get_tensor(name).clone() for name in f.keys()}  # not views of the file, rewritten next
    edit_safetensors_header(ckpt / SAFETENSORS_FILE, lambda header: {**header, "__metadata__": {"edited": "yes"}})
    with safe_open(str(ckpt / SAFETENSORS_FILE), "pt") as f:
        assert f.metadata() == {"edited": "yes"} and set(f.keys()) == before.keys()
        for name, t in before.items():
            assert torch.equal(f.get_tensor(name).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("options,match", [
    (dict(fmt="compressed-tensors", attention="FP8"), "ModelOpt checkpoints only"),
    (dict(experts_by_layer=True), "needs a MIXED_PRECISION config"),
    (dict(attention="INT4"), "attention: expected one of"),
    (dict(shards=0), "shards: expected at least 1"),
])
def test_writer_refuses_options_it_cannot_honour(craft, options, match):
    with pytest.raises(ValueError, match=match):
        craft(**options)


@pytest.mark.parametrize("options", [dict(w4a16=True), dict(attention="FP8"), dict(attention="FP8", w4a16=True),
                                     dict(attention="FP8", experts_by_layer=True), dict(attention="W4A16_NVFP4")],
                         ids=["w4a16", "fp8-attention", "fp8-attention-w4a16", "experts-by-layer", "w4a16-attention"])
def test_vllm_resolves_mixed_maps_as_inspect_classifies_them(craft, options):
    """vLLM's ModelOptMixedPrecisionConfig gives each layer (vLLM's fused names) the algorithm inspect reports for
    its parts in the tensors."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    ckpt = craft(**options)
    cfg = ModelOptMixedPrecisionConfig.from_config(json.loads((ckpt / "hf_quant_config.json").read_text()))
    kinds = {k.kind: k.scheme for k in inspect_checkpoint(ckpt).kinds}
    names = {"W4A4": "NVFP4", "W4A16": "W4A16_NVFP4", "FP8": "FP8"}
    for layer in range(S.layers):
        p = f"model.layers.{layer}"
        assert cfg._resolve_quant_algo(f"{p}.self_attn.qkv_proj") == names[kinds["qkv"]]
        assert cfg._resolve_quant_algo(f"{p}.self_attn.o_proj") == names[kinds["o"]]
        assert cfg._resolve_quant_algo(f"{p}.mlp.experts") == names[kinds["moe_gate_up"]] == names[kinds["moe_down"]]
