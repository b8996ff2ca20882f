"""Token counts (T, M, routes, row blocks) are not specialized on: one compile serves every batch size.

Triton's JIT specializes integer arguments on value (== 1) and divisibility by 16, so a kernel taking T compiles up
to three variants over vLLM's capture sizes (1; 16, 32, ...; 8, 24, ...).  Each kernel listed here marks its
per-call counts ``do_not_specialize``.  Checked with Triton's own argument binder for an sm_120 target (no GPU
needed), in a subprocess: the CPU tests run with ``TRITON_INTERPRET=1``, under which ``triton.jit`` returns the
interpreter's function instead.
"""

import os
import subprocess
import sys

import pytest

# (module, kernel, per-call counts)
TOKEN_ARGS = [
    ("act_quant", "_act_quant_kernel", ["T", "SF_ROWS"]),
    ("w4a4_gemm", "_w4a4_gemm_kernel", ["M"]),
    ("w4a16_linear", "_w4a16_gemv_kernel", ["T"]),
    ("w4a16_linear", "_w4a16_splitk_finish_kernel", ["T"]),
    ("w4a16_linear", "_w4a16_gemm_kernel", ["T"]),
    ("gluon_gemv", "_gemv_fma_kernel", ["T"]),
    ("gluon_gemv", "_gemv_mma_kernel", ["T"]),
    ("moe_w4a16", "_moe_w4a16_gate_up_kernel", ["R", "max_blocks"]),
    ("moe_w4a16", "_moe_w4a16_down_kernel", ["R", "max_blocks"]),
    ("moe_w4a4", "_moe_w4a4_gate_up_kernel", ["R", "max_blocks"]),
    ("moe_w4a4", "_moe_w4a4_down_kernel", ["R", "max_blocks"]),
    ("gluon_moe_w4a16", "_gluon_moe_w4a16_kernel", ["R", "max_blocks"]),
    ("gluon_moe_w4a4", "_gluon_moe_w4a4_kernel", ["R", "max_blocks"]),
    ("moe_align", "_count_kernel", ["R"]),
    ("moe_align", "_scatter_kernel", ["R", "num_route_tiles", "max_blocks"]),
]

SCRIPT = r"""
import importlib, json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

module, name, token_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kernel = getattr(importlib.import_module(f"vllm_nvfp4_sm120.kernels.{module}"), name)
binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 120, 32)))
buf = torch.empty(1 << 12, dtype=torch.bfloat16)
ints = [p.name for p in kernel.params if not p.is_constexpr and not p.name.endswith(("_ptr", "_desc"))]

def spec(**values):
    args, kw = [], {}
    for p in kernel.params:
        if p.is_constexpr:
            kw[p.name] = 1
        elif p.name in ints:
            args.append(values.get(p.name, 64))
        else:
            args.append(buf)
    return repr(binder(*args, **kw)[1])

result = {"missing": [a for a in token_args if a not in ints],
          "specialized": [a for a in token_args if a in ints and len({spec(**{a: v}) for v in (1, 16, 24, 4096)}) > 1]}
# The binder does specialize another integer argument (so the check above can fail).
other = next((a for a in ints if a not in token_args), None)
result["control"] = other is None or spec(**{other: 1}) != spec(**{other: 24})
print(json.dumps(result))
"""


@pytest.mark.compile
@pytest.mark.parametrize("module, kernel, token_args", TOKEN_ARGS, ids=[f"{m}.{k}" for m, k, _ in TOKEN_ARGS])
def test_token_counts_are_not_specialized(module, kernel, token_args):
    import json

    from vllm_nvfp4_sm120.kernels.gluon_compat import HAS_GLUON

    if "gluon" in module and not HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, module, kernel, json.dumps(token_args)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result == {"missing": [], "specialized": [], "control": True}
