"""The ``nvfp4_sm120`` operator library: how the custom ops are registered.

``torch.library.custom_op`` wraps every call in Python dispatch logic (argument binding, autograd and
functionalization checks) that costs tens of microseconds per call on the host; prefill runs outside CUDA graphs,
so that cost is paid per layer and step.  vLLM registers its own ops the direct way
(``vllm.utils.torch_utils.direct_register_custom_op``): the schema inferred from the function's annotations, one
``Library.define``, the function as the kernel of the backend keys, a fake implementation for tracing.  The same
is done here without importing vLLM (the dispatch layer runs where vLLM is absent), for CPU (the reference paths
the CPU tests exercise) and CUDA.

The ops are inference-only, as vLLM's: no autograd formula is registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.library import Library, infer_schema

NAMESPACE = "nvfp4_sm120"
# The operator's lifetime is the library object's: module-level, never collected.
LIB = Library(NAMESPACE, "FRAGMENT")
DISPATCH_KEYS = ("CUDA", "CPU")


def register_op(name: str, fn: Callable, fake: Callable, mutates_args: Sequence[str] = ()) -> Callable:
    """Define ``torch.ops.nvfp4_sm120.<name>`` from ``fn``'s annotations, with ``fn`` as its CUDA and CPU kernel
    and ``fake`` as its fake (meta) implementation; returns the op's default overload."""
    LIB.define(name + infer_schema(fn, mutates_args=tuple(mutates_args)))
    for key in DISPATCH_KEYS:
        LIB.impl(name, fn, dispatch_key=key)
    LIB._register_fake(name, fake)
    return getattr(getattr(torch.ops, NAMESPACE), name).default
