"""Ready kernels: one Triton/Gluon kernel with its grid and compile-time arguments fixed, launched without
Triton's per-call argument binding once it has run.

``kernel[grid](*args, **const)`` costs, per call, Triton's binder over every argument (constexprs included), the
cache key, the launch metadata and the launch hooks, before the launch itself.  A launcher whose grid and
constexprs are fixed (the ``prepare_*`` functions) knows most of that once.  :class:`ReadyKernel` launches through
the JIT the first time (which compiles or finds the variant and returns it) and then calls the compiled variant's
launcher directly with the call's arguments, when it can tell that the JIT would pick that same variant:

* the variant depends on the *specialization* of the runtime arguments: a tensor's dtype and whether its address
  is 16-byte aligned (not for ``do_not_specialize`` / ``do_not_specialize_on_alignment`` parameters), an int's
  type width and whether it is 1 or divisible by 16 (not for ``do_not_specialize``), a ``None`` (a constexpr), a
  TMA descriptor's dtype and block.  Tensors are compared by dtype and alignment, other scalars by type and value
  (equal values specialize equally); when either differs, Triton's own specialization function decides, and a
  different variant goes through the JIT again (which compiles or finds it) and is remembered instead;
* the JIT's own state: the current device, no launch hooks (a profiler's), no pre-run or stage-inspection hooks,
  the same debug and instrumentation modes, the kernel's globals unchanged.  Otherwise the call takes the JIT path.

Anything unexpected about Triton (another version's internals, the interpreter, an autotuner) means the JIT path on
every call: slower, never different.  The stream is the current one (Triton's own query, as the JIT's).
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

# Arguments compared by type and value: equal ones specialize equally.
_SCALAR_TYPES = (int, float, bool, type(None))


def _hooks_empty(hook) -> bool:
    return hook is None or (type(hook) is _HookChain and not hook.calls)


class _Variant:
    """What the fast path needs of one compiled variant, and what it was compiled for."""

    __slots__ = ("run", "function", "metadata", "device", "state", "backend", "tensor_pos", "tensor_keys",
                 "scalar_pos", "scalars", "scalar_types", "other_pos", "spec")

    def __init__(self, ready: "ReadyKernel", compiled, device, state: tuple, backend, args: tuple):
        self.run = compiled.run  # the launcher (the JIT's launch loaded the binary)
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.device = device
        self.state = state
        self.backend = backend
        self.tensor_pos = tuple(i for i, a in enumerate(args) if ready.is_tensor(a))
        self.scalar_pos = tuple(i for i, a in enumerate(args) if type(a) in _SCALAR_TYPES)
        self.other_pos = tuple(i for i in range(len(args)) if i not in self.tensor_pos and i not in self.scalar_pos)
        self.tensor_keys = ready.tensor_keys(args, self.tensor_pos)
        self.scalars = tuple(args[i] for i in self.scalar_pos)
        self.scalar_types = tuple(map(type, self.scalars))
        self.spec = ready.spec(backend, args)


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
        self._fast = self._supported()
        if self._fast:
            params = kernel.params
            names = [p.name for p in params]
            tail = [i for i, p in enumerate(names) if p in const]
            # The fixed parameters must be exactly the trailing ones (defaults fill the rest of the tail).
            self._num_args = min(tail) if tail else len(names)
            fixed = []
            for p in params[self._num_args:]:
                if p.name in const:
                    fixed.append(const[p.name])
                elif p.has_default:
                    fixed.append(p.default)
                else:
                    self._fast = False
                    break
            self._tail = tuple(fixed)
            self._params = params[:self._num_args]
            self._grid3 = (self.grid + (1, 1))[:3]

    def _supported(self) -> bool:
        """Whether the fast path may ever be taken: a plain JIT function (no autotuner, no interpreter), a grid of
        ints, the Triton internals found."""
        if _JITFunction is None or not isinstance(self.kernel, _JITFunction) or interpreting():
            return False
        if not (1 <= len(self.grid) <= 3 and all(type(g) is int for g in self.grid)):
            return False
        kernel, rt = self.kernel, _knobs.runtime
        try:
            for p in kernel.params:
                p.name, p.is_const, p.do_not_specialize, p.do_not_specialize_on_alignment, p.has_default
            kernel.pre_run_hooks, kernel.used_global_vals.items, kernel.device_caches
            rt.add_stages_inspection_hook, rt.launch_enter_hook, rt.launch_exit_hook, rt.debug
            _knobs.compilation.instrumentation_mode
            _driver.active.get_current_device, _driver.active.get_current_stream
        except Exception:
            return False
        return True

    # ---- the specialization the variant depends on ----------------------------------------------------------
    @staticmethod
    def is_tensor(a) -> bool:
        import torch

        return isinstance(a, torch.Tensor)

    @staticmethod
    def tensor_keys(args: tuple, positions: tuple) -> list:
        return [(args[i].dtype, args[i].data_ptr() % 16 == 0) for i in positions]

    def spec(self, backend, args: tuple) -> list:
        """Triton's own specialization of ``args`` (what its binder computes for them, before it applies type
        annotations: comparing these is at least as strict)."""
        return [_specialize(backend, a, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                for a, p in zip(args, self._params)]

    def _state(self):
        """What the JIT reads besides the arguments: ``(device, state)``, or None when a hook asks for the JIT."""
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

    # ---- the launch ---------------------------------------------------------------------------------------------
    def __call__(self, *args):
        v = self._variant
        if v is not None:
            st = self._state()
            if st is not None and st[0] == v.device and st[1] == v.state and self._same_variant(v, args):
                g0, g1, g2 = self._grid3
                drv = st[1][2]
                v.run(g0, g1, g2, drv.get_current_stream(v.device), v.function, v.metadata, None, None, None,
                      *args, *self._tail)
                return
        self._jit(args)

    def _same_variant(self, v: _Variant, args: tuple) -> bool:
        """Whether the JIT would launch ``v`` for ``args``; any surprise (another kind of argument) says no."""
        if len(args) != self._num_args:
            return False
        try:
            if self.tensor_keys(args, v.tensor_pos) != v.tensor_keys:
                return self.spec(v.backend, args) == v.spec
            scalars = tuple([args[i] for i in v.scalar_pos])
            if scalars != v.scalars or tuple(map(type, scalars)) != v.scalar_types or v.other_pos:
                return self.spec(v.backend, args) == v.spec
        except Exception:  # e.g. not a tensor where the variant had one: the JIT path decides (and names it)
            return False
        return True

    def _jit(self, args: tuple):
        """Triton's path; remembers the variant it launched when the fast path can take it next time."""
        compiled = self._launch(*args, **self.const)
        if not self._fast or len(args) != self._num_args or not isinstance(compiled, _CompiledKernel):
            return
        st = self._state()
        if st is None:
            return
        device, state = st
        caches = self.kernel.device_caches
        if device not in caches:
            return
        self._variant = _Variant(self, compiled, device, state, caches[device][3], args)
