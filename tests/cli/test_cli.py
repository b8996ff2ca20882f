"""``vllm-nvfp4-sm120 env | inspect | bench | selftest`` on CPU, in-process, against the tiny checkpoints."""

import json
import shutil

import pytest
import torch

from vllm_nvfp4_sm120 import cli

NO_GPU = not torch.cuda.is_available()


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- inspect -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_inspect_reports_format_scales_and_plan(tiny, capsys, fmt, act):
    code, out, err = run(capsys, "inspect", str(tiny[(fmt, act)]), "--json", "-")
    assert code == 0, err
    r = json.loads(out)
    assert r["quant"]["format"] == fmt and r["quant"]["scheme"] == act.upper()
    kinds = {k["kind"]: k for k in r["kinds"]}
    assert {k: v["count"] for k, v in kinds.items()} == {"qkv": 6, "o": 2, "moe_gate_up": 16, "moe_down": 8}
    assert all(v["with_input_scale"] == (v["count"] if act == "w4a4" else 0) for v in kinds.values())
    assert r["moe"] == {"hidden": 128, "intermediate": 64, "experts": 4, "top_k": 2}
    assert sorted(map(tuple, r["runtime_shapes"])) == [("o", 128, 128), ("qkv", 256, 128)]
    plan = r["plans"]["sm_120"]
    assert plan["route"] == ("triton" if act == "w4a4" else "w4a16")
    # decode sizes: a W4A16 kernel on the same weight, any route (the Gluon gemv on sm_120 unless disabled)
    assert plan["linear"][0]["kernel"] == "gluon_gemv_fma"
    assert {row["plan"].split()[0] for row in plan["moe"]} == ({"w4a16", "w4a4"} if act == "w4a4" else {"w4a16"})
    # Random per-part magnitudes: most fused groups have globals further apart than the 5% the plugin warns at.
    assert len(r["warn_spreads"]) >= len(r["spreads"]) // 2 > 0
    assert all(s["spread"] > 0.05 for s in r["warn_spreads"])


def test_inspect_text_report(tiny, capsys):
    code, out, _ = run(capsys, "inspect", str(tiny[("modelopt", "w4a4")]))
    assert code == 0
    assert "modelopt NVFP4, static input scales (W4A4)" in out
    assert "differing by more than 5%" in out and "qkv_proj" in out
    assert "kernel plan on sm_120 (route triton)" in out and "w4a4_triton 128x128x128" in out


def test_inspect_shared_globals_have_no_spread(tiny, capsys):
    code, out, _ = run(capsys, "inspect", str(tiny["shared"]), "--json", "-")
    r = json.loads(out)
    assert code == 0 and r["warn_spreads"] == [] and all(s["spread"] == 0 for s in r["spreads"])


def test_inspect_without_argument_uses_a_demo_checkpoint(capsys):
    code, out, _ = run(capsys, "inspect", "--demo-format", "compressed-tensors", "--w4a16")
    assert code == 0
    assert "tiny compressed-tensors demo" in out and "weight-only (W4A16)" in out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _expect_error(capsys, path, *needles):
    code, out, err = run(capsys, "inspect", str(path))
    assert code == 2, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_inspect_errors(tiny, tmp_path, capsys):
    src = tiny[("modelopt", "w4a4")]
    _expect_error(capsys, tmp_path / "nope", "nope", "not a directory")

    d = _copy(src, tmp_path / "no-config")
    (d / "config.json").unlink()
    _expect_error(capsys, d, "config.json", "not found")

    d = _copy(src, tmp_path / "bad-config")
    (d / "config.json").write_text("{\"architectures\": [")
    _expect_error(capsys, d, "config.json", "malformed JSON")

    d = _copy(src, tmp_path / "fp8")
    q = json.loads((d / "hf_quant_config.json").read_text())
    q["quantization"]["quant_algo"] = "FP8"
    (d / "hf_quant_config.json").write_text(json.dumps(q))
    _expect_error(capsys, d, "hf_quant_config.json", "not an NVFP4 checkpoint", "FP8")

    d = _copy(src, tmp_path / "unquantized")
    (d / "hf_quant_config.json").unlink()
    _expect_error(capsys, d, "config.json", "not a quantized checkpoint")

    d = _copy(src, tmp_path / "no-weights")
    (d / "model.safetensors").unlink()
    _expect_error(capsys, d, "no-weights", "no *.safetensors")

    d = _copy(src, tmp_path / "truncated")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:6])
    _expect_error(capsys, d, "model.safetensors", "not a safetensors file")

    d = _copy(src, tmp_path / "bad-header")
    (d / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"{not json}")
    _expect_error(capsys, d, "model.safetensors", "malformed safetensors header")


def test_inspect_error_compressed_tensors_not_fp4(tiny, tmp_path, capsys):
    d = _copy(tiny[("compressed-tensors", "w4a4")], tmp_path / "int4")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    (d / "config.json").write_text(json.dumps(cfg))
    _expect_error(capsys, d, "config.json", "not an NVFP4 checkpoint")


# ---- env -----------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not NO_GPU, reason="checks the CPU-only report")
def test_env_on_cpu(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_NVFP4_SM120_DISABLE_GLUON", raising=False)
    code, out, _ = run(capsys, "env")
    assert code == 0
    assert "none (no CUDA device visible): showing the sm_120 plan" in out
    assert "w4a4_triton 128x128x128" in out and "--moe-backend nvfp4_sm120" in out
    assert "Gluon      enabled" in out


def test_env_json_and_gluon_switch(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
    code, out, _ = run(capsys, "env", "--json", "-")
    info = json.loads(out)
    assert code == 0
    assert info["gluon"]["enabled"] is False and "VLLM_NVFP4_SM120_DISABLE_GLUON" in info["gluon"]["why"]
    assert info["versions"]["torch"] == torch.__version__
    assert info["linear_plan"]["triton"][-1]["kernel"].startswith("w4a4_triton")
    assert isinstance(info["linear_plan"]["cublas"], list)  # sm_120 (or this GPU's) table has the route
    assert {c["what"].split(" (")[0] for c in info["flashinfer_checks"]} >= {"b12x dense GEMM"}


# ---- selftest ------------------------------------------------------------------------------------------------------

def test_selftest_format_only(tmp_path, capsys):
    report = tmp_path / "r.json"
    code, out, _ = run(capsys, "selftest", "--only", "format", "--match", "swizzle", "--report", str(report), "--quiet")
    assert code == 0 and "1 passed, 0 failed" in out
    data = json.loads(report.read_text())
    assert data["environment"]["torch"] == torch.__version__
    assert [r["status"] for r in data["results"]] == ["PASS"]


@pytest.mark.skipif(not NO_GPU, reason="checks what a CPU-only machine reports")
def test_selftest_gpu_checks_skip_on_cpu(capsys):
    code, out, _ = run(capsys, "selftest", "--only", "gpu", "--report", "", "--quiet")
    assert code == 0 and "0 failed" in out and "0 passed" in out
    assert "could not run here" in out and "no CUDA GPU on this machine" in out


def test_selftest_rejects_unknown_kind(capsys):
    code, _, err = run(capsys, "selftest", "--only", "format,gpus", "--report", "")
    assert code == 2 and "gpus" in err


@pytest.mark.compile
def test_selftest_format_and_compile(tmp_path, capsys):
    """The README's CPU story: references and every sm_120 compile check pass (about 45 s on 2 cores)."""
    code, out, _ = run(capsys, "selftest", "--only", "format,compile", "--report", str(tmp_path / "r.json"), "--quiet")
    assert code == 0, out
    assert " 0 failed" in out and "FAIL" not in out


# ---- bench ---------------------------------------------------------------------------------------------------------

def test_bench_rejects_bad_arguments(tiny, tmp_path, capsys):
    code, _, err = run(capsys, "bench", "--kernels", "ours,magic")
    assert code == 2 and "magic" in err
    code, _, err = run(capsys, "bench", "--models", "gpt-5")
    assert code == 2 and "gpt-5" in err
    code, _, err = run(capsys, "bench", "--checkpoint", str(tmp_path / "missing"))
    assert code == 2 and "missing" in err


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU-only message")
def test_bench_needs_a_gpu(tiny, capsys):
    code, _, err = run(capsys, "bench", "--checkpoint", str(tiny[("modelopt", "w4a4")]))
    assert code == 2 and "needs a CUDA GPU" in err


def test_bench_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_require_matplotlib", lambda: None)
    code, _, err = run(capsys, "bench", "--plot", "x.png")
    assert code == 2 and "pip install matplotlib" in err


def test_bench_table_and_speedups_from_rows():
    rows = [dict(model="m", layer="qkv", n=256, k=128, t=t, kernel=kern, us=us, tflops=0.0, read_tbs=0.0, note="")
            for t, kern, us in [(1, "ours-triton (w4a16_gemv)", 2.0), (1, "vllm-cutlass", 5.0), (1, "vllm-marlin", 4.0),
                                (1, "cublas-bf16", 6.0), (1, "vllm-emulation", 1.0), (64, "ours-triton (w4a4_triton)", 3.0)]]
    result = dict(device="GPU (sm_120)", torch="x", ceilings=dict(dram_read_tbs=1.5, cublas_bf16_tflops_8192=200.0),
                  rows=rows, skipped={"vllm-b12x": "not supported"})
    sp = {s["t"]: s for s in cli.speedups(rows)}
    assert sp[1]["vllm"] == "vllm-marlin" and sp[1]["vs_vllm"] == 2.0 and sp[1]["vs_cublas"] == 3.0  # emulation excluded
    assert sp[64]["vs_vllm"] is None
    table = cli.format_bench_table(result)
    assert "2.00x" in table and "3.00x" in table and "vllm-b12x: not supported" in table


@pytest.mark.gpu
def test_bench_runs_on_this_gpu(tiny, tmp_path, capsys):
    """H200: our kernels and cuBLAS side by side (vLLM's kernels skip with a reason where vLLM is absent)."""
    out_json = tmp_path / "bench.json"
    code, out, err = run(capsys, "bench", "--models", "qwen3-32b", "--tokens", "1,64", "--min-bytes", "2e8",
                         "--repeats", "3", "--json", str(out_json))
    assert code == 0, err
    data = json.loads(out_json.read_text())
    kernels = {r["kernel"].split(" ")[0] for r in data["rows"]}
    assert {"ours-triton", "ours-w4a16", "cublas-bf16"} <= kernels
    assert all(r["us"] > 0 for r in data["rows"])
    assert any(s["vs_cublas"] for s in data["speedups"])
    assert "vs vLLM" in out
