"""``vllm-nvfp4-sm120 env | inspect | bench`` on CPU, in-process, against the tiny checkpoints (``selftest``:
``test_selftest.py``; broken checkpoints: ``test_inspect_problems.py``, ``test_checkpoint_errors.py``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_common import problem_lines
from cli_common import run_cli as run

from vllm_nvfp4_sm120 import bench

NO_GPU = not torch.cuda.is_available()


# ---- inspect -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_inspect_reports_format_scales_and_plan(tiny, capsys, fmt, act):
    code, out, err = run(capsys, "inspect", str(tiny[(fmt, act)]), "--json", "-")
    assert code == 0, err
    r = json.loads(out)
    scheme = act.upper()
    assert r["quant"]["format"] == fmt and r["quant"]["scheme"] == scheme and r["quant"]["layers"] == {scheme: 32}
    assert r["problems"] == [] and r["quant"]["kv_cache"] is None
    kinds = {k["kind"]: k for k in r["kinds"]}
    assert {k: (v["scheme"], v["count"]) for k, v in kinds.items()} == {
        "qkv": (scheme, 6), "o": (scheme, 2), "moe_gate_up": (scheme, 16), "moe_down": (scheme, 8)}
    assert all(v["with_input_scale"] == (v["count"] if act == "w4a4" else 0) for v in kinds.values())
    assert r["moe"] == {"hidden": 128, "intermediate": 64, "experts": 4, "top_k": 2}
    assert sorted(map(tuple, r["runtime_shapes"])) == [("o", 128, 128), ("qkv", 256, 128)]
    plan = r["plans"]["sm_120"]
    [linear] = plan["linear"]
    assert (linear["scheme"], linear["route"]) == (scheme, "triton" if act == "w4a4" else "w4a16")
    # decode sizes: a W4A16 kernel on the same weight, any route (the streaming Gluon gemv on sm_120 unless disabled)
    assert linear["rows"][0]["kernel"].startswith("gluon_gemv_stream 32x8, 4 warps (1 over rows), <= 128 registers")
    [moe] = plan["moe"]
    assert moe["scheme"] == scheme
    assert {row["plan"].split()[0] for row in moe["rows"]} == ({"w4a16", "w4a4"} if act == "w4a4" else {"w4a16"})
    # Random per-part magnitudes: most fused groups have globals further apart than the 5% the plugin warns at.
    assert len(r["warn_spreads"]) >= len(r["spreads"]) // 2 > 0
    assert all(s["spread"] > 0.05 for s in r["warn_spreads"])
    # Each expert got its own random input scale: vLLM's one-per-layer maximum rescales the others.
    spreads = {(s["layer"], s["gemm"]) for s in r["moe_input_spreads"]}
    assert spreads == ({(f"model.layers.{i}.mlp.experts", g) for i in (0, 1) for g in ("gate_up", "down")}
                       if act == "w4a4" else set())
    assert all(s["experts"] == 4 and s["spread"] > 0 for s in r["moe_input_spreads"])


def test_inspect_text_report(tiny, capsys):
    code, out, _ = run(capsys, "inspect", str(tiny[("modelopt", "w4a4")]))
    assert code == 0 and problem_lines(out) == []
    assert "modelopt NVFP4, static input scales (W4A4)" in out and "KV cache      not quantized" in out
    assert "differing by more than 5%" in out and "qkv_proj" in out
    assert "MoE static input scales per layer" in out and "model.layers.0.mlp.experts" in out
    assert "plugin  8 NVFP4 W4A4 linears: automatically (route triton)" in out
    assert "kernel plan on sm_120:" in out and "NVFP4 W4A4 linears (route triton):" in out
    assert "w4a4_triton 128x128x128" in out and "NVFP4 W4A4 MoE experts:" in out


def test_inspect_shared_globals_have_no_spread(tiny, capsys):
    code, out, _ = run(capsys, "inspect", str(tiny["shared"]), "--json", "-")
    r = json.loads(out)
    assert code == 0 and r["warn_spreads"] == [] and all(s["spread"] == 0 for s in r["spreads"])


def test_inspect_and_selftest_run_without_vllm(tiny):
    """With vLLM unimportable (the H200 has none), inspect, the demo writer and the format selftest still work."""
    script = f"""
import sys
sys.modules["vllm"] = None  # any `import vllm...` now raises ImportError
from vllm_nvfp4_sm120 import cli
assert cli.main(["inspect", {str(tiny[("modelopt", "w4a4")])!r}]) == 0
assert cli.main(["inspect", "--demo-format", "compressed-tensors"]) == 0
assert cli.main(["selftest", "--only", "format", "--report", "", "--quiet"]) == 0
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vLLM not importable" in done.stdout  # the one format check that needs vLLM says why it skipped


def test_inspect_without_argument_uses_a_demo_checkpoint(capsys):
    code, out, _ = run(capsys, "inspect", "--demo-format", "compressed-tensors", "--w4a16")
    assert code == 0
    assert "tiny compressed-tensors demo" in out and "weight-only (W4A16)" in out


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


# ---- bench ---------------------------------------------------------------------------------------------------------

def test_bench_rejects_bad_arguments(tiny, tmp_path, capsys):
    code, _, err = run(capsys, "bench", "--kernels", "ours,magic")
    assert code == 2 and "magic" in err
    code, _, err = run(capsys, "bench", "--models", "gpt-5")
    assert code == 2 and "gpt-5" in err
    code, _, err = run(capsys, "bench", "--checkpoint", str(tmp_path / "missing"))
    assert code == 2 and "missing" in err


def test_bench_is_the_bench_modules_compare(capsys):
    """One entry point: the CLI's ``bench`` is ``python -m vllm_nvfp4_sm120.bench compare``, same checks."""
    assert bench.main(["compare", "--kernels", "ours,magic"]) == 2
    assert "magic" in capsys.readouterr().err
    args = bench.build_parser().parse_args(["moe"])  # each kernel bench has its own shapes and token counts
    assert args.models == ",".join(bench.MOE_SHAPES) and args.tokens == ",".join(map(str, bench.MOE_TOKENS))
    args = bench.build_parser().parse_args(["linear", "--models", "qwen3-32b"])
    assert args.func is bench.run_kernel_bench and args.models == "qwen3-32b"
    args = bench.build_parser().parse_args(["sweep_act_quant"])  # the activation quant goal's token counts
    assert args.func is bench.run_kernel_bench and args.tokens == "2048,8192"


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU-only message")
def test_bench_needs_a_gpu(tiny, capsys):
    code, _, err = run(capsys, "bench", "--checkpoint", str(tiny[("modelopt", "w4a4")]))
    assert code == 2 and "needs a CUDA GPU" in err


def test_bench_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(bench, "require_matplotlib", lambda: None)
    code, _, err = run(capsys, "bench", "--plot", "x.png")
    assert code == 2 and "pip install matplotlib" in err


def test_bench_table_and_speedups_from_rows():
    rows = [dict(model="m", layer="qkv", n=256, k=128, t=t, kernel=kern, us=us, tflops=0.0, read_tbs=0.0, note="")
            for t, kern, us in [(1, "ours-triton (w4a16_gemv)", 2.0), (1, "vllm-cutlass", 5.0), (1, "vllm-marlin", 4.0),
                                (1, "cublas-bf16", 6.0), (1, "vllm-emulation", 1.0), (64, "ours-triton (w4a4_triton)", 3.0)]]
    result = dict(device="GPU (sm_120)", torch="x", ceilings=dict(dram_read_tbs=1.5, cublas_bf16_tflops_8192=200.0),
                  rows=rows, skipped={"vllm-b12x": "not supported"})
    sp = {s["t"]: s for s in bench.speedups(rows)}
    assert sp[1]["vllm"] == "vllm-marlin" and sp[1]["vs_vllm"] == 2.0 and sp[1]["vs_cublas"] == 3.0  # emulation excluded
    assert sp[64]["vs_vllm"] is None
    table = bench.format_bench_table(result)
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
