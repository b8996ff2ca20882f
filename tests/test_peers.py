"""Peer adapters (vllm_nvfp4_sm120/peers.py): a clean reason without the peer, what is passed to it, and (where
gemlite's source is importable) what gemlite's own packing and kernel compute from it, in the Triton interpreter."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_nvfp4_sm120 import peers
from vllm_nvfp4_sm120.format import GlobalScale, linear_w4a16_ref, make_linear, pack_e2m1, unit_values, unpack_e2m1


def test_gemlite_absent_gives_a_one_line_reason(gen, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemlite", None)  # import gemlite raises ImportError
    monkeypatch.setitem(sys.modules, "gemlite.helper", None)
    p = make_linear(32, 64, gen=gen)
    reason = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.part_globals[0])
    assert isinstance(reason, str) and reason.startswith("gemlite not importable") and "\n" not in reason


def test_gemlite_refuses_different_part_globals(gen):
    p = make_linear(32, 64, gen=gen, logical_widths=[16, 16])
    assert not torch.equal(p.dec_rows[:1].expand(32), p.dec_rows)
    reason = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.dec_rows)
    assert isinstance(reason, str) and "one global per layer" in reason


@pytest.fixture
def fake_gemlite(monkeypatch):
    """gemlite.helper.A16W4_NVFP as its source defines the interface, recording what it is given."""
    calls = {}

    class A16W4_NVFP:
        def __init__(self, device="cuda:0", dtype=None):
            calls["init"] = (device, dtype)

        def from_packed_weights(self, weight_packed, bias=None, scales=None, meta_scale=None):
            calls["weights"] = (weight_packed, bias, scales, meta_scale)
            return lambda x: ("layer output", x)

    helper = types.ModuleType("gemlite.helper")
    helper.A16W4_NVFP = A16W4_NVFP
    gemlite = types.ModuleType("gemlite")
    gemlite.helper = helper
    monkeypatch.setitem(sys.modules, "gemlite", gemlite)
    monkeypatch.setitem(sys.modules, "gemlite.helper", helper)
    return calls


@pytest.mark.parametrize("per_row", [False, True])
def test_gemlite_gets_our_codes_scales_and_the_encode_global(gen, fake_gemlite, per_row):
    p = make_linear(32, 64, gen=gen)
    bias = torch.randn(32, generator=gen).to(torch.float16)
    gs = p.part_globals[0]
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.dec_rows if per_row else gs, dtype=torch.float16,
                                       bias=bias)
    assert layer("x") == ("layer output", "x")
    assert fake_gemlite["init"] == (p.codes.device, torch.float16)
    codes, b, scales, meta = fake_gemlite["weights"]
    assert codes is p.codes and scales is p.scales and b is bias  # no copy, no repack
    # gemlite dequantizes as W_q * scale / meta_scale: meta_scale is the encode global, and the fp32 value it
    # stores (1 / meta_scale) is our decode global to the bit
    torch.testing.assert_close(meta.float(), gs.enc, rtol=1e-6, atol=0)
    assert (1.0 / meta).to(torch.float32) == gs.dec


def test_gemlite_checks_its_inputs(gen):
    p = make_linear(32, 64, gen=gen)
    with pytest.raises(TypeError, match="codes: expected dtype"):
        peers.gemlite_nvfp4_linear(p.codes.int(), p.scales, p.part_globals[0])
    with pytest.raises(ValueError, match="scales: expected shape"):
        peers.gemlite_nvfp4_linear(p.codes, p.scales[:, :2], p.part_globals[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemlite_split_k_ref_is_the_reference_at_one_split(gen, dtype):
    p = make_linear(48, 256, gen=gen)
    x = torch.randn(5, 256, generator=gen).to(dtype)
    want = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows)
    got = peers.gemlite_split_k_ref(x, p.codes, p.scales, p.dec_rows, split_k=1, block_k=64)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=0)  # one rounding of the same sum
    # more splits: each partial rounded, then each add: close, not equal
    two = peers.gemlite_split_k_ref(x, p.codes, p.scales, p.dec_rows, split_k=2, block_k=64)
    assert not torch.equal(two, want)
    torch.testing.assert_close(two, want, rtol=0, atol=float(want.abs().max()) * 2**-6)


def _one_hot(cols: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the identity: output row j is column ``cols[j]`` of the weight, whatever the kernel's K split
    (every other split sums zeros), rounded once."""
    x = torch.zeros(len(cols), k, dtype=dtype, device=cols.device)
    x[torch.arange(len(cols), device=cols.device), cols] = 1
    return x


# ---- gemlite itself in the Triton interpreter (CPU tensors) ------------------------------------------------------
# gemlite 0.6 queries CUDA when it is imported (device capability and name, SM count, a per-GPU table, Triton's
# active driver); these stand-ins answer as an H200 would so that its source imports and its kernels run in the
# interpreter.  Its NVFP4 layer always runs gemm_splitK_MX_kernel (M < 64); the kernel is pinned to one config
# (the interpreter cannot benchmark), the constexprs as gemlite's config pruner would give them.
_BUNDLE = Path(__file__).resolve().parents[1] / ".carry" / "peers"


class _H200Props:
    name = "NVIDIA H200"
    multi_processor_count = 132
    major, minor = 9, 0


class _H200Driver:
    class utils:  # noqa: N801 - the attribute Triton's drivers have
        @staticmethod
        def get_device_properties(_device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("gemlite's autotuner cannot benchmark in the interpreter: pin one config")


def _e4m3_scaled_operand(original):
    """Triton 3.8's interpreter decodes every ``dot_scaled`` scale as e8m0; the compiled path converts a float-typed
    scale (e4m3, NVFP4's) with fp_to_fp (DecomposeScaledBlocked::scaleTo16).  Decode e4m3 scales as e4m3."""
    import triton.language as tl

    def prepare(value_handle, scale_handle, format_enum, k_pack, is_rhs):
        if scale_handle is None or scale_handle.dtype != tl.float8e4nv:
            return original(value_handle, scale_handle, format_enum, k_pack, is_rhs)
        value = original(value_handle, None, format_enum, k_pack, is_rhs)
        bits = np.ascontiguousarray(scale_handle.data).view(np.uint8)
        scale = torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).float().numpy()
        if is_rhs:  # rhs is [K, N], its scale [N, K / group]
            return value * np.swapaxes(np.repeat(scale, value.shape[-2] // scale.shape[-1], axis=-1), -1, -2)
        return value * np.repeat(scale, value.shape[-1] // scale.shape[-1], axis=-1)

    return prepare


@pytest.fixture
def interpreted_gemlite(monkeypatch):
    """(gemlite.helper, a ``pin(split_k, block_k, block_n)`` for its NVFP4 kernel), in the interpreter; skips
    when there is a GPU (the ``gpu`` test runs it compiled) or gemlite's source is not importable."""
    import os

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test (CPU tensors); on a GPU see test_gpu_gemlite_matches_our_reference")
    import triton
    from triton.runtime import interpreter
    from triton.runtime._allocation import _allocator
    from triton.runtime.driver import driver

    monkeypatch.setattr(driver, "_active", _H200Driver())
    monkeypatch.setattr(interpreter, "_prepare_dot_scaled_operand",
                        _e4m3_scaled_operand(interpreter._prepare_dot_scaled_operand))
    if "gemlite" not in sys.modules:
        if importlib.util.find_spec("gemlite") is None and (_BUNDLE / "gemlite").is_dir():
            monkeypatch.syspath_prepend(str(_BUNDLE))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: _H200Props())
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # no per-GPU tables
        allocator = _allocator.get()
        try:
            importlib.import_module("gemlite")
        except Exception as e:  # not installed, or a version whose import needs more than the stand-ins
            for name in [m for m in sys.modules if m == "gemlite" or m.startswith("gemlite.")]:
                del sys.modules[name]
            pytest.skip(f"gemlite not importable in the interpreter ({type(e).__name__}: {e})")
        finally:
            _allocator.set(allocator)  # gemlite sets a CUDA allocator for TMA descriptors at import
    helper = sys.modules["gemlite.helper"]
    kernel = sys.modules["gemlite.triton_kernels.gemm_splitK_kernels"].gemm_splitK_MX_kernel

    def pin(split_k: int, block_k: int = 64, block_n: int = 64):
        from gemlite.triton_kernels.utils import init_to_zero

        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=8, SPLIT_K=split_k,
                   A_load_order=0, NUM_STAGES=2)
        monkeypatch.setattr(kernel, "configs", [triton.Config(
            cfg, num_warps=4, num_stages=2, pre_hook=init_to_zero("c_ptr") if split_k > 1 else None)])
        monkeypatch.setattr(kernel, "cache", {})

    return helper, pin


def test_interpreted_gemlite_keeps_our_layout(gen, interpreted_gemlite):
    helper, _ = interpreted_gemlite
    p = make_linear(96, 256, gen=gen)
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.part_globals[0], dtype=torch.float16)
    # codes: a [K/2, N] view of ours (no copy); scales: ours, e4m3, as a [N, K/16] view of a K-major copy
    assert layer.W_q.shape == (128, 96) and layer.W_q.data_ptr() == p.codes.data_ptr()
    assert torch.equal(layer.W_q.t(), p.codes)
    assert layer.scales.dtype == torch.float8_e4m3fn and layer.scales.stride() == (1, 96)
    assert torch.equal(layer.scales.view(torch.uint8), p.scales.view(torch.uint8))
    assert float(layer.meta_scale) == float(p.part_globals[0].dec)
    # the unpacked route (one code per byte) packs element 2i into the low nibble of byte i: the same tensors
    unpacked = helper.A16W4_NVFP(device="cpu", dtype=torch.float16).from_weights(
        unpack_e2m1(p.codes), scales=p.scales, meta_scale=1.0 / p.part_globals[0].dec.double())
    assert torch.equal(unpacked.W_q, layer.W_q) and unpacked.W_q.stride() == layer.W_q.stride()
    assert torch.equal(unpacked.scales.view(torch.uint8), layer.scales.view(torch.uint8))
    assert torch.equal(pack_e2m1(unpack_e2m1(p.codes)), p.codes)


@pytest.mark.parametrize("n,k", [(64, 128), (96, 256)])  # 96: a partial N tile
@pytest.mark.parametrize("t", [1, 16])
def test_interpreted_gemlite_matches_our_reference(gen, interpreted_gemlite, n, k, t):
    _, pin = interpreted_gemlite
    p = make_linear(n, k, gen=gen)
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.part_globals[0], dtype=torch.float16)
    x = torch.randn(t, k, generator=gen).to(torch.float16)
    pin(split_k=1)
    # one rounding of the same fp32 sum: equal up to summation order (1 fp16 ulp); a layout error is O(1)
    torch.testing.assert_close(layer(x), linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows), rtol=2**-10,
                               atol=2**-20)
    pin(split_k=2)  # K blocks of 64 split over two programs, each partial rounded to fp16 and atomically added
    torch.testing.assert_close(
        layer(x), peers.gemlite_split_k_ref(x, p.codes, p.scales, p.dec_rows, split_k=2, block_k=64),
        rtol=2**-10, atol=2**-20)


@pytest.mark.parametrize("split_k", [1, 2])
def test_interpreted_gemlite_gives_each_column_of_our_weight(gen, interpreted_gemlite, split_k):
    _, pin = interpreted_gemlite
    n, k = 96, 256
    p = make_linear(n, k, gen=gen)
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, p.part_globals[0], dtype=torch.float16)
    w = (unit_values(p.codes, p.scales) * p.part_globals[0].dec).to(torch.float16)
    pin(split_k=split_k)
    cols = torch.randperm(k, generator=gen)[:32]
    for chunk in cols.split(16):
        assert torch.equal(layer(_one_hot(chunk, k, torch.float16)), w[:, chunk].t())


@pytest.mark.gpu
def test_gpu_gemlite_matches_our_reference(gen):
    p = make_linear(256, 1024, gen=gen).to("cuda")
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, GlobalScale.from_decode(p.part_globals[0].dec),
                                       dtype=torch.bfloat16)
    if isinstance(layer, str):
        pytest.skip(layer)
    # the weight: each column exact, whatever split gemlite's autotuner picks
    w = (unit_values(p.codes, p.scales) * p.part_globals[0].dec).to(torch.bfloat16)
    cols = torch.randperm(1024, generator=gen)[:64].cuda()
    for chunk in cols.split(16):
        assert torch.equal(layer(_one_hot(chunk, 1024, torch.bfloat16)), w[:, chunk].t())
    # the product: gemlite's split-K arithmetic (the atomic adds' order aside) with the config it chose
    x = torch.randn(3, 1024, generator=gen).to(torch.bfloat16).cuda()
    got = layer(x)
    cfg = sys.modules["gemlite.triton_kernels.gemm_splitK_kernels"].gemm_splitK_MX_kernel.best_config.kwargs
    want = peers.gemlite_split_k_ref(x, p.codes, p.scales, p.dec_rows, split_k=cfg["SPLIT_K"],
                                     block_k=cfg["BLOCK_SIZE_K"])
    # (an output near zero may still move by a bf16 step of the partials: their fp32 order is not the model's)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=float(want.abs().max()) * (cfg["SPLIT_K"] + 1) * 2**-8)


# ---- the benchmark's use of gemlite: import, check against our reference ---------------------------------------
def test_gemlite_factory_without_gemlite_gives_a_one_line_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemlite", None)
    monkeypatch.setitem(sys.modules, "gemlite.helper", None)
    build, reason = peers.gemlite_factory()
    assert build is None and reason.startswith("gemlite not importable") and "\n" not in reason


def test_gemlite_factory_takes_a_known_autotune_only(fake_gemlite_kernel):
    assert peers.gemlite_factory("fast") == (peers.gemlite_nvfp4_linear, None)
    with pytest.raises(ValueError, match="autotune: expected one of"):
        peers.gemlite_factory("fastest")


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_gemlite_takes_its_split_k_output(gen, fake_gemlite_kernel, split_k, dtype):
    fake_gemlite_kernel["split_k"] = split_k
    p = make_linear(96, 1024, gen=gen)
    gs = p.part_globals[0]
    dec = gs.dec.expand(96).contiguous()
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, dec, dtype=dtype)
    x = torch.randn(3, 1024, generator=gen).to(dtype)
    want = linear_w4a16_ref(x, p.codes, p.scales, dec)
    assert peers.check_gemlite(layer(x), want) == (f"gemlite (split {split_k})", None)


def test_check_gemlite_refuses_a_wrong_weight_or_shape(gen, fake_gemlite_kernel):
    p = make_linear(96, 1024, gen=gen)
    dec = p.part_globals[0].dec.expand(96).contiguous()
    layer = peers.gemlite_nvfp4_linear(p.codes, p.scales, dec)
    x = torch.randn(3, 1024, generator=gen).to(torch.bfloat16)
    # the layout bug the check is for: the two elements of every byte swapped (errors of the outputs' own size; an
    # error in a single weight is below the allowance, which only separates a wrong mapping from split-K rounding)
    wrong = (p.codes >> 4) | (p.codes << 4)
    fake_gemlite_kernel["output"] = lambda x, codes, scales, d: peers.gemlite_split_k_ref(
        x, wrong, scales, d, split_k=2, block_k=64)
    want = linear_w4a16_ref(x, p.codes, p.scales, dec)
    label, why = peers.check_gemlite(layer(x), want)
    assert label == "gemlite (split 2)" and "beyond its split-K allowance" in why and "\n" not in why
    fake_gemlite_kernel["output"] = lambda x, codes, scales, d: torch.zeros(3, 95, dtype=x.dtype)
    assert "expected [3, 96]" in peers.check_gemlite(layer(x), want)[1]


def test_gemlite_allowance_is_split_k_plus_one_bf16_steps_of_the_largest_output():
    want = torch.tensor([[0.5, -3.0], [1.0, 2.0]], dtype=torch.bfloat16)
    assert peers.gemlite_allowance(want, 2) == 3 * 3.0 * 2.0**-8


def test_gemlite_copies_builds_the_rest_only_after_the_first():
    calls = []

    def build(codes, scales, gs, *, dtype):
        calls.append(codes)
        return "no NVFP4 layer here" if codes == "bad" else (codes, scales, gs, dtype)

    layers = peers.gemlite_copies(build, [("a", 1), ("b", 2), ("c", 3)], 0.5, dtype=torch.bfloat16)
    assert layers == [(c, s, 0.5, torch.bfloat16) for c, s in (("a", 1), ("b", 2), ("c", 3))]
    calls.clear()
    assert peers.gemlite_copies(build, [("bad", 1), ("b", 2)], 0.5, dtype=torch.bfloat16) == "no NVFP4 layer here"
    assert calls == ["bad"]  # the reason comes from the first copy; no other copy is built
