"""``env`` and ``inspect`` say which rows come from measured config files (on a GPU faked at torch's boundary:
the name, compute capability and SM count are all they read)."""

import json

import pytest
import torch
from cli_common import run_cli as run

from vllm_nvfp4_sm120 import envinfo, inspect_ckpt, tune
from vllm_nvfp4_sm120.dispatch import configs
from vllm_nvfp4_sm120.dispatch.hw import Capability

DEVICE = "NVIDIA Test GPU"
CAP = Capability(90, 132, DEVICE)
GEMV = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4}


def write(folder, family, buckets, device=DEVICE):
    path = folder / configs.config_file_name(device, family)
    path.write_text(json.dumps(tune.config_document(device, family, CAP, buckets, {})))
    return path


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """A user folder with: a file for the tiny checkpoint's qkv linear (route triton) and its W4A4 MoE layer, one
    broken file for this GPU and one file for another GPU."""
    monkeypatch.setenv(configs.ENV_CONFIG_DIR, str(tmp_path))
    write(tmp_path, "linear_triton", {"N=256,K=128": [{"min_t": 1, "max_t": 4, "kernel": "w4a16_gemv", "tile": GEMV}]})
    write(tmp_path, "moe_w4a4", {"E=4,top_k=2,H=128,I=64": [{"min_t": 1, "max_t": 8, "kernel": "w4a4",
                                                            "impl": "triton", "block_m": 16}]})
    (tmp_path / configs.config_file_name(DEVICE, "linear_w4a16")).write_text("{")
    write(tmp_path, "linear_w4a16", {"N=256,K=128": [{"min_t": 1, "max_t": 1, "kernel": "w4a16_dequant_mm",
                                                     "tile": {}}]}, device="NVIDIA Other GPU")
    configs.clear_cache()
    yield tmp_path
    configs.clear_cache()


def fake_gpu(monkeypatch):
    monkeypatch.setattr(envinfo, "_gpu", lambda: {"available": True, "count": 1, "name": DEVICE, "capability": "sm_90",
                                                   "cc": 90, "sms": 132, "memory_gib": 1.0, "driver": "0"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: DEVICE)
    monkeypatch.setattr(inspect_ckpt, "capability_of", lambda device: CAP)


def test_env_lists_files_and_the_rows_this_gpu_gets(measured, monkeypatch, capsys):
    fake_gpu(monkeypatch)
    code, out, _ = run(capsys, "env")
    assert code == 0
    section = out[out.index("Measured configs"):]
    assert f"$VLLM_NVFP4_SM120_CONFIG_DIR: {measured}" in section
    assert "device_name=NVIDIA_Test_GPU,family=linear_w4a16.json: IGNORED: malformed JSON" in section
    assert "device_name=NVIDIA_Other_GPU,family=linear_w4a16.json: 1 shape(s) (another GPU)" in section
    assert "rows from measured files on this GPU (NVIDIA_Test_GPU" in section
    assert "linear_triton N=256,K=128" in section and "T 1-4" in section
    assert "w4a16_gemv k256 n32 s4 w4  [user]" in section
    assert "moe_w4a4" in section and "w4a4/triton/bm16" in section
    code, out, _ = run(capsys, "env", "--json", "-")
    mc = json.loads(out)["measured_configs"]
    assert {(r["family"], r["bucket"], r["t"]) for r in mc["rows"]} == {
        ("linear_triton", "N=256,K=128", "T 1-4"), ("moe_w4a4", "E=4,top_k=2,H=128,I=64", "T 1-8")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report where no GPU is visible")
def test_env_without_a_gpu(measured, capsys):
    code, out, _ = run(capsys, "env")
    assert code == 0 and "no GPU here: measured configs apply per GPU model" in out


def test_inspect_names_measured_rows_per_layer(tiny, measured, monkeypatch, capsys):
    fake_gpu(monkeypatch)
    code, out, err = run(capsys, "inspect", tiny[("modelopt", "w4a4")])
    assert code == 0, err
    section = out[out.index("measured configs (`vllm-nvfp4-sm120 tune`) on this GPU:"):]
    assert "qkv 256x128" in section and "(triton): measured rows (other T: the built-in table)" in section
    assert "T 1-4" in section and "[user: device_name=NVIDIA_Test_GPU,family=linear_triton.json]" in section
    assert "o 128x128" in section and "none, the built-in table serves every T" in section
    assert "W4A4 MoE E=4,top_k=2,H=128,I=64" in section and "w4a4/triton/bm16" in section
    code, out, _ = run(capsys, "inspect", tiny[("modelopt", "w4a4")], "--json", "-")
    layers = {layer["layer"]: layer for layer in json.loads(out)["measured"]["layers"]}
    assert layers["qkv 256x128"]["rows"][0]["choice"] == "w4a16_gemv k256 n32 s4 w4" and not layers["o 128x128"]["rows"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report where no GPU is visible")
def test_inspect_without_a_gpu(tiny, capsys):
    code, out, _ = run(capsys, "inspect", tiny[("modelopt", "w4a4")])
    assert code == 0 and "no CUDA GPU: measured configs apply per GPU model" in out
