"""Tiny NVFP4 checkpoints for the CLI tests: a shared set written once per session, and fresh ones per test."""

import itertools

import pytest

from vllm_nvfp4_sm120.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny[(format, "w4a4" | "w4a16")]`` → checkpoint folder; ``tiny["shared"]``: one global per fused group."""
    root = tmp_path_factory.mktemp("tiny-ckpts")
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        for act in ("w4a4", "w4a16"):
            out[(fmt, act)] = write_tiny_checkpoint(root / f"{fmt}-{act}", fmt, w4a16=act == "w4a16")
    out["shared"] = write_tiny_checkpoint(root / "shared", "modelopt", shared_fused_globals=True, tokenizer=False)
    return out


@pytest.fixture
def craft(tmp_path):
    """``craft(fmt="modelopt", **options)`` → a fresh checkpoint from ``write_tiny_checkpoint`` (no tokenizer)."""
    counter = itertools.count()

    def make(fmt="modelopt", **options):
        return write_tiny_checkpoint(tmp_path / f"ckpt{next(counter)}", fmt, tokenizer=False, **options)

    return make

