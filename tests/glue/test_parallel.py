"""Tensor and expert parallel: vLLM's parallel layers with our kernels on 2 and 4 CPU ranks (gloo) vs one rank.

Every rank builds the layer with vLLM's own class under a faked sm_120 (so vLLM's NVFP4 schemes pick our kernels),
loads the one full checkpoint through the layer's weight loaders (the rank's shard: N of column-parallel layers,
K of row-parallel layers, I or the experts of a MoE layer), lets vLLM process it and runs the forward; vLLM's
collectives gather or all-reduce the ranks' outputs.  The result must equal what one rank computes from the same
checkpoint on the same inputs (``parallel_layers.task_forward`` in this process, with its one-process group).  On
CPU tensors our ops compute the torch reference of the plan an sm_120 GPU would run, so these are the kernels'
numerics: T = 3 runs the W4A16 (decode) plans, T = 40 the W4A4 plans of W4A4 checkpoints (asserted per rank).

Tolerances (``u`` = 2^-8, bf16's unit roundoff): with the same plan on every rank, the sharded result differs from
the one-rank result only by where fp32 sums are split and rounded to bf16:

* column-parallel outputs (qkv, gate_up) are, element by element, the same dot product over the whole K on both
  sides; only the CPU matmul's fp32 accumulation order may differ (the shard has fewer columns), which moves the
  bf16 result by at most one ulp: ``rtol = 2u`` (one ulp is at most ``2u |y|``).  Measured here: bit-exact;
* row-parallel and MoE outputs are sums of per-rank partials.  Each rank's op rounds its fp32 partial to bf16
  (``b_r``, error <= ``u |b_r|``), the all-reduce adds TP bf16 values with TP - 1 roundings (each <= ``u sum |b_r|``)
  and one rank rounds its fp32 total once (<= ``u |y|``): elementwise ``|got - ref| <= u (TP sum_r |b_r| + |ref|)``,
  times 17/16 for the second-order terms (<= TP u, under 1/64).  The fp32 sums themselves differ only in order
  (relative ~K 2^-24), far below.

A sharding bug moves outputs by whole weight rows or by a different activation scale, tens of percent of the
output: far outside both bounds.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import parallel_layers as PL
from parallel_harness import Ranks
from parallel_layers import Case
from vllm_nvfp4_sm120.tiny_checkpoint import TinyShape

pytestmark = pytest.mark.usefixtures("registered", "tp_group")

BF16_U = 2.0**-8
TS = (3, 40)  # decode-sized (W4A16 plans) and prefill-sized (W4A4 plans of W4A4 checkpoints)

# Per TP size, shapes that make each rank's share what the cases need (one full checkpoint per (format, act)):
#   qkv: K = 80 (5 scale blocks), fewer KV heads than ranks (KV heads replicated 2x);
#   o:   K = heads * head_dim split in 48 per rank (16 x 3: an odd number of NVFP4 blocks);
#   gate_up / down and the MoE: I split in 48 per rank (16 x 3, not a multiple of 64); 8 experts (EP: 4 or 2 per
#   rank).
SHAPES = {
    2: TinyShape(layers=1, hidden=80, heads=4, kv_heads=1, head_dim=24, experts=8, top_k=2, moe_intermediate=96),
    4: TinyShape(layers=1, hidden=80, heads=4, kv_heads=2, head_dim=48, experts=8, top_k=2, moe_intermediate=192),
}
PER_RANK = 48  # K of o / down and I of the MoE on each rank, at both TP sizes

FORMATS_ACTS = [("modelopt", "w4a4"), ("ct", "w4a4"), ("modelopt", "w4a16"), ("ct", "w4a16")]
# W4A16 checkpoints reach our kernels by name only (vLLM sends them to Marlin otherwise).
W4A16_BACKENDS = dict(linear_backend="nvfp4_sm120", moe_backend="nvfp4_sm120")


def case(kind: str, fmt: str, act: str, **kw) -> Case:
    return Case(kind, fmt, act, **({**W4A16_BACKENDS, **kw} if act == "w4a16" else kw))


@pytest.fixture(scope="module")
def ranks(request):
    """``request.param`` spawned ranks (parametrize indirectly with the TP size); one set per TP size at a time."""
    pool = Ranks(request.param)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(shape, fmt, act, shared)``: the tiny checkpoint's directory, written once per module."""
    made = {}

    def get(shape: TinyShape, fmt: str, act: str, shared: bool = False) -> str:
        key = (shape, fmt, act, shared)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{fmt}-{act}-{'shared' if shared else 'parts'}")
            made[key] = str(PL.write_checkpoint(out, fmt, act, shape, shared_fused_globals=shared))
        return made[key]

    return get


TP_SIZES = pytest.mark.parametrize("ranks", [2, 4], indirect=True, ids=["tp2", "tp4"])


# ---- comparisons --------------------------------------------------------------------------------------------------

def assert_column_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Same dot products, another fp32 accumulation order: at most one bf16 ulp apart (module docstring)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.bfloat16, (what, got.shape, ref.shape)
    torch.testing.assert_close(got, ref, rtol=2 * BF16_U, atol=1e-6 * float(ref.float().abs().max()),
                               msg=lambda m: f"{what}: {m}")


def assert_reduced_close(got: torch.Tensor, ref: torch.Tensor, partials: list[torch.Tensor], what: str) -> None:
    """A sum of bf16 per-rank partials vs one rank's single rounding: the elementwise bound of the module docstring."""
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.bfloat16, (what, got.shape, ref.shape)
    tp = len(partials)
    abs_sum = torch.stack([p.float().abs() for p in partials]).sum(0)
    bound = (17 / 16) * BF16_U * (tp * abs_sum + ref.float().abs())
    err = (got.float() - ref.float()).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} elements beyond the all-reduce rounding bound; "
        f"worst at {divmod(worst, got.shape[-1])}: got {got.flatten()[worst].item()}, "
        f"one rank {ref.flatten()[worst].item()}, bound {bound.flatten()[worst].item():.3g}"
    )


def reassemble(gathered: torch.Tensor, widths: list[int], world: int, replicated_parts=(), replicas: int = 1):
    """The one-rank layout of an all-gathered column-parallel output ``[.., world * n_rank]``.

    Rank r holds its slice of every fused part (``widths``, e.g. q, k, v); parts in ``replicated_parts`` are held
    by ``replicas`` consecutive ranks each (KV heads replicated when there are fewer than ranks), which must agree
    bit for bit.  Returns the parts concatenated in the one-rank order.
    """
    per_rank = [chunk.split(widths, dim=-1) for chunk in gathered.split(sum(widths), dim=-1)]
    assert len(per_rank) == world
    parts = []
    for p in range(len(widths)):
        step = replicas if p in replicated_parts else 1
        for r in range(world):
            owner = r - r % step
            assert torch.equal(per_rank[r][p], per_rank[owner][p]), f"part {p}: rank {r} differs from rank {owner}"
        parts.append(torch.cat([per_rank[r][p] for r in range(0, world, step)], dim=-1))
    return torch.cat(parts, dim=-1)


def run_both(ranks: Ranks, ckpt: str, c: Case):
    """The case on every rank and on one rank; checks what must hold on every rank whatever the layer."""
    per_rank = ranks.run(PL.task_forward, ckpt, c, TS)
    one = PL.task_forward(ckpt, c, TS)
    for r, res in enumerate(per_rank):
        assert res["rank_world"] == (r, ranks.world)
        # Never ranks on different kernels (and the kernels are ours).
        assert res["kernels"] == per_rank[0]["kernels"], (r, res["kernels"], per_rank[0]["kernels"])
        assert res["plans"] == per_rank[0]["plans"]
        for t in TS:
            for name, value in res["outputs"][t].items():
                if isinstance(value, torch.Tensor) and not name.endswith("_partial"):
                    # What vLLM's collectives hand every rank is the same tensor.
                    assert torch.equal(value, per_rank[0]["outputs"][t][name]), (r, t, name)
    for name, k in per_rank[0]["kernels"].items():
        assert k["kernel"] in ("Sm120TritonNvFp4LinearKernel", "Sm120W4A16NvFp4LinearKernel",
                               "Sm120NvFp4Experts"), (name, k)
        assert k["fallback"] is None
        assert one["kernels"][name] == k
    # Both plans run where the checkpoint has activation scales; the same plan as one rank at every T.
    expected = {3: "w4a16", 40: "w4a4" if c.act == "w4a4" else "w4a16"}
    assert per_rank[0]["plans"] == one["plans"] == {key: expected[key[1]] for key in one["plans"]}
    assert one["plans"], "no plan recorded"
    return per_rank, one


# ---- linears ------------------------------------------------------------------------------------------------------

def fused_cases(test):
    """Parametrize a fused-layer test: TP size x format x activation x per-part or shared weight globals (vLLM
    merges per-part globals of W4A4 layers into one; W4A16 rows keep their part's, which must follow the shard)."""
    test = pytest.mark.parametrize("fmt, act", FORMATS_ACTS)(test)
    test = pytest.mark.parametrize("shared", [False, True], ids=["part-globals", "shared-global"])(test)
    return TP_SIZES(test)


@fused_cases
def test_qkv_with_kv_heads_replicated(ranks, checkpoints, fmt, act, shared):
    shape = SHAPES[ranks.world]
    per_rank, one = run_both(ranks, checkpoints(shape, fmt, act, shared), case("qkv", fmt, act))
    out = per_rank[0]["outputs"]
    replicas = out[TS[0]]["kv_replicas"]
    assert replicas == ranks.world // shape.kv_heads > 1  # fewer KV heads than ranks
    for t in TS:
        got = reassemble(out[t]["qkv"], out[t]["qkv_widths"], ranks.world, replicated_parts=(1, 2),
                         replicas=replicas)
        assert_column_close(got, one["outputs"][t]["qkv"], f"qkv T={t}")


@fused_cases
def test_gate_up_then_down(ranks, checkpoints, fmt, act, shared):
    """MergedColumnParallelLinear → SiLU-and-mul on each rank's shards → RowParallelLinear (K sharded, bias)."""
    shape = SHAPES[ranks.world]
    assert shape.moe_intermediate // ranks.world == PER_RANK
    per_rank, one = run_both(ranks, checkpoints(shape, fmt, act, shared), case("mlp", fmt, act))
    out = per_rank[0]["outputs"]
    for t in TS:
        got = reassemble(out[t]["gate_up"], out[t]["gate_up_widths"], ranks.world)
        assert_column_close(got, one["outputs"][t]["gate_up"], f"gate_up T={t}")
        # The down projection's input on each rank is the activation of that rank's own gate and up shards, so it
        # equals the one-rank activation's slice only if gate_up did (checked just above, to within one ulp; the
        # CPU matmul is bit-exact here, else a flipped FP4 code could exceed the bound below).
        assert_reduced_close(out[t]["down"], one["outputs"][t]["down"],
                             [res["outputs"][t]["down_partial"] for res in per_rank], f"down T={t}")


@TP_SIZES
@pytest.mark.parametrize("fmt, act", FORMATS_ACTS)
def test_o_proj_row_parallel(ranks, checkpoints, fmt, act):
    shape = SHAPES[ranks.world]
    assert shape.heads * shape.head_dim // ranks.world == PER_RANK
    ckpt = checkpoints(shape, fmt, act)
    per_rank, one = run_both(ranks, ckpt, case("o", fmt, act))
    for t in TS:
        assert_reduced_close(per_rank[0]["outputs"][t]["o"], one["outputs"][t]["o"],
                             [res["outputs"][t]["o_partial"] for res in per_rank], f"o T={t}")


# ---- MoE ----------------------------------------------------------------------------------------------------------

@TP_SIZES
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("fmt, act", FORMATS_ACTS)
def test_moe(ranks, checkpoints, fmt, act, ep):
    """FusedMoE with I sharded (TP) or the experts sharded (EP, ``expert_map``)."""
    shape = SHAPES[ranks.world]
    ckpt = checkpoints(shape, fmt, act)
    per_rank, one = run_both(ranks, ckpt, case("moe", fmt, act, ep=ep))
    e = shape.experts
    for r, res in enumerate(per_rank):
        scales = res["scales"]
        if ep:
            assert scales["local_experts"] == e // ranks.world
            local = e // ranks.world
            expected_map = torch.full((e,), -1, dtype=torch.int32)
            expected_map[r * local:(r + 1) * local] = torch.arange(local, dtype=torch.int32)
            assert torch.equal(scales["expert_map"], expected_map), (r, scales["expert_map"])
        else:
            assert scales["local_experts"] == e and scales["expert_map"] is None
        # One static activation scale per GEMM input on every rank, from every expert's calibration: EP ranks hold
        # only their experts' input scales, so this needs the max all-reduced across the EP group.
        for name in ("a1_gscale", "a2_gscale"):
            if act == "w4a16":
                assert scales[name] is None and one["scales"][name] is None
            else:
                torch.testing.assert_close(scales[name], one["scales"][name], rtol=0, atol=0,
                                           msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}")
    for t in TS:
        assert_reduced_close(per_rank[0]["outputs"][t]["moe"], one["outputs"][t]["moe"],
                             [res["outputs"][t]["moe_partial"] for res in per_rank], f"moe T={t}")


# ---- load-time refusals -------------------------------------------------------------------------------------------

def outcomes(ranks: Ranks, ckpt: str, c: Case) -> list[dict]:
    per_rank = ranks.run(PL.task_load_outcome, ckpt, c)
    assert [res["rank_world"] for res in per_rank] == [(r, ranks.world) for r in range(ranks.world)]
    return per_rank


def assert_consistent(per_rank: list[dict]) -> dict:
    """Every rank refused the same way, or chose the same kernels (and fallbacks): never ranks on different
    kernels.  Returns the common outcome."""
    first = {k: v for k, v in per_rank[0].items() if k != "rank_world"}
    for r, res in enumerate(per_rank[1:], 1):
        mine = {k: v for k, v in res.items() if k != "rank_world"}
        assert mine == first, f"rank {r} ended up with {mine}, rank 0 with {first}"
    return first


# (case, whether the route takes the layer on one rank, on each rank): per-rank shapes where the route's own
# load-time check (real, not stubbed) refuses the rank's shard but not the whole layer, and where it refuses both.
ROUTE_CASES = [
    # cuBLAS FP4 needs K % 32: o_proj's K = 96 / 192 is, each rank's 48 is not.
    pytest.param(Case("o", "modelopt", "w4a4", linear_backend="nvfp4_sm120_cublas"), True, False, id="cublas-o"),
    # ... and qkv's K = 80 is not, on one rank or any.
    pytest.param(Case("qkv", "ct", "w4a4", linear_backend="nvfp4_sm120_cublas"), False, False, id="cublas-qkv"),
]


@TP_SIZES
@pytest.mark.parametrize("c, one_takes, ranks_take", ROUTE_CASES)
def test_route_refusal_is_the_same_on_every_rank(ranks, checkpoints, c, one_takes, ranks_take):
    ckpt = checkpoints(SHAPES[ranks.world], c.fmt, c.act)
    common = assert_consistent(outcomes(ranks, ckpt, c))
    one = PL.task_load_outcome(ckpt, c)
    assert common["error"] is None and one["error"] is None
    for outcome, takes in ((one, one_takes), (common, ranks_take)):
        (k,) = outcome["kernels"].values()
        # Refused at load, the layer keeps our class, which hands it to vLLM's next choice (our Triton kernel).
        fallback = None if takes else "Sm120TritonNvFp4LinearKernel"
        assert k == {"kernel": "Sm120CublasNvFp4LinearKernel", "fallback": fallback, "route": "cublas"}, k


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["tp2"])
def test_consistency_check_catches_a_rank_on_another_kernel(ranks, checkpoints):
    """The check above can fail: with the cuBLAS route refusing on rank 1 only, the ranks disagree."""
    c = Case("o", "modelopt", "w4a4", linear_backend="nvfp4_sm120_cublas")
    ckpt = checkpoints(SHAPES[4], c.fmt, c.act)  # K = 192: 96 per rank, which cuBLAS takes
    per_rank = ranks.run(PL.task_load_outcome_refusing_on_rank, ckpt, c, 1)
    assert per_rank[0]["kernels"]["o"]["fallback"] is None
    assert per_rank[1]["kernels"]["o"]["fallback"] == "Sm120TritonNvFp4LinearKernel"
    with pytest.raises(AssertionError, match="rank 1 ended up with"):
        assert_consistent(per_rank)


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["tp2"])
@pytest.mark.parametrize("c", [Case("o", "modelopt", "w4a4"), Case("moe", "modelopt", "w4a4")], ids=["o", "moe"])
def test_guard_failure_on_one_rank_falls_back_on_every_rank(ranks, checkpoints, c):
    """The numerics guard fails on rank 1's "GPU" only: every rank ends on the same fallback, rank 1 naming the
    failing kernel and rank 0 the other rank."""
    ckpt = checkpoints(SHAPES[ranks.world], c.fmt, c.act)
    per_rank = ranks.run(PL.task_load_outcome_guard_failing_on_rank, ckpt, c, 1)
    lines = [res.pop("guard_lines") for res in per_rank]
    common = assert_consistent(per_rank)
    assert common["error"] is None
    if c.kind == "o":
        assert common["kernels"]["o"] == {"kernel": "Sm120TritonNvFp4LinearKernel", "route": "triton",
                                          "fallback": "EmulationNvFp4LinearKernel"}
        assert "w4a4_triton(" in lines[1][0] and "another tensor-parallel rank" in lines[0][0]
    else:
        assert common["moe_plan_t1"].endswith("/exact-decode")
        assert "moe w4a16/triton" in lines[1][0] and "another tensor-parallel rank" in lines[0][0]
    assert [len(x) for x in lines] == [1, 1], lines
    # The same with no rank failing: nobody falls back.
    clean = ranks.run(PL.task_load_outcome_guard_failing_on_rank, ckpt, c, -1)
    assert all(res["guard_lines"] == [] for res in clean)
    if c.kind == "o":
        assert all(res["kernels"]["o"]["fallback"] is None for res in clean)


# Per-rank shapes no NVFP4 kernel can serve: a K (or MoE I) per rank that is not a multiple of 16.
UNSERVABLE = {2: TinyShape(layers=1, hidden=80, heads=4, kv_heads=1, head_dim=12, experts=8, top_k=2,
                           moe_intermediate=48),
              4: TinyShape(layers=1, hidden=80, heads=4, kv_heads=2, head_dim=24, experts=8, top_k=2,
                           moe_intermediate=96)}


@TP_SIZES
@pytest.mark.parametrize("kind, fmt, act, layer, full", [
    pytest.param("o", "modelopt", "w4a4", "self_attn.o_proj", "heads", id="o-modelopt-w4a4"),
    pytest.param("mlp", "modelopt", "w4a16", "mlp.down_proj", "moe_intermediate", id="down-modelopt-w4a16"),
    pytest.param("o", "ct", "w4a4", "self_attn.o_proj", "heads", id="o-ct-w4a4"),
    pytest.param("mlp", "ct", "w4a16", "mlp.down_proj", "moe_intermediate", id="down-ct-w4a16"),
    pytest.param("moe", "modelopt", "w4a4", "mlp.experts", "moe_intermediate", id="moe-modelopt-w4a4"),
    pytest.param("moe", "ct", "w4a16", "mlp.experts", "moe_intermediate", id="moe-ct-w4a16"),
])
def test_unservable_rank_shape_refused_at_load(ranks, checkpoints, kind, fmt, act, layer, full):
    """K / TP (MoE: I / TP) = 24: every rank refuses at load, with one line naming the layer, TP size and shape.

    Without the refusal vLLM's ModelOpt linears raise a message naming neither the layer nor the TP size, and
    compressed-tensors linears and FusedMoE load each rank's block scales rounded down to whole columns (wrong
    scales) and fail only at the first forward."""
    shape = UNSERVABLE[ranks.world]
    full_size = shape.heads * shape.head_dim if full == "heads" else shape.moe_intermediate
    per_rank = full_size // ranks.world
    assert per_rank % 16 and per_rank % 8 == 0
    common = assert_consistent(outcomes(ranks, checkpoints(shape, fmt, act), case(kind, fmt, act)))
    msg = common["error"]
    assert msg is not None, f"loaded without refusal: {common['kernels']}"
    assert msg.startswith("ValueError: NVFP4 layer "), msg
    assert "\n" not in msg, msg
    assert f"model.layers.0.{layer}" in msg, msg
    assert re.search(rf"tensor[- ]parallel size {ranks.world}\b", msg), msg
    assert re.search(rf"\b{full_size}\b", msg) and re.search(rf"\b{per_rank}\b", msg), msg
    assert "not a multiple of 16" in msg, msg
    # The same shape on one rank loads (the refusal is about the shard, not the layer).
    assert PL.task_load_outcome(checkpoints(shape, fmt, act), case(kind, fmt, act))["error"] is None


# ---- the harness itself (last: the hang case restarts the ranks) ---------------------------------------------------

@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["tp2"])
def test_harness_reports_failing_and_hung_ranks(ranks, monkeypatch):
    from parallel_harness import FAILURE_GRACE_S, RankFailure, task_hang_on_rank, task_raise_on_rank

    # A rank raises, the other answers: the ranks stay up.
    with pytest.raises(RankFailure, match=r"(?s)--- rank 1:.*planted failure on rank 1"):
        ranks.run(task_raise_on_rank, 1)
    assert ranks.alive()
    # A rank raises while the other waits for it in an all-reduce: the error, soon, and the stuck rank killed.
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 did not answer.*planted failure on rank 0"):
        ranks.run(task_raise_on_rank, 0, then_all_reduce=True)
    assert time.monotonic() - start < FAILURE_GRACE_S + 10 and not ranks.alive()
    assert ranks.run(task_hang_on_rank, 1, 0.0) == ["ok", "ok"]  # fresh ranks
    # Every rank alive but one never answers: the call fails after the task timeout, the ranks are killed.
    monkeypatch.setattr(ranks, "task_timeout_s", 3.0)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 did not answer \(waited \d+ s\)"):
        ranks.run(task_hang_on_rank, 1, 600.0)
    assert time.monotonic() - start < 3.0 + 5 and not ranks.alive()
