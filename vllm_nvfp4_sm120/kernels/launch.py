"""Ready kernels: one Triton/Gluon kernel with its grid and compile-time arguments fixed, launched without
Triton's per-call argument binding once it has run.

``kernel[grid](*args, **const)`` costs, per call, Triton's binder over every argument (constexprs included), the
cache key, the launch metadata and the launch hooks, before the launch itself.  A launcher whose grid and
constexprs are fixed (the ``prepare_*`` functions) knows most of that once.  :class:`ReadyKernel` launches through
the JIT the first time (which compiles or finds the variant and returns it) and then calls that compiled variant's
launcher directly, for as long as it can tell that the JIT would pick the same variant:

* the variant depends on the *specialization* of the runtime arguments: a tensor's dtype and whether its address
  is 16-byte aligned, an int's width and whether it is 1 or a multiple of 16 (unless ``do_not_specialize``), a
  ``None`` (a constexpr), a TMA descriptor's dtype and block.  So a call takes the fast path when its tensors have
  the dtypes and alignments of the call the variant was remembered from, its other scalars the same types and
  values (equal values specialize equally), and its other arguments (descriptors) Triton's own specialization
  (``native_specialize_impl``, what the binder calls).  Any difference sends the call through the JIT, which picks
  or compiles its variant; that one is remembered instead (a ready kernel serves one signature: its scalars do not
  change from call to call, so this costs nothing in the hot paths);
* the JIT's own state: the current device, no launch hooks (a profiler's), no pre-run or stage-inspection hooks,
  the same debug and instrumentation modes, the kernel's globals unchanged.  Otherwise the call takes the JIT path.

Anything unexpected about Triton (another version's internals, the interpreter, an autotuner around the kernel)
means the JIT path on every call: slower, never different.  The stream is the current one, asked the way the JIT
asks.  ``ENABLED = False`` turns the fast path off for ready kernels made afterwards (benchmarks compare the two).
"""

from __future__ import annotations

from .common import interpreting

try:  # Triton's internals this module relies on (Triton 3.8); without any of them, always the JIT path.
    from triton import knobs as _knobs
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.compiler.compiler import CompiledKernel as _CompiledKernel
    from triton.knobs import HookChain as _HookChain
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except Exception:  # pragma: no cover - depends on the installed Triton
    _JITFunction = None

ENABLED = True
# Launches ready kernels sent through the JIT path (first calls, fallbacks), for benchmarks' diagnostics.
jit_launches = 0

# Arguments compared by type and value.
_SCALAR_TYPES = (int, float, bool, type(None))


def _hooks_empty(hook) -> bool:
    return hook is None or (type(hook) is _HookChain and not hook.calls)


# id(kernel) -> (kernel, its parameters or None): checked once per kernel.  By id: a JITFunction's hash is its
# source hash, computed on first use (and a dict lookup by it takes a lock).
_PARAMS: dict[int, tuple] = {}


def _kernel_params(kernel):
    """The kernel's parameters if it is a plain JIT function whose internals are the expected ones, else None."""
    if _JITFunction is None or not isinstance(kernel, _JITFunction):
        return None
    known = _PARAMS.get(id(kernel))
    if known is not None and known[0] is kernel:
        return known[1]
    params = None
    try:
        for p in kernel.params:
            p.name, p.is_const, p.do_not_specialize, p.do_not_specialize_on_alignment, p.has_default, p.default
        kernel.pre_run_hooks, kernel.used_global_vals.items, kernel.device_caches
        rt = _knobs.runtime
        rt.add_stages_inspection_hook, rt.launch_enter_hook, rt.launch_exit_hook, rt.debug
        _knobs.compilation.instrumentation_mode
        params = kernel.params
    except Exception:
        pass
    _PARAMS[id(kernel)] = (kernel, params)
    return params


class _Variant:
    """One compiled variant, its launcher and what the call it was remembered from looked like."""

    __slots__ = ("run", "function", "metadata", "device", "state", "tensor_pos", "tensor_keys", "scalar_pos",
                 "scalars", "scalar_types", "other_pos", "other_spec")

    def __init__(self, ready: "ReadyKernel", compiled, device, state: tuple, args: tuple):
        import torch

        self.run = compiled.run  # the launcher (the JIT's launch loaded the binary)
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.device, self.state = device, state
        self.tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.scalar_pos = tuple(i for i, a in enumerate(args) if type(a) in _SCALAR_TYPES)
        self.other_pos = tuple(i for i in range(len(args)) if i not in self.tensor_pos and i not in self.scalar_pos)
        self.tensor_keys = _tensor_keys(args, self.tensor_pos)
        self.scalars = tuple([args[i] for i in self.scalar_pos])
        self.scalar_types = tuple(map(type, self.scalars))
        self.other_spec = ready.other_spec(args, self.other_pos)


def _tensor_keys(args: tuple, positions: tuple) -> list:
    return [(args[i].dtype, args[i].data_ptr() % 16 == 0) for i in positions]


class ReadyKernel:
    """``kernel[grid](*args, **const)`` for one fixed ``grid`` and ``const`` (the kernel's trailing parameters by
    name, constexprs and fixed values, plus launch options such as ``num_warps``); ``args`` are its leading
    parameters, in order, per call.  Returns nothing (the kernels write their outputs)."""

    def __init__(self, kernel, grid, **const):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.const = const
        self._launch = kernel[self.grid]
        self._variant = None
        self._params = None  # set when the fast path may be taken (the kernel's leading parameters)
        params = _kernel_params(kernel) if ENABLED and not interpreting() else None
        if params is None or not (1 <= len(self.grid) <= 3 and all(type(g) is int for g in self.grid)):
            return
        names = [p.name for p in params]
        fixed_at = [i for i, name in enumerate(names) if name in const]
        num_args = min(fixed_at) if fixed_at else len(names)
        tail = []
        for p in params[num_args:]:  # the fixed parameters must be exactly the trailing ones (or defaults)
            if p.name in const:
                tail.append(const[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        self._tail = tuple(tail)
        self._grid3 = (self.grid + (1, 1))[:3]
        self._params = params[:num_args]

    def other_spec(self, args: tuple, positions: tuple) -> list:
        """Triton's own specialization of ``args`` at ``positions`` (what its binder computes for them)."""
        backend = self._backend
        params = self._params
        return [_specialize(backend, args[i], params[i].is_const, not params[i].do_not_specialize,
                            not params[i].do_not_specialize_on_alignment) for i in positions]

    def _state(self):
        """What the JIT reads besides the arguments, ``(device, state)``; None when a hook asks for the JIT."""
        rt = _knobs.runtime
        kernel = self.kernel
        if (kernel.pre_run_hooks or rt.add_stages_inspection_hook is not None
                or not _hooks_empty(rt.launch_enter_hook) or not _hooks_empty(rt.launch_exit_hook)):
            return None
        for (name, _), (val, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, self) != val:
                return None  # the JIT path raises its error
        drv = _driver.active
        return drv.get_current_device(), (rt.debug, _knobs.compilation.instrumentation_mode, drv)

    def __call__(self, *args):
        v = self._variant
        if v is not None:
            st = self._state()
            if st is not None and st[0] == v.device and st[1] == v.state and self._same_variant(v, args):
                g0, g1, g2 = self._grid3
                v.run(g0, g1, g2, st[1][2].get_current_stream(v.device), v.function, v.metadata, None, None, None,
                      *args, *self._tail)
                return
        self._jit(args)

    def _same_variant(self, v: _Variant, args: tuple) -> bool:
        """Whether ``args`` look like the call ``v`` was remembered from (see the module docstring)."""
        if len(args) != len(self._params):
            return False
        try:
            scalars = tuple([args[i] for i in v.scalar_pos])
            return (_tensor_keys(args, v.tensor_pos) == v.tensor_keys and scalars == v.scalars
                    and tuple(map(type, scalars)) == v.scalar_types
                    and (not v.other_pos or self.other_spec(args, v.other_pos) == v.other_spec))
        except Exception:  # e.g. not a tensor where the variant had one: the JIT path decides (and names it)
            return False

    def _jit(self, args: tuple):
        """Triton's path; remembers the variant it launched when the fast path can take it next time."""
        global jit_launches
        jit_launches += 1
        compiled = self._launch(*args, **self.const)
        if self._params is None or len(args) != len(self._params) or not isinstance(compiled, _CompiledKernel):
            return
        st = self._state()
        caches = self.kernel.device_caches
        if st is None or st[0] not in caches:
            return
        self._backend = caches[st[0]][3]  # the backend the binder specializes with
        try:
            self._variant = _Variant(self, compiled, st[0], st[1], args)
        except Exception:  # an argument Triton accepted that this module does not know: the JIT path stays
            self._variant = None
