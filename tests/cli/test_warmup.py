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
    assert any(line.startswith("linear qkv N=256 K=128: gluon_gemv_stream(") and line.endswith("at T=1")
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


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_work_units_split_the_calls_once_each(tiny, act):
    """The parallel pass's units: one layer each, every (layer, size) call in exactly one unit, and no unit whose
    sizes meet two plans."""
    from vllm_nvfp4_sm120.dispatch.linear import select_linear
    from vllm_nvfp4_sm120.dispatch.moe import select_moe_plan

    case = warmup.case_from_checkpoint(tiny[("modelopt", act)])
    units = warmup.work_units(case, SM120_REFERENCE)
    calls = sorted((str(layer), t) for u in units for layer in u.linears + u.moe for t in u.sizes)
    assert calls == sorted((str(layer), t) for layer in case.linears + case.moe for t in case.sizes)
    assert all(len(u.linears) + len(u.moe) == 1 and u.route == case.linear_route(SM120_REFERENCE) for u in units)
    for u in units:
        if u.linears:
            _, n, k = u.linears[0]
            plans = {select_linear(SM120_REFERENCE, u.route, t, n, k) for t in u.sizes}
        else:
            h, i, e, top_k = u.moe[0]
            plans = {select_moe_plan(SM120_REFERENCE, num_tokens=t, top_k=top_k, global_experts=e, hidden=h,
                                     intermediate=i, w4a4=case.w4a4) for t in u.sizes}
        assert len(plans) == 1
    bins = warmup._bins(units, 3)
    assert len(bins) == 3 and sorted(map(id, (u for b in bins for u in b))) == sorted(map(id, units))


def test_compile_parallel_children_run_their_calls_cpu(tiny):
    # Two child processes run their units through the ops (on CPU: the references) and exit cleanly; a child that
    # fails is reported, not raised.
    case = warmup.case_from_checkpoint(tiny[("modelopt", "w4a4")], sizes=(1, 24, 200))
    r = warmup.compile_parallel(case, SM120_REFERENCE, 2, device="cpu", timeout_s=300)
    assert r["jobs"] == 2 and r["errors"] == []
    bad = warmup.Case(linears=[("qkv", 256, 100)], moe=[], w4a4=True, sizes=(1,))  # K not a multiple of 16
    r = warmup.compile_parallel(bad, SM120_REFERENCE, 2, device="cpu", timeout_s=300)
    assert r["jobs"] == 1 and len(r["errors"]) == 1 and "K = 100" in r["errors"][0][0]


def test_jobs_option():
    from vllm_nvfp4_sm120.cli import build_parser

    assert build_parser().parse_args(["warmup", "--checkpoint", "x", "--jobs", "3"]).jobs == 3
    assert build_parser().parse_args(["warmup", "--checkpoint", "x"]).jobs >= 1
