"""What the glue hands the dispatch from the environment: the batch numerics policy and the numerics guard's mode.

``VLLM_NVFP4_SM120_DECODE=w4a16`` (default) or ``w4a4``, and vLLM's ``VLLM_BATCH_INVARIANT``; what each means is
``dispatch/policy.py``'s.  Read at load (every layer's weight processing; the last read wins, and the values do not
change within a process) and handed to the dispatch, which the ops consult per call.
"""

from __future__ import annotations

import os

from ..dispatch.guard import GuardMode, parse_mode
from ..dispatch.policy import NumericsPolicy, current_policy, parse_decode, set_policy
from .log import log_once

DECODE_ENV = "VLLM_NVFP4_SM120_DECODE"
GUARD_ENV = "VLLM_NVFP4_SM120_GUARD"
# The guard checks kernels on CUDA tensors only; tests set this to run it on CPU tensors (with faked launchers).
FORCE_GUARD = False


def guard_mode() -> GuardMode:
    """``VLLM_NVFP4_SM120_GUARD``: ``1`` (default), ``strict`` or ``0``; another value fails the load."""
    return parse_mode(os.environ.get(GUARD_ENV), GUARD_ENV)


def apply_numerics_policy() -> NumericsPolicy:
    """Set the dispatch's policy from the environment; an invalid ``VLLM_NVFP4_SM120_DECODE`` raises ValueError."""
    import vllm.envs as envs

    policy = NumericsPolicy(decode=parse_decode(os.environ.get(DECODE_ENV), DECODE_ENV),
                            batch_invariant=bool(envs.VLLM_BATCH_INVARIANT))
    if policy != current_policy():
        set_policy(policy)
    if policy != NumericsPolicy():
        log_once("info", ("numerics", policy),
                 "nvfp4_sm120: %s: W4A4 checkpoints run W4A4 at every batch size%s",
                 "VLLM_BATCH_INVARIANT=1" if policy.batch_invariant else f"{DECODE_ENV}={policy.decode}",
                 ", with one kernel and tile per layer and the MoE top-k sum in slot order"
                 if policy.batch_invariant else "")
    return policy


def max_over_ranks(values: list[int]) -> list[int]:
    """Elementwise max over the tensor-parallel ranks (vLLM's TP group, on its CPU group), so that a guard verdict
    found on one rank's GPU holds on every rank: ranks never run different kernels.  One rank: ``values``."""
    from vllm.distributed import parallel_state as ps

    if not values or not ps.model_parallel_is_initialized():
        return values
    group = ps.get_tp_group()
    if group.world_size == 1:
        return values
    import torch

    t = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return t.tolist()
