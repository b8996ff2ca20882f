"""Spawned CPU ranks with vLLM's distributed environment (gloo), for tensor- and expert-parallel tests.

:class:`Ranks` starts ``world`` processes (``torch.multiprocessing``, start method ``spawn``).  Each one imports
vLLM the way the single-process glue tests do (``vllm_platform`` first), initialises vLLM's distributed environment
over gloo on a free TCP port and the model-parallel groups with tensor-parallel size ``world`` (vLLM derives the
expert-parallel group from it when a layer's config enables expert parallelism), registers the plugin, and then
serves tasks: :meth:`Ranks.run` sends the same function and arguments to every rank and returns each rank's result.

A rank costs a vLLM import (~10 s of CPU), so one set of ranks serves many tests; every task is self-contained
(its own vLLM config, its own platform fake through a ``MonkeyPatch``, fresh once-per-choice log state), so a test
passes alone and in any order.  Failures are contained: an exception on any rank fails the call with every rank's
traceback; a rank that does not answer in time (a hang, or a collective waiting for a rank that raised) fails the
call, and the ranks are killed and started afresh for the next call.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as tmp

# A cold start imports torch and vLLM in every rank at once; on a 2-core machine shared with other jobs four ranks
# take ~40 s, so the limit leaves room.  A task is a few tiny layers.
START_TIMEOUT_S = 300.0
TASK_TIMEOUT_S = 180.0
# After one rank failed, how long the others get to report.  A rank blocked in a collective on the failed one would
# wait for gloo's default timeout (30 min: vLLM's groups do not take the world group's), so it is killed instead.
FAILURE_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    # torch.save rather than the queue's pickling: torch.multiprocessing would move tensors through shared memory.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class RankFailure(RuntimeError):
    """A task failed (raised, or did not answer in time) on at least one rank.  Not an ``AssertionError``, so a
    test that expects an assertion to fail (``xfail(raises=AssertionError)``) does not pass on a broken rank."""


def _rank_main(rank: int, world: int, port: int, tasks, results) -> None:
    """A rank: vLLM's distributed environment over gloo, the plugin registered, then tasks until ``None``."""
    try:
        torch.set_num_threads(1)  # the ranks share two cores
        import vllm_platform  # first: the vLLM imports that must precede any platform fake
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        import vllm_nvfp4_sm120.vllm.register as plugin

        # On vLLM's real platform (none here): the groups' device is the CPU and their collectives are gloo's.
        with set_current_vllm_config(vllm_platform.vllm_config()):
            init_distributed_environment(
                world_size=world, rank=rank, local_rank=rank, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}",
            )
            ensure_model_parallel_initialized(world, 1)
        plugin.register()
        results.put((None, rank, "ready", b""))
    except BaseException:
        results.put((None, rank, "error", traceback.format_exc().encode()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args, kwargs = _loads(payload)
            results.put((task_id, rank, "ok", _dumps(fn(*args, **kwargs))))
        except BaseException:
            results.put((task_id, rank, "error", traceback.format_exc().encode()))
    # Nothing to keep: skip the interpreter's teardown of vLLM and the process groups (seconds per rank).
    results.close()
    results.join_thread()
    os._exit(0)


class Ranks:
    """``world`` spawned ranks running tasks in vLLM's distributed environment (see the module docstring)."""

    def __init__(self, world: int, *, task_timeout_s: float = TASK_TIMEOUT_S):
        self.world = world
        self.task_timeout_s = task_timeout_s
        self._procs: list = []
        self._next_task = 0

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = tmp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_rank_main, args=(r, self.world, port, self._tasks[r], self._results), daemon=True,
                        name=f"tp-rank-{r}")
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        self._collect(None, START_TIMEOUT_S, what="start")

    def alive(self) -> bool:
        """Whether the ranks are up (they start on the first :meth:`run`, and again after a failure killed them)."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        if not self._procs:
            return
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        deadline = time.monotonic() + 20.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        for q in (*self._tasks, self._results) if self._procs else ():
            q.cancel_join_thread()  # a killed rank never reads what is left
            q.close()
        self._procs = []

    # ---- tasks ---------------------------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results, by rank.

        ``fn`` must be importable by the ranks (a module-level function of a module on ``sys.path``); arguments and
        results travel through ``torch.save``.
        """
        if not self.alive():
            self._kill()
            self._start()
        self._next_task += 1
        task_id = self._next_task
        payload = _dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((task_id, payload))
        return self._collect(task_id, self.task_timeout_s, what=getattr(fn, "__name__", str(fn)))

    def _collect(self, task_id, timeout_s: float, what: str) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        started = time.monotonic()
        deadline = started + timeout_s
        while len(out) + len(errors) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                tid, rank, status, data = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs) and not errors:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    errors.update({r: f"rank {r} died (exit code {self._procs[r].exitcode})" for r in dead
                                   if r not in out})
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if tid != task_id:
                continue  # a late answer to a task that already failed
            if status == "error":
                errors[rank] = data.decode()
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            elif status == "ready":
                out[rank] = None
            else:
                out[rank] = _loads(data)
        missing = [r for r in range(self.world) if r not in out and r not in errors]
        if missing or any(not p.is_alive() for p in self._procs):
            self._kill()  # a rank is stuck (in a collective, say) or gone: start afresh next time
        if errors or missing:
            lines = [f"{what} failed on {self.world} ranks"]
            waited = time.monotonic() - started
            lines += [f"--- rank {r} did not answer (waited {waited:.0f} s)" for r in missing]
            lines += [f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items())]
            raise RankFailure("\n".join(lines))
        return [out[r] for r in range(self.world)]


def task_raise_on_rank(rank: int, *, then_all_reduce: bool = False) -> str:
    """Raises on ``rank`` only (a harness self-test); the others answer, or with ``then_all_reduce`` wait in a
    tensor-parallel all-reduce for the rank that raised."""
    if rank_and_world()[0] == rank:
        raise RuntimeError(f"planted failure on rank {rank}")
    if then_all_reduce:
        from vllm.distributed import tensor_model_parallel_all_reduce

        tensor_model_parallel_all_reduce(torch.ones(4))
    return "ok"


def task_hang_on_rank(rank: int, seconds: float) -> str:
    """Sleeps ``seconds`` on ``rank`` only (a harness self-test: a rank that does not answer in time)."""
    if rank_and_world()[0] == rank:
        time.sleep(seconds)
    return "ok"


def rank_and_world() -> tuple[int, int]:
    """This process's tensor-parallel rank and size (0 and 1 in the test process's one-rank group)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
