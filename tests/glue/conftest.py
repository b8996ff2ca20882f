"""Fixtures for the vLLM glue tests: the plugin registered, a one-process gloo TP group, a faked CUDA platform.

The platform fakes live in ``vllm_platform.py`` (tests import them from there).
"""

from __future__ import annotations

import importlib.util
import socket

import pytest

if importlib.util.find_spec("vllm") is None:
    # The GPU machine used for kernel proofs has no vLLM; CI installs it.
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def registered():
    """The plugin registered for the session (as vLLM's entry point would), unregistered at the end."""
    import vllm_platform  # noqa: F401  (imports the vLLM modules that must precede any platform fake)

    import vllm_nvfp4_sm120.vllm.register as plugin

    was = plugin.is_registered()
    plugin.register()
    assert plugin.is_registered(), "register() did nothing (VLLM_NVFP4_SM120=0 in the environment?)"
    yield plugin
    if not was:
        plugin.unregister()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tp_group():
    """A one-process gloo tensor-parallel group: vLLM's parallel linears need one to create weights."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm_platform import vllm_config

    if model_parallel_is_initialized():
        yield
        return
    with set_current_vllm_config(vllm_config()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture
def fake_platform(monkeypatch):
    """``fake_platform((12, 0))`` fakes an sm_120 CUDA GPU for this test."""
    from vllm_platform import fake_cuda

    return lambda cc: fake_cuda(monkeypatch, cc)


@pytest.fixture
def plugin_log(monkeypatch):
    """The plugin logger's records in this test, and only its (``.records``): vLLM's own once-per-process lines
    land in whichever test runs first, so a test that counted them would depend on the order.

    Each test counts its own once-per-model layer warnings (``log.warn_layer``)."""
    import logging

    import vllm_nvfp4_sm120.vllm.log as glue_log

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    monkeypatch.setattr(glue_log, "_tallies", {})
    log = logging.getLogger("vllm.nvfp4_sm120")
    handler = Records()
    monkeypatch.setattr(log, "propagate", False)  # vLLM's logging config may or may not pass them to the root
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)
