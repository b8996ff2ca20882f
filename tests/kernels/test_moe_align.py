"""moe_align: every local route exactly once, grouped by expert, blocks padded with the sentinel (interpreter)."""

import pytest
import torch

from vllm_nvfp4_sm120.kernels.moe_align import max_blocks, moe_align


def check_alignment(align, topk_ids, num_experts, expert_map=None):
    """The layout contract the GEMMs rely on, checked on the host."""
    r = topk_ids.numel()
    bm = align.block_m
    ids = topk_ids.reshape(-1).long().cpu()
    local = ids if expert_map is None else expert_map.long().cpu()[ids]
    local = torch.where((local >= 0) & (local < num_experts), local, -1)
    n = int(align.num_padded)
    sorted_ids = align.sorted_ids.cpu()[:n]
    expert_ids = align.expert_ids.cpu()
    assert n % bm == 0 and align.sorted_ids.numel() == max_blocks(r, num_experts, bm) * bm
    counts = torch.bincount(local[local >= 0], minlength=num_experts)
    assert n == int(((counts + bm - 1) // bm * bm).sum())
    # Blocks in expert order, each block's real rows on its expert, in route order; padding is the sentinel.
    blocks = expert_ids[: n // bm]
    assert bool((blocks[1:] >= blocks[:-1]).all()) and bool((expert_ids[n // bm:] == -1).all())
    rows = sorted_ids.view(-1, bm) if n else sorted_ids.view(0, bm)
    real = rows < r
    assert bool((rows[~real] == r).all())
    assert bool((local[rows[real].long()] == blocks.repeat_interleave(real.sum(1))).all())
    for e in range(num_experts):
        mine = sorted_ids[(sorted_ids < r)][local[sorted_ids[sorted_ids < r].long()] == e]
        assert torch.equal(mine.long(), (local == e).nonzero().flatten())


@pytest.mark.parametrize("t", [0, 1, 3, 16, 300])
@pytest.mark.parametrize("top_k,num_experts,block_m", [(1, 4, 16), (3, 7, 16), (2, 5, 32), (10, 64, 64)])
def test_align_uniform(t, top_k, num_experts, block_m, gen):
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(t)]) if t else \
        torch.zeros(0, top_k, dtype=torch.int64)
    align = moe_align(ids, num_experts, block_m)
    check_alignment(align, ids, num_experts)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_align_skewed_and_expert_map(dtype, gen):
    # Every token on the same 3 experts (the worst case for padding), global ids mapped to a rank's local ones.
    t, global_e = 40, 12
    ids = torch.tensor([[5, 0, 11]] * t, dtype=dtype)  # top_k = 3
    expert_map = torch.full((global_e,), -1, dtype=torch.int32)
    expert_map[[0, 3, 5, 7]] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    align = moe_align(ids, 4, 16, expert_map=expert_map)
    check_alignment(align, ids, 4, expert_map)
    assert int(align.num_padded) == 2 * 48  # experts 5 -> 2 and 0 -> 0, 40 routes each; 11 is another rank's


def test_align_no_local_route():
    ids = torch.tensor([[1, 2]] * 5, dtype=torch.int32)
    align = moe_align(ids, 2, 16, expert_map=torch.tensor([0, -1, -1, 1], dtype=torch.int32))
    assert int(align.num_padded) == 0 and bool((align.expert_ids == -1).all())


def test_align_many_experts_many_chunks(gen):
    # 512 experts, top-10, enough routes for several chunks of the counting kernel.
    t, top_k, e = 700, 10, 512
    ids = torch.randint(0, e, (t, top_k), generator=gen, dtype=torch.int32)
    check_alignment(moe_align(ids, e, 16), ids, e)


def test_align_rejects_bad_input():
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32 or int64"):
        moe_align(torch.zeros(3, 2), 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(torch.zeros(3, 2, dtype=torch.int32), 4, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("t,top_k,e", [(4096, 8, 128), (4096, 10, 512), (16384, 8, 256), (1, 8, 128)])
def test_align_gpu(t, top_k, e):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(t, e, generator=g, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    check_alignment(moe_align(ids, e, 64), ids, e)
    skew = torch.arange(top_k, device="cuda", dtype=torch.int32).expand(t, top_k).contiguous()
    check_alignment(moe_align(skew, e, 16), skew, e)
