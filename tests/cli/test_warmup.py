"""``vllm-nvfp4-sm120 warmup``: the variants a checkpoint's shapes meet (``--dry-run``, CPU) and its errors."""

import pytest
import torch
from cli_common import one_line_error, run_cli

from vllm_nvfp4_sm120 import warmup
from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE


def test_default_sizes_are_vllms_capture_sizes_and_prefill_chunks():
    assert len(warmup.CAPTURE_SIZES) == 51 and warmup.CAPTURE_SIZES[:5] == (1, 2, 4, 8, 16)
    assert warmup.CAPTURE_SIZES[-2:] == (496, 512) and 264 not in warmup.CAPTURE_SIZES and 272 in warmup.CAPTURE_SIZES
    assert len(warmup.DEFAULT_SIZES) == 55 and warmup.DEFAULT_SIZES[-1] == 8192


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_variants_cover_every_size_once_per_shape(tiny, act):
    case = warmup.case_from_checkpoint(tiny[("modelopt", act)])
    assert case.w4a4 is (act == "w4a4") and case.linears and case.moe
    v = warmup.variants(case, SM120_REFERENCE)
    for kind, n, k in case.linears:
        sizes = sorted(t for (kd, nn, kk, _), ts in v.linear.items() if (kd, nn, kk) == (kind, n, k) for t in ts)
        assert sizes == sorted(warmup.DEFAULT_SIZES)
    for shape in case.moe:
        assert sorted(t for (s, _), ts in v.moe.items() if s == shape for t in ts) == sorted(warmup.DEFAULT_SIZES)
    kernels = {plan.kernel for (*_, plan) in v.linear}
    moe_kernels = {plan.kernel for (_, plan) in v.moe}
    if act == "w4a16":
        assert not any(k.startswith("w4a4") for k in kernels) and moe_kernels == {"w4a16"}
    else:
        assert "w4a4_triton" in kernels and "w4a4" in moe_kernels


def test_dry_run_lists_the_variants(capsys, tiny):
    code, out, err = run_cli(capsys, "warmup", "--checkpoint", tiny[("modelopt", "w4a4")], "--dry-run",
                             "--sizes", "1,16,512")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("# ") and "3 batch sizes, route triton" in lines[0]
    assert any(line.startswith("linear qkv N=256 K=128: gluon_gemv_fma(") and line.endswith("at T=1")
               for line in lines)
    assert any(line.startswith("moe H=128 I=64 E=4 top_k=2: w4a16 ") for line in lines)
    assert lines[-1].startswith("# ") and "linear plans" in lines[-1]


def test_missing_checkpoint_is_one_line(capsys, tmp_path):
    one_line_error(*run_cli(capsys, "warmup", "--checkpoint", tmp_path / "nope", "--dry-run"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_compiling_without_gpu_says_so(capsys, tiny):
    code, out, _ = run_cli(capsys, "warmup", "--checkpoint", tiny[("modelopt", "w4a4")], "--sizes", "1")
    assert code == 1 and "needs a CUDA GPU" in out


@pytest.mark.gpu
def test_compiles_on_gpu(capsys, tiny):
    code, out, err = run_cli(capsys, "warmup", "--checkpoint", tiny[("modelopt", "w4a4")], "--sizes", "1,24,200")
    assert code == 0, err
    assert "compiled and ran 9 calls" in out  # 2 linear shapes and 1 MoE layer at 3 sizes


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_exercise_calls_every_layer_at_every_size_cpu(tiny, act):
    """The calls warmup makes pass the ops' checks (on CPU they compute the references)."""
    case = warmup.case_from_checkpoint(tiny[("modelopt", act)], sizes=(1, 24))
    seen = []
    r = warmup.exercise(case, device="cpu", progress=seen.append)
    assert r["calls"] == len(seen) == 2 * (len(case.linears) + len(case.moe))
    assert r["route"] == ("triton" if act == "w4a4" else "w4a16")
