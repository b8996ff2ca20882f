"""``vllm-nvfp4-sm120 tune`` on CPU: what it would time (points, candidates), how winners become config rows, the
files it writes being what the dispatch then uses, and its refusal without a GPU.  The timing itself runs on a GPU
(``gpu`` test at the end)."""

import json

import pytest
import torch
from cli_common import one_line_error
from cli_common import run_cli as run

from vllm_nvfp4_sm120 import tune
from vllm_nvfp4_sm120.dispatch import configs
from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.dispatch.linear import DEQUANT_MM_MIN_T_PORTABLE, select_linear, table_linear
from vllm_nvfp4_sm120.dispatch.moe import decode_tier_plan, select_moe_plan, table_moe_plan

NO_GPU = not torch.cuda.is_available()
DEVICE = "NVIDIA Test GPU"
H200 = Capability(90, 132, DEVICE)
RTX = Capability(120, 170, DEVICE)
N, K = 10240, 5120


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(configs.ENV_CONFIG_DIR, str(tmp_path))
    configs.clear_cache()
    yield tmp_path
    configs.clear_cache()


def by_t(points):
    return {p.t: p for p in points}


# ---- points and candidates -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cap", [H200, RTX, Capability(80, 84, DEVICE)], ids=["sm90", "sm120", "sm80"])
@pytest.mark.parametrize("route", ["w4a16", "triton"])
def test_points_cover_both_sides_of_every_builtin_switch(cap, route):
    points = tune.linear_points(cap, route, N, K)
    segs = tune.segments(lambda t: tune.linear_choice(table_linear(cap, route, t, N, K)), tune.T_MAX)
    ts = {p.t for p in points}
    assert len(segs) > 2
    for first, _, _ in segs[1:]:
        assert {first - 1, first} <= ts
        below, at = by_t(points)[first - 1], by_t(points)[first]
        # Both sides are timed with both kernels: the built-in kernel of each side is a candidate on the other (its
        # tile may differ: the CUDA-core gemv's token block is T, so it is timed at T <= 2 only).
        for p in (below, at):
            kernels = {c.choice["kernel"] for c in p.candidates}
            wanted = {below.builtin["kernel"], at.builtin["kernel"]} - ({"gluon_gemv_fma"} if p.t > 2 else set())
            assert wanted <= kernels, (p.t, kernels)
    assert set(tune.GRID) <= ts
    for p in points:
        assert p.builtin == tune.linear_choice(table_linear(cap, route, p.t, N, K))
        assert any(c.choice == p.builtin for c in p.candidates)
        for c in p.candidates:  # every candidate is a row a config file may hold, and its plan is complete
            assert c.choice["tile"] in configs.linear_tiles(cap.family, c.choice["kernel"])
            assert c.choice["kernel"] in configs.route_kernels(route)
            assert (configs.kernel_max_t(c.choice["kernel"]) or p.t) >= p.t
            assert c.plan == configs.linear_plan_at(cap, c.choice["kernel"], c.choice["tile"], p.t, N, K)


def test_decode_points_time_gluon_and_triton():
    points = by_t(tune.linear_points(H200, "w4a16", N, K))
    kernels = lambda t: {c.choice["kernel"] for c in points[t].candidates}  # noqa: E731
    stream = "gluon_gemv_stream"
    assert kernels(1) == kernels(2) == {"w4a16_gemv", "gluon_gemv_fma", "gluon_gemv_mma", stream}
    assert kernels(4) == {"w4a16_gemv", "gluon_gemv_mma", stream}
    assert kernels(16) == {"w4a16_gemv", "gluon_gemv_mma", stream, "w4a16_gemm"}
    # decode kernels: timed up to T = 32 (the streaming kernel's 16-token tiles twice)
    assert kernels(17) == {"w4a16_gemm", "w4a16_gemv", "gluon_gemv_mma", stream}
    assert {c.choice["tile"]["block_t"] for c in points[17].candidates if c.choice["kernel"] == stream} == {8, 16}
    assert kernels(64) == {"w4a16_gemm"}
    # The CUDA-core gemv with T tokens per CTA; the tensor-core gemv up to the token block that covers T.
    assert {c.choice["tile"]["block_t"] for c in points[2].candidates if c.choice["kernel"] == "gluon_gemv_fma"} == {2}
    for kernel in ("gluon_gemv_mma", stream):
        assert {c.choice["tile"]["block_t"] for c in points[9].candidates if c.choice["kernel"] == kernel} == {8, 16}
    assert {c.choice["tile"]["block_t"] for c in points[8].candidates if c.choice["kernel"] == stream} == {8}
    prefill = {c.choice["kernel"] for c in points[DEQUANT_MM_MIN_T_PORTABLE].candidates}
    assert prefill == {"w4a16_gemm", "w4a16_dequant_mm"}


def test_no_gluon_candidates_where_the_dispatch_has_none(monkeypatch):
    for cap in (Capability(80, 84, DEVICE), H200):
        if cap is H200:
            monkeypatch.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
        for p in tune.linear_points(cap, "w4a16", N, K):
            assert not any(c.choice["kernel"].startswith("gluon") for c in p.candidates), (cap, p.t)


def test_requested_tokens_are_the_only_points():
    points = tune.linear_points(H200, "w4a16", N, K, tokens=[160, 2, 159, 2])
    assert [p.t for p in points] == [2, 159, 160] and {p.why for p in points} == {"requested"}
    assert [p.builtin["kernel"] for p in points] == ["gluon_gemv_stream", "w4a16_gemm", "w4a16_dequant_mm"]


def test_moe_points_around_the_w4a4_switch_and_gluon_tiers():
    shape = dict(global_experts=128, top_k=8, hidden=2048, intermediate=768)
    points = by_t(tune.moe_points(RTX, w4a4=True, **shape))
    assert points[63].builtin["kernel"] == "w4a16" and points[64].builtin["kernel"] == "w4a4"  # m = T / 16 >= 4
    for t in (63, 64):
        assert {(c.choice["kernel"], c.choice["block_m"]) for c in points[t].candidates} >= {("w4a16", 16),
                                                                                                ("w4a4", 16)}
    assert {c.choice["impl"] for c in points[1024].candidates} == {"triton", "gluon"}
    w4a16 = tune.moe_points(RTX, w4a4=False, **shape)
    assert {c.choice["kernel"] for p in w4a16 for c in p.candidates} == {"w4a16"}
    for p in w4a16:
        assert p.builtin == tune.moe_choice(table_moe_plan(RTX, num_tokens=p.t, w4a4=False, **shape))
        assert any(c.choice == p.builtin for c in p.candidates) and all(c.plan is not None for c in p.candidates)


def test_moe_points_time_the_decode_plan_against_the_tiers():
    shape = dict(global_experts=256, top_k=8, hidden=2048, intermediate=768)  # 2 routes per expert at T = 64
    points = by_t(tune.moe_points(H200, w4a4=True, **shape))
    decode = {"kernel": "w4a16", "impl": "decode", "block_m": 0}
    assert points[64].builtin == decode and points[65].builtin["impl"] == "triton"  # the table's switch, both sides
    for t in (1, 16, 64, 65):
        cands = {c.label: c for c in points[t].candidates}
        assert {"w4a16/decode/bm0", "w4a16/triton/bm16"} <= set(cands)
        # The decode candidate runs the decode plan's tiles at the point's T.
        assert cands["w4a16/decode/bm0"].plan == decode_tier_plan(H200, t, hidden=2048, intermediate=768)
    assert all(c.choice["impl"] != "decode" for c in points[1024].candidates)


# ---- winners and rows ----------------------------------------------------------------------------------------------

def _point(t, choices, builtin=0, segment=0):
    cands = [tune.Candidate({"kernel": "w4a16_dequant_mm", "tile": {"x": i}} if isinstance(c, int) else c, None)
             for i, c in enumerate(choices)]
    return tune.Point("linear_w4a16", (N, K), "", t, cands[builtin].choice, cands, "", segment)


def test_pick_winner_keeps_the_builtin_within_min_gain():
    p = _point(4, [0, 1, 2])
    a, b, c = (x.label for x in p.candidates)
    assert tune.pick_winner(p, {a: 10.0, b: 9.8, c: 11.0})[0] is p.candidates[0]  # 2 % faster: noise
    winner, verdict = tune.pick_winner(p, {a: 10.0, b: 9.0})
    assert winner is p.candidates[1] and verdict.startswith("moved: 1.11x")
    assert tune.pick_winner(p, {a: 10.0, b: 9.0}, min_gain=0.2)[0] is p.candidates[0]
    assert tune.pick_winner(p, {a: 9.0, b: 10.0})[1] == "built-in is fastest"
    assert tune.pick_winner(p, {b: 12.0, c: 11.0}) == (p.candidates[2], "built-in choice did not run: fastest taken")
    assert tune.pick_winner(p, {}) == (None, "no candidate ran")


def _outcome(p, winner_index):
    o = tune.Outcome(p, us={c.label: 1.0 + i for i, c in enumerate(p.candidates)})
    o.winner = p.candidates[winner_index]
    return o


def test_rows_merge_only_neighbours_or_one_segment():
    w0, w1 = 0, 1
    outcomes = [_outcome(_point(1, [0, 1], segment=0), w0), _outcome(_point(2, [0, 1], segment=1), w0),
                _outcome(_point(4, [0, 1], segment=1), w0), _outcome(_point(8, [0, 1], segment=1), w1),
                _outcome(_point(16, [0, 1], segment=2), w1), _outcome(_point(32, [0, 1], segment=3), w1)]
    rows = tune.compose_rows(outcomes)
    # 1-2: neighbours; 2-4: one segment; 4 | 8 differ: the gap stays built-in; 8 | 16: other segments, not neighbours.
    assert [(r["min_t"], r["max_t"], r["tile"]["x"]) for r in rows] == [(1, 4, 0), (8, 8, 1), (16, 16, 1), (32, 32, 1)]
    assert rows[0]["why"] == "T = 1; T = 2; T = 4" and "T=4 w4a16_dequant_mm x=0" in rows[0]["us"]
    assert tune.compose_rows([tune.Outcome(_point(1, [0]))]) == []  # no winner, no row


# ---- the files it writes are what the dispatch uses ----------------------------------------------------------------

def _fake_run(points, faster: dict[int, str]):
    """Outcomes as if timed: the built-in choice everywhere, except candidate ``faster[t]`` (a label) 2x faster."""
    outcomes = []
    for p in points:
        us = {c.label: 10.0 for c in p.candidates}
        if p.t in faster:
            us[faster[p.t]] = 5.0
        o = tune.Outcome(p, us=us)
        o.winner, o.verdict = tune.pick_winner(p, us)
        outcomes.append(o)
    return outcomes


def test_written_files_drive_the_dispatch(user_dir):
    points = tune.linear_points(H200, "w4a16", N, K, tokens=[1, 2, 8, 159, 160])
    moved = {2: "gluon_gemv_mma t8 w8", 159: "w4a16_dequant_mm"}
    outcomes = _fake_run(points, moved)
    moe_points = tune.moe_points(H200, global_experts=128, top_k=8, hidden=2048, intermediate=768, w4a4=False,
                                 tokens=[16, 1024])
    outcomes += _fake_run(moe_points, {1024: "w4a16/triton/bm128"})
    written = tune.write_configs(user_dir, H200, outcomes, {"date": "now"})
    assert sorted(p.name for p in written) == ["device_name=NVIDIA_Test_GPU,family=linear_w4a16.json",
                                               "device_name=NVIDIA_Test_GPU,family=moe_w4a16.json"]
    for path in written:
        assert tune.dispatch_check(path, H200, outcomes) == []
    data = json.loads(written[0].read_text())
    assert data["package_version"] and data["cc"] == 90 and data["measured"] == {"date": "now"}
    configs.clear_cache()
    for o in outcomes[:5]:
        assert select_linear(H200, "w4a16", o.point.t, N, K) == o.winner.plan
    assert select_linear(H200, "w4a16", 2, N, K).kwargs["num_warps"] == 8  # moved
    assert select_linear(H200, "w4a16", 159, N, K).kernel == "w4a16_dequant_mm"  # the switch moved down by one
    for t in (3, 100, 161):  # not measured: the table
        assert select_linear(H200, "w4a16", t, N, K) == table_linear(H200, "w4a16", t, N, K)
    shape = dict(top_k=8, global_experts=128, hidden=2048, intermediate=768, w4a4=False)
    assert select_moe_plan(H200, num_tokens=1024, **shape).block_m == 128
    assert table_moe_plan(H200, num_tokens=1024, **shape).block_m != 128
    # A second run on other shapes keeps this one's buckets.
    more = _fake_run(tune.linear_points(H200, "w4a16", 8192, 8192, tokens=[4]), {})
    tune.write_configs(user_dir, H200, more, {"date": "later"})
    buckets = json.loads(written[0].read_text())["buckets"]
    assert set(buckets) == {f"N={N},K={K}", "N=8192,K=8192"}


def test_summary_names_kept_and_moved_switches():
    points = tune.linear_points(H200, "w4a16", N, K, tokens=[1, 2, 159, 160])
    outcomes = _fake_run(points, {160: "w4a16_gemm k64 m128 n256 g8 s4 w8 swap1"})
    text = tune.format_summary(outcomes, "# header")
    assert "built-in switch at T = 2 (gluon_gemv_fma t1 w4 r2 -> gluon_gemv_stream m32 t8 regs128 w4 rw1): kept" in text
    assert "built-in switch at T = 160" in text and "not kept (T = 159: w4a16_gemm" in text
    assert "moved: 2.00x faster than built-in" in text


# ---- the command ---------------------------------------------------------------------------------------------------

def test_list_shows_the_plan_without_a_gpu(capsys):
    code, out, _ = run(capsys, "tune", "--shapes", "10240x5120", "--tokens", "2,159,160", "--list", "--cc", "90",
                       "--sm-count", "132")
    assert code == 0
    if NO_GPU:
        assert out.startswith("# no GPU (sm_90, 132 SMs)")
    assert "T=159" in out and "w4a16_dequant_mm" in out and out.strip().endswith("3 points, 24 candidate runs")


def test_tune_plan_from_a_checkpoint(tiny, capsys):
    code, out, _ = run(capsys, "tune", "--checkpoint", tiny[("modelopt", "w4a4")], "--list", "--tokens", "4",
                       "--moe-tokens", "4", "--tp", "2")
    assert code == 0
    assert "linear_triton" in out and "N=128,K=128" in out and "N=128,K=64" in out  # qkv N / 2, o K / 2
    assert "moe_w4a4" in out and "E=4,top_k=2,H=128,I=32" in out
    code, out, _ = run(capsys, "tune", "--checkpoint", tiny[("modelopt", "w4a16")], "--list", "--tokens", "4")
    assert "linear_w4a16" in out and "linear_triton" not in out and "moe_w4a16" in out


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "10240by5120"], "--shapes: expected NxK"),
    (["--shapes", "64x40"], "K a multiple of 16"),
    (["--routes", "cublas"], "cannot be tuned"),
    (["--models", "gpt-9"], "--models: unknown 'gpt-9'"),
    (["--tokens", "0,4"], "--tokens: expected positive integers"),
    (["--moe-models", "mixtral"], "--moe-models: unknown"),
])
def test_bad_arguments_are_one_line(capsys, argv, message):
    line = one_line_error(*run(capsys, "tune", *argv))
    assert message in line


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU-only message")
def test_tune_refuses_without_a_gpu(capsys, tmp_path):
    line = one_line_error(*run(capsys, "tune", "--shapes", "256x128", "--out", tmp_path))
    assert "tune needs a CUDA GPU" in line and list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_tune_on_the_gpu_writes_what_the_dispatch_uses(capsys, user_dir):
    code, out, err = run(capsys, "tune", "--shapes", "2048x1024", "--tokens", "2,17", "--out", user_dir,
                         "--min-bytes", "1e8", "--repeats", "5")
    assert code == 0, out + err
    assert "DISPATCH CHECK FAILED" not in out and "written:" in out
    configs.clear_cache()
    from vllm_nvfp4_sm120.dispatch.hw import capability_of

    cap = capability_of(torch.device("cuda"))
    [path] = user_dir.glob("device_name=*,family=linear_w4a16.json")
    cf = configs.load_file(path)
    assert cf.error is None
    for t in (2, 17):
        row = cf.rows((2048, 1024), t)
        assert row is not None and select_linear(cap, "w4a16", t, 2048, 1024) == row.plan(cap, t, 2048, 1024)


# ---- the timing layer's plumbing, on CPU (kernels and timer faked at their boundaries) -----------------------------

class _Bar:
    def set_postfix_str(self, s):
        pass

    def update(self, k=1):
        pass


@pytest.fixture
def fake_kernels(monkeypatch):
    """Every linear kernel replaced by the reference at the registry, at a cost in microseconds per call that
    ``bench.time_graph`` reports: ``costs[kernel]`` (a number or a function of T; default 5), the 128 x 128 GEMM tile
    raising, the 128 x 256 one computing garbage."""
    from vllm_nvfp4_sm120 import bench
    from vllm_nvfp4_sm120.dispatch import registry
    from vllm_nvfp4_sm120.format import linear_w4a16_ref

    costs, spent = {}, []

    def fake(kernel):
        def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
            if tile.get("block_n") == 128 and tile.get("block_m") == 128:
                raise RuntimeError("out of resources: shared memory\nsecond line")
            cost = costs.get(kernel, 5.0)
            spent.append(cost(x.shape[0]) if callable(cost) else cost)
            ref = linear_w4a16_ref(x, w_codes, w_scales, w_dec_rows)
            return ref * 1.5 if tile.get("block_n") == 256 else ref
        return run

    for kernel in list(registry.LINEAR_KERNELS):
        monkeypatch.setitem(registry.LINEAR_KERNELS, kernel, fake(kernel))

    def time_graph(fn, repeats):
        spent.clear()
        fn()
        return sum(spent) * 1e-6  # seconds of one run of all copies

    monkeypatch.setattr(bench, "time_graph", time_graph)
    return costs


def test_time_linear_checks_then_times_each_candidate(fake_kernels):
    fake_kernels.update(w4a16_gemm=2.0, w4a16_dequant_mm=1.0)
    points = tune.linear_points(H200, "w4a16", 64, 128, tokens=[160])
    min_bytes = 3 * (64 * 128 // 2 + 64 * 128 // 16)  # three weight copies per timed run
    [o] = tune.time_linear(points, min_bytes=min_bytes, repeats=3, min_gain=0.03, bar=_Bar(), device="cpu")
    assert o.us == {"w4a16_gemm k128 m64 n64 g8 s3 w4 swap0": pytest.approx(2.0),
                    "w4a16_dequant_mm": pytest.approx(1.0)}  # per call: the run's time over its three calls
    assert o.failed["w4a16_gemm k128 m128 n128 g8 s3 w8 swap0"] == "RuntimeError: out of resources: shared memory"
    assert o.failed["w4a16_gemm k64 m128 n256 g8 s4 w8 swap1"].startswith("wrong result (relative error 0.5")
    assert o.winner.choice == {"kernel": "w4a16_dequant_mm", "tile": {}} and o.verdict == "built-in is fastest"


def test_the_tune_command_writes_what_the_dispatch_reads(fake_kernels, monkeypatch, capsys, user_dir):
    """The whole command on a GPU faked at torch's boundary: summary, files, the dispatch check, JSON."""
    from vllm_nvfp4_sm120.dispatch import hw

    # T = 2: the CUDA-core gemv 3 us against 5 us; T = 159 / 160: the GEMM faster below 160, dequant + cuBLAS from it.
    fake_kernels.update(gluon_gemv_fma=3.0, w4a16_gemm=lambda t: 3.0 if t < 160 else 5.0, w4a16_dequant_mm=4.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hw, "capability_of", lambda device: H200)
    time_linear = tune.time_linear
    monkeypatch.setattr(tune, "time_linear", lambda points, **kw: time_linear(points, device="cpu", **kw))
    code, out, err = run(capsys, "tune", "--shapes", "64x128", "--tokens", "2,159,160", "--out", user_dir,
                         "--min-bytes", "1", "--repeats", "1", "--json", user_dir / "tune.json")
    assert code == 0, out + err
    assert "DISPATCH CHECK FAILED" not in out
    path = user_dir / "device_name=NVIDIA_Test_GPU,family=linear_w4a16.json"
    assert f"written: {path}" in out
    assert "moved: 1.67x faster than built-in" in out
    assert "built-in switch at T = 160 (w4a16_gemm k128 m64 n64 g8 s3 w4 swap0 -> w4a16_dequant_mm): kept" in out
    configs.clear_cache()
    assert select_linear(H200, "w4a16", 2, 64, 128).kernel == "gluon_gemv_fma"
    assert table_linear(H200, "w4a16", 2, 64, 128).kernel == "gluon_gemv_stream"
    assert select_linear(H200, "w4a16", 159, 64, 128).kernel == "w4a16_gemm"
    assert select_linear(H200, "w4a16", 160, 64, 128).kernel == "w4a16_dequant_mm"
    report = json.loads((user_dir / "tune.json").read_text())
    assert [o["t"] for o in report["outcomes"]] == [2, 159, 160] and report["written"] == [str(path)]


def test_time_moe_passes_the_scales_of_a_w4a4_layer(monkeypatch):
    from vllm_nvfp4_sm120.dispatch import moe_flow
    from vllm_nvfp4_sm120.format import GlobalScale, NvFp4, moe_ref

    seen = []

    def fake_moe(x, w13c, w13s, d13, w2c, w2s, d2, tw, ti, *, plan, a13_enc=None, a2_enc=None):
        seen.append((plan.kernel, a13_enc is not None))
        gs = (GlobalScale.from_encode(a13_enc), GlobalScale.from_encode(a2_enc)) if plan.kernel == "w4a4" else (None,
                                                                                                               None)
        return moe_ref(x, NvFp4(w13c, w13s), d13, NvFp4(w2c, w2s), d2, tw, ti, a13_gs=gs[0], a2_gs=gs[1])

    monkeypatch.setattr(moe_flow, "nvfp4_moe", fake_moe)
    monkeypatch.setattr(tune, "_rel_err", lambda out, ref: 0.0 if torch.equal(out, ref) else 1.0)
    from vllm_nvfp4_sm120 import bench

    monkeypatch.setattr(bench, "time_graph", lambda fn, repeats: 1e-6)
    shape = dict(global_experts=4, top_k=2, hidden=128, intermediate=64)
    points = tune.moe_points(RTX, w4a4=True, tokens=[8], **shape) + tune.moe_points(RTX, w4a4=False, tokens=[8],
                                                                                    **shape)
    outcomes = tune.time_moe(points, repeats=1, min_gain=0.03, bar=_Bar(), device="cpu")
    assert all(not o.failed and o.winner is not None for o in outcomes), [o.failed for o in outcomes]
    assert ("w4a4", True) in seen and ("w4a16", True) in seen and ("w4a16", False) in seen
    assert ("w4a4", False) not in seen
