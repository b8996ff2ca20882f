"""Compile a Triton or Gluon kernel for a GPU we do not have, and read what came out.

This is the sm_120 half of every kernel's proof: ``compile_kernel(...)`` builds the kernel for
``GPUTarget("cuda", 120, 32)`` (or 90, 100, ...) down to a cubin with the Triton wheel's own ptxas, then reads
the PTX, the SASS and the resource usage (registers, local memory, shared memory) with the wheel's cuobjdump.

Compilation runs in a subprocess: several Triton failures on sm_120 (K < 64 ``dot_scaled``, MN-packed FP4,
``setmaxnreg`` below sm_90) are C++ asserts that abort the process instead of raising.
Divisibility attributes are passed as the JIT would (pointers and the named integers divisible by 16): without
them Triton does not pipeline and the SASS would not be what runs.

    rep = compile_kernel("vllm_nvfp4_sm120.kernels.w4a4_gemm:_w4a4_gemm_kernel", signature, constexprs)
    rep.require_sass(r"OMMA\\.SF\\..*E2M1\\.E2M1\\.UE4M3\\.4X").require_no_local().require_smem()
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .common import SM120_MAX_SMEM_BYTES

# Instruction patterns the kernel tests assert on.
SASS_OMMA_NVFP4 = r"OMMA\.SF\.16864\.F32\.E2M1\.E2M1\.UE4M3\.4X"
PTX_MMA_NVFP4 = r"mma\.sync\.aligned\.m16n8k64\.row\.col\.kind::mxf4nvf4\.block_scale\.scale_vec::4X\.f32\.e2m1\.e2m1\.f32\.ue4m3"
PTX_TMA_LOAD = r"cp\.async\.bulk\.tensor"
SASS_LDSM = r"\bLDSM\b"


class CompileError(RuntimeError):
    """The compiler failed or aborted; ``returncode`` is negative when the process was killed by a signal."""

    def __init__(self, message: str, returncode: int, log: str):
        super().__init__(f"{message} (exit {returncode})\n{log[-4000:]}")
        self.returncode = returncode
        self.log = log


@dataclass
class CompiledKernel:
    name: str
    arch: int
    ptx: str
    ttgir: str
    sass: str
    registers: int
    local_bytes: int
    stack_bytes: int
    shared_bytes: int  # Triton's dynamic shared memory plus any static shared memory in the cubin
    num_warps: int
    extra: dict = field(default_factory=dict)

    def has_sass(self, pattern: str) -> bool:
        return re.search(pattern, self.sass) is not None

    def has_ptx(self, pattern: str) -> bool:
        return re.search(pattern, self.ptx) is not None

    def require_sass(self, pattern: str) -> CompiledKernel:
        if not self.has_sass(pattern):
            raise AssertionError(f"{self.name} (sm_{self.arch}): SASS has no match for {pattern!r}")
        return self

    def require_ptx(self, pattern: str) -> CompiledKernel:
        if not self.has_ptx(pattern):
            raise AssertionError(f"{self.name} (sm_{self.arch}): PTX has no match for {pattern!r}")
        return self

    def require_no_local(self) -> CompiledKernel:
        if self.local_bytes or self.stack_bytes or re.search(r"\b(LDL|STL)\b", self.sass):
            raise AssertionError(
                f"{self.name} (sm_{self.arch}): uses local memory (LOCAL {self.local_bytes} B, STACK "
                f"{self.stack_bytes} B): registers spilled or an array was indexed at run time"
            )
        return self

    def require_smem(self, limit: int = SM120_MAX_SMEM_BYTES) -> CompiledKernel:
        if self.shared_bytes > limit:
            raise AssertionError(f"{self.name} (sm_{self.arch}): {self.shared_bytes} B shared memory > {limit} B")
        return self

    def summary(self) -> str:
        return (
            f"{self.name} sm_{self.arch}: {self.registers} regs, {self.shared_bytes} B smem, "
            f"{self.local_bytes} B local, {self.num_warps} warps"
        )


def triton_tool(name: str) -> str:
    """Path of a CUDA tool bundled with the Triton wheel (``cuobjdump``, ``nvdisasm``, ``ptxas``)."""
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    if env:
        return env
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name}: not found in the Triton wheel at {path}; set TRITON_{name.upper()}_PATH")
    return str(path)


_RES_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _read_cubin(cubin: Path) -> tuple[str, dict[str, int]]:
    cuobjdump = triton_tool("cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    m = _RES_USAGE.search(res)
    if not m:
        raise RuntimeError(f"cuobjdump -res-usage: unexpected output:\n{res}")
    reg, stack, shared, local = map(int, m.groups())
    return sass, {"registers": reg, "stack": stack, "static_shared": shared, "local": local}


def compile_kernel(
    kernel: str,
    signature: Mapping[str, str],
    constexprs: Mapping[str, object] | None = None,
    *,
    arch: int = 120,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible: Sequence[str] | None = None,
    gluon: bool = False,
    maxnreg: int | None = None,
    timeout: float = 600,
) -> CompiledKernel:
    """Compile ``kernel`` (``"package.module:name"`` or ``"/path/file.py:name"``) for ``cuda:arch``.

    ``signature`` maps every argument to a Triton type (``"*u8"``, ``"i32"``, ``"constexpr"``, ...);
    ``constexprs`` gives the constexpr values.  ``divisible`` names the arguments the JIT would mark divisible by
    16 (default: every pointer).  ``maxnreg``: the launch option of that name (a register cap per thread).
    Raises :class:`CompileError` if the compiler fails or aborts.
    Every ``constexpr`` of ``signature`` needs a value: one left out would compile as ``None``, i.e. silently check
    a different variant of the kernel than the one that runs.
    """
    missing = [k for k, v in signature.items() if v == "constexpr" and k not in (constexprs or {})]
    if missing:
        raise ValueError(f"constexprs: no value for {missing} of {kernel}")
    spec = {
        "kernel": kernel,
        "signature": dict(signature),
        "constexprs": dict(constexprs or {}),
        "arch": arch,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "divisible": list(divisible) if divisible is not None else [k for k, v in signature.items() if v.startswith("*")],
        "gluon": gluon,
        "maxnreg": maxnreg,
    }
    with tempfile.TemporaryDirectory(prefix="nvfp4-aot-") as tmp:
        out = Path(tmp)
        env = dict(os.environ)
        env.setdefault("TRITON_CACHE_DIR", str(out / "triton-cache"))
        env.pop("TRITON_INTERPRET", None)  # the interpreter has no compiler: ASTSource needs the real JIT function
        # The proof is made with the Triton wheel's own ptxas.  Importing FlashInfer (vLLM does) points
        # TRITON_PTXAS_BLACKWELL_PATH at a system CUDA >= 13 ptxas, whose PTX ISA can be older (13.0: 9.0).
        env.pop("TRITON_PTXAS_PATH", None)
        env.pop("TRITON_PTXAS_BLACKWELL_PATH", None)
        proc = subprocess.run(
            [sys.executable, "-m", __name__, json.dumps(spec), str(out)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        if proc.returncode != 0:
            raise CompileError(f"compiling {kernel} for sm_{arch} failed", proc.returncode, proc.stdout + proc.stderr)
        meta = json.loads((out / "meta.json").read_text())
        sass, res = _read_cubin(out / "kernel.cubin")
        return CompiledKernel(
            name=kernel.rsplit(":", 1)[-1],
            arch=arch,
            ptx=(out / "kernel.ptx").read_text(),
            ttgir=(out / "kernel.ttgir").read_text(),
            sass=sass,
            registers=res["registers"],
            local_bytes=res["local"],
            stack_bytes=res["stack"],
            shared_bytes=int(meta["shared"]) + res["static_shared"],
            num_warps=int(meta["num_warps"]),
        )


def _load_kernel(ref: str):
    import importlib
    import importlib.util

    where, _, name = ref.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _worker(spec: dict, out: Path) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _load_kernel(spec["kernel"])
    names = list(fn.arg_names)
    unknown = set(spec["signature"]) ^ set(names)
    if unknown:
        raise SystemExit(f"signature does not match the kernel's arguments {names}: {sorted(unknown)}")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec["divisible"]}
    constexprs = {(names.index(k),): v for k, v in spec["constexprs"].items()}
    signature = {k: spec["signature"][k] for k in names}
    if spec["gluon"]:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, signature, constexprs, attrs)
    else:
        src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]}
    if spec.get("maxnreg"):
        options["maxnreg"] = spec["maxnreg"]
    k = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32), options=options)
    (out / "kernel.ptx").write_text(k.asm["ptx"])
    (out / "kernel.ttgir").write_text(k.asm["ttgir"])
    (out / "kernel.cubin").write_bytes(k.asm["cubin"])
    (out / "meta.json").write_text(json.dumps({"shared": k.metadata.shared, "num_warps": k.metadata.num_warps}))


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), Path(sys.argv[2]))
