"""The linear dispatch table: its choices (kernels, tiles, routes), and every Triton W4A4 tile it can return
compiled for sm_120."""

import pytest
import triton

from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.dispatch.linear import (
    DEQUANT_MM_MAX_SCRATCH_BYTES,
    DEQUANT_MM_MIN_T_PORTABLE,
    DEQUANT_MM_MIN_T_SM120,
    DEQUANT_MM_MIN_WAVES,
    STREAM_SMALL_LAYER_BYTES,
    ROUTE_PREFILL,
    ROUTES,
    W4A4_ROUTES,
    LinearKernel,
    LinearPlan,
    Route,
    act_quant_config,
    all_gemv_tiles,
    all_linear_plans,
    backend_name,
    dequant_mm_chunk_n,
    dequant_mm_min_t,
    gluon_gemv_plan,
    gluon_gemv_tile,
    k_tail_stream,
    select_linear,
    small_t_threshold,
    stream_wave_ctas,
    uses_stream,
)
from vllm_nvfp4_sm120.dispatch.hw import Family
from vllm_nvfp4_sm120.dispatch.configs import DERIVED_PARAMS
from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan, wave_ctas
from vllm_nvfp4_sm120.kernels.gluon_gemv_stream import STREAM_TILES, StreamTile
from vllm_nvfp4_sm120.kernels.aot import SASS_OMMA_NVFP4, compile_kernel
from vllm_nvfp4_sm120.kernels.w4a4_gemm import W4A4_DIVISIBLE, W4A4_SIGNATURE

SM120, SM90, SM80 = Capability(120), Capability(90), Capability(80)


@pytest.mark.parametrize("route", ["triton", "cublas", "b12x", "w4a16"])
@pytest.mark.parametrize("gluon", [True, False])
def test_small_batches_go_to_w4a16(route, gluon, monkeypatch):
    if not gluon:
        monkeypatch.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
    limit = small_t_threshold(SM120, route)
    assert limit >= 8
    for t in (1, limit):
        plan = select_linear(SM120, route, t, 5120, 5120)
        assert plan.kernel.startswith("gluon_gemv" if gluon else "w4a16_gemv"), plan
    assert select_linear(SM120, route, limit + 1, 5120, 5120).is_w4a4 == (route != "w4a16")


@pytest.mark.parametrize("cap", [Capability(120, 170), Capability(90, 132), Capability(120, 84)], ids=str)
@pytest.mark.parametrize("t", [1, 2, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(10240, 5120), (8192, 28672), (40, 272)])
def test_decode_sizes_go_to_the_streaming_kernel(cap, t, n, k):
    """T <= 16 on the Gluon GPUs: the streaming kernel with the stream plan's tile and its one-wave grid, except on
    sm_90 for layers under STREAM_SMALL_LAYER_BYTES at T = 1 and T = 9-16 (the per-row Gluon gemv, measured)."""
    plan = select_linear(cap, "w4a16", t, n, k)
    small = cap.major == 9 and n * k * 9 // 16 < STREAM_SMALL_LAYER_BYTES[Family.SM90]
    if small and (t == 1 or t > 8):
        assert plan == gluon_gemv_plan(cap, t, n, k)
        assert plan.kernel == ("gluon_gemv_fma" if t == 1 else "gluon_gemv_mma")
        assert select_linear(cap, "triton", t, n, k) == plan
        return
    want = stream_plan(t, n, k, cap.sm_count, cap.major)
    tile, ctas = want.tile, want.ctas
    if k % 128:  # the K-tail variant: the uncapped 32-row tile (k_tail_stream)
        tile = StreamTile(32, want.tile.block_t)
        ctas = wave_ctas(tile, t, cap.sm_count, cap.major)
    assert plan.kernel == "gluon_gemv_stream"
    assert plan.kwargs == dict(tile.params(), ctas=ctas)
    assert plan.kwargs["block_t"] == (8 if t <= 8 else 16)
    assert StreamTile(**{key: v for key, v in plan.kwargs.items() if key != "ctas"}) in STREAM_TILES
    # the same plan on a W4A4 route's decode rows
    assert select_linear(cap, "triton", t, n, k) == plan


@pytest.mark.parametrize("cap", [Capability(120, 170), Capability(90, 132)], ids=str)
def test_a_k_tail_runs_an_uncapped_stream_tile(cap):
    """K not a multiple of 128: no register cap on the streaming tile, whatever row chose it (a built-in rule or a
    config's capped tile), since the capped tiles' K-tail variants spill; even K keeps the capped plan."""
    for t in (1, 2, 8, 9, 16):
        for k in (2880, 5120 + 64, 8192 + 16):
            plan = select_linear(cap, "w4a16", t, 57344, k)
            assert plan.kernel == "gluon_gemv_stream" and "max_regs" not in plan.kwargs, (t, k, plan)
            tile = StreamTile(**{key: v for key, v in plan.kwargs.items() if key != "ctas"})
            assert tile in STREAM_TILES and tile.block_m == 32 and tile.block_t == (8 if t <= 8 else 16)
            assert plan.kwargs["ctas"] == wave_ctas(tile, t, cap.sm_count, cap.major)
        assert "max_regs" in select_linear(cap, "w4a16", t, 57344, 8192).kwargs
    params = dict(StreamTile(16, 8, max_regs=96).params(), ctas=7)  # a config's capped tile
    capped = LinearPlan(LinearKernel.GLUON_GEMV_STREAM, tuple(sorted(params.items())))
    assert k_tail_stream(capped, cap, 4, 8192) is capped
    assert "max_regs" not in k_tail_stream(capped, cap, 4, 8200).kwargs
    other = select_linear(cap, "w4a16", 64, 57344, 8200)  # not the streaming kernel: unchanged
    assert k_tail_stream(other, cap, 64, 8200) is other


def test_small_layer_rule_matches_the_measured_layers():
    """The H200 rows the rule was read from (device run 47): per-row gemv on Qwen3-32B qkv and o at T = 1 and 16,
    the streaming kernel on the Llama-3.3-70B o (the smallest layer where it won) and on the large layers."""
    h200 = Capability(90, 132)
    for n, k in ((10240, 5120), (5120, 8192)):
        assert [uses_stream(h200, t, n, k) for t in (1, 2, 8, 9, 16)] == [False, True, True, False, False]
    for n, k in ((8192, 8192), (10240, 8192), (51200, 5120), (5120, 25600), (57344, 8192), (8192, 28672)):
        assert all(uses_stream(h200, t, n, k) for t in (1, 2, 8, 9, 16))
    assert not uses_stream(h200, 17, 8192, 8192)
    assert all(uses_stream(SM120, t, 5120, 8192) for t in (1, 9, 16))  # sm_120: unmeasured, streaming everywhere


def test_stream_wave_ctas_is_the_plans_grid():
    for cap in (Capability(120, 170), Capability(90, 132)):
        for t in (1, 8, 16):
            plan = select_linear(cap, "w4a16", t, 8192, 28672)
            assert stream_wave_ctas(cap, plan.kwargs, t) == plan.kwargs["ctas"]


def test_gluon_gemv_only_on_sm120_and_sm90():
    assert select_linear(SM120, "triton", 1, 5120, 5120).kernel == "gluon_gemv_stream"
    assert select_linear(SM90, "triton", 2, 5120, 5120).kernel == "gluon_gemv_stream"
    assert select_linear(SM90, "triton", 1, 5120, 5120).kernel == "gluon_gemv_fma"  # a small layer (14 MB)
    assert select_linear(SM80, "triton", 1, 5120, 5120).kernel == "w4a16_gemv"


def test_gluon_gemv_plan_keeps_the_sm90_t2_rule():
    """The Gluon gemvs (the tools' ``registry.gemv`` and tune's candidates): on sm_90 T = 2 takes the tensor-core
    tile (measured), on sm_120 the CUDA-core one (unmeasured)."""
    assert gluon_gemv_plan(SM90, 2, 5120, 5120).kernel == "gluon_gemv_mma"
    assert gluon_gemv_plan(SM120, 2, 5120, 5120).kernel == "gluon_gemv_fma"


def test_b12x_and_cublas_small_t_thresholds():
    assert small_t_threshold(SM120, "b12x") == 8
    assert small_t_threshold(SM120, "cublas") == 16


def test_vendor_routes_are_sm120_only():
    with pytest.raises(ValueError, match="route 'cublas' has no kernels for compute capability 90"):
        select_linear(SM90, "cublas", 4096, 5120, 5120)
    assert select_linear(SM90, "triton", 4096, 5120, 5120).kernel == "w4a4_triton"


def test_unknown_route():
    with pytest.raises(ValueError, match=r"route: expected one of"):
        select_linear(SM120, "cutlass", 1, 8, 16)


def test_every_route_answers_every_t():
    listed = {(p.kernel, p.params) for p in all_linear_plans()}
    for route in ROUTES:
        for t in (0, 1, 16, 17, 100_000):
            plan = select_linear(SM120, route, t, 5120, 5120)
            # split_k, chunk_n and ctas are derived from the shape and SM count, not listed tile parameters
            assert (plan.kernel, tuple(kv for kv in plan.params if kv[0] not in DERIVED_PARAMS)) in listed


@pytest.mark.parametrize("cc,min_t", [(120, DEQUANT_MM_MIN_T_SM120), (90, DEQUANT_MM_MIN_T_PORTABLE),
                                      (80, DEQUANT_MM_MIN_T_PORTABLE)])
def test_w4a16_prefill_goes_to_dequant_mm(cc, min_t):
    assert dequant_mm_min_t(Capability(cc), "w4a16") == min_t
    assert select_linear(Capability(cc), "w4a16", min_t - 1, 5120, 5120).kernel == "w4a16_gemm"
    for t in (min_t, 2048, 100_000):
        plan = select_linear(Capability(cc, 132), "w4a16", t, 5120, 5120)
        assert plan.kernel == "w4a16_dequant_mm" and plan.kwargs == {"chunk_n": dequant_mm_chunk_n(t, 5120, 5120, 132)}


@pytest.mark.parametrize("route", W4A4_ROUTES)
def test_w4a4_routes_keep_their_prefill(route):
    assert dequant_mm_min_t(SM120, route) is None
    assert select_linear(SM120, route, 4096, 5120, 5120).is_w4a4


@pytest.mark.parametrize("sm_count", [84, 132, 170, 188])
@pytest.mark.parametrize("n", [5120, 8192, 10240, 51200, 57344])
@pytest.mark.parametrize("t", [256, 300, 2048, 8192, 65536])
@pytest.mark.parametrize("k", [5120, 28672])
def test_dequant_mm_chunk_rule(t, n, k, sm_count):
    chunk = dequant_mm_chunk_n(t, n, k, sm_count)
    assert chunk % 128 == 0 and 128 <= chunk <= -(-n // 128) * 128
    capped = chunk * k * 2 > DEQUANT_MM_MAX_SCRATCH_BYTES - 128 * k * 2  # 128 rows more would pass the cap
    assert chunk * k * 2 <= DEQUANT_MM_MAX_SCRATCH_BYTES
    tiles_m = -(-t // 128)
    waves = DEQUANT_MM_MIN_WAVES * sm_count
    if chunk < n and not capped:  # at least the waves of 128 x 128 tiles, and 128 rows fewer would not be
        assert tiles_m * chunk // 128 >= waves
        assert chunk == 128 or tiles_m * (chunk - 128) // 128 < waves


def test_dequant_mm_chunks_shrink_with_t():
    chunks = [dequant_mm_chunk_n(t, 57344, 8192, 132) for t in (256, 512, 1024, 2048, 4096, 8192)]
    assert chunks == sorted(chunks, reverse=True) and chunks[-1] < chunks[0]


def test_one_name_per_route():
    """Every route has its prefill kernel, its backend name, and W4A4-ness from that kernel."""
    assert set(ROUTE_PREFILL) == set(Route) == set(ROUTES)
    assert [backend_name(r) for r in ROUTES] == [f"nvfp4_sm120_{r.value}" for r in Route]
    assert set(W4A4_ROUTES) == {r for r in Route if ROUTE_PREFILL[r].w4a4} == {"triton", "cublas", "b12x"}
    for route in ROUTES:
        last = select_linear(SM120, route, 100_000, 5120, 5120)
        assert last.kernel == ROUTE_PREFILL[route] and last.is_w4a4 == ROUTE_PREFILL[route].w4a4
    assert {k for k in LinearKernel if k.w4a4} == {"w4a4_triton", "w4a4_cublas", "w4a4_b12x"}


# ---- Gluon gemv tiles (kernels/gluon_gemv.py) ---------------------------------------------------------------------
GEMV_SHAPES = [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600), (57344, 8192), (8192, 28672)]


@pytest.mark.parametrize("sm_count", [132, 170, 188])
@pytest.mark.parametrize("t", [0, 1, 2, 3, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("n,k", GEMV_SHAPES + [(40, 272)])
def test_config_returns_listed_tiles(t, n, k, sm_count):
    kind, tile = gluon_gemv_tile(t, n, k, sm_count)
    assert (kind, tile) in all_gemv_tiles()
    assert kind == ("fma" if t <= 2 else "mma")
    if kind == "mma":
        assert tile.block_t >= t and (tile.block_t == 8 or tile.block_t // 2 < t)


def test_config_large_t_is_not_a_gemv():
    assert gluon_gemv_tile(33, 5120, 5120, 170) is None


def test_config_reaches_every_tile():
    seen = {gluon_gemv_tile(t, n, k, sm)
            for t in range(1, 33) for n, k in GEMV_SHAPES + [(64, 64)] for sm in (132, 170)}
    assert set(all_gemv_tiles()) <= seen


# ---- the activation quantizer's tile (kernels/act_quant.py) -------------------------------------------------------
def test_act_quant_config_covers_real_shapes():
    for t in (1, 16, 256, 2048):
        for k in (5120, 8192, 25600, 28672):
            for swizzled in (False, True):
                cfg = act_quant_config(t, k, swizzled)
                assert k % cfg["block_k"] == 0, (t, k, cfg)  # no masked K tail on real shapes
                assert triton.cdiv(k, cfg["block_k"]) >= 5  # K is split even for a single row


W4A4_TILES = sorted({p.params for p in all_linear_plans() if p.kernel == "w4a4_triton"})


@pytest.mark.compile
@pytest.mark.parametrize("params", W4A4_TILES, ids=lambda p: "-".join(f"{k}{v}" for k, v in p))
def test_w4a4_tiles_compile_for_sm120(params):
    tile = dict(params)
    rep = compile_kernel(
        "vllm_nvfp4_sm120.kernels.w4a4_gemm:_w4a4_gemm_kernel", W4A4_SIGNATURE,
        dict(HAS_BIAS=True, DECODE=False, BLOCK_M=tile["block_m"], BLOCK_N=tile["block_n"],
             BLOCK_K=tile["block_k"], GROUP_M=tile["group_m"]),
        divisible=W4A4_DIVISIBLE, num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    )
    rep.require_sass(SASS_OMMA_NVFP4).require_no_local().require_smem()
