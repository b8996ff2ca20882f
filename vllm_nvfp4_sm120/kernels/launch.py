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
  the same debug and instrumentation modes, the kernel's globals unchanged (:class:`_Globals`: what Triton
  compares, by identity where an object cannot change in place).  Otherwise the call takes the JIT path.

Runtime scalars a launcher knows when it makes the ready kernel (sizes, strides) belong in ``const`` too, as the
trailing parameters they are in the kernels here: the same on every call, so the specialization Triton derived from
them on the first call holds for every later one, and the per-call arguments (checked per call) are the tensors.

The fast path hands the compiled variant its arguments the way the C launcher reads them.  Where the variant's
launcher is Triton's CUDA one with no scratch memory and no sanitizer (the kernels here), it calls the C launch
function directly (the Python wrapper around it allocates scratch space per call) and passes each tensor as the
integer address it read anyway for the alignment check: for a tensor the launcher would call ``data_ptr()`` again
and ask the driver whether the address is a device pointer (``cuPointerGetAttribute``), per tensor and call.  So
the direct launch checks ``is_cuda`` itself (a CPU tensor takes the JIT path, which raises Triton's error).

Anything unexpected about Triton (another version's internals, the interpreter, an autotuner around the kernel)
means the JIT path on every call: slower, never different.  The stream is the current one, asked the way the JIT
asks.  ``ENABLED = False`` turns the fast path off for ready kernels made afterwards (benchmarks compare the two).
"""

from __future__ import annotations

from operator import attrgetter, itemgetter

from .common import interpreting

try:  # Triton's internals this module relies on (Triton 3.8); without any of them, always the JIT path.
    from triton import knobs as _knobs
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.compiler.compiler import CompiledKernel as _CompiledKernel
    from triton.knobs import HookChain as _HookChain
    from triton.language.core import constexpr as _constexpr
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except Exception:  # pragma: no cover - depends on the installed Triton
    _JITFunction = None

ENABLED = True
# False: variants remembered afterwards launch through Triton's Python launcher, tensors as tensors (benchmarks
# compare the two).
DIRECT = True
# Launches ready kernels sent through the JIT path (first calls, fallbacks), for benchmarks' diagnostics.
jit_launches = 0

_VALUE = attrgetter("value")
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


def _direct_launch(run):
    """``(launch, cooperative, pdl, annotations, signature)`` of Triton's CUDA launcher ``run`` when calling its C
    launch function directly is what ``run(...)`` would do (no scratch memory, no sanitizer), else None."""
    try:
        if run.global_scratch_size or run.profile_scratch_size or run.gsan_enabled:
            return None
        return run.launch, run.launch_cooperative_grid, run.launch_pdl, run.arg_annotations, run.kernel_signature
    except AttributeError:  # another backend's launcher, or another Triton's
        return None


_FROZEN = (str, int, float, bool, bytes, type(None))


def _frozen(value) -> bool:
    """Whether ``value`` cannot change in place (so the same object is the same value)."""
    return type(value) in _FROZEN or (type(value) is tuple and all(map(_frozen, value)))


class _Globals:
    """The kernel's used globals (``used_global_vals``) as checked per call: Triton compares each one's current value
    with its copy from the compilation, ``!=`` per global (for a ``tl.constexpr`` a Python call building another
    constexpr: ~1 µs each, and the decode kernels use ~20).  Here a global whose current object equals that copy and
    cannot change in place (a constexpr's ``value`` is checked as well: assignable) is checked by identity, a tuple
    comparison per globals dict (equal objects pass there too, as in Triton's comparison); any other global is
    compared as Triton does."""

    __slots__ = ("source", "size", "groups", "holders", "values", "slow")

    def __init__(self, used_global_vals: dict):
        self.source, self.size = used_global_vals, len(used_global_vals)  # the JIT's dict, as snapshotted
        groups, holders, values, slow = {}, [], [], []
        for (name, _), (val, scope) in used_global_vals.items():
            cur = scope.get(name, self)
            if cur != val:
                raise ValueError(name)  # the JIT path raises its error
            if _frozen(cur):
                pass
            elif type(cur) is _constexpr and _frozen(cur.value):
                holders.append(cur)
                values.append(cur.value)
            else:
                slow.append((name, val, scope))
                continue
            groups.setdefault(id(scope), (scope, [], []))
            groups[id(scope)][1].append(name)
            groups[id(scope)][2].append(cur)
        # itemgetter of one name returns the object, not a 1-tuple: a tuple of the names' objects either way
        self.groups = tuple((scope, itemgetter(*names, names[0]), (*objs, objs[0]))
                            for scope, names, objs in groups.values())
        self.holders, self.values, self.slow = tuple(holders), tuple(values), tuple(slow)

    def same(self, kernel) -> bool:
        if kernel.used_global_vals is not self.source or len(self.source) != self.size:
            return False
        try:
            for scope, get, objs in self.groups:
                if get(scope) != objs:
                    return False
        except KeyError:  # a global deleted: the JIT path raises its error
            return False
        if self.holders and tuple(map(_VALUE, self.holders)) != self.values:
            return False
        for name, val, scope in self.slow:
            if scope.get(name, self) != val:
                return False
        return True


class _Variant:
    """One compiled variant, its launcher and what the call it was remembered from looked like."""

    __slots__ = ("run", "direct", "function", "metadata", "device", "state", "globals", "tensors", "scalar_pos",
                 "scalars", "scalar_types", "other_pos", "other_spec")

    def __init__(self, ready: "ReadyKernel", compiled, device, state: tuple, args: tuple):
        import torch

        self.run = compiled.run  # the launcher (the JIT's launch loaded the binary)
        self.direct = _direct_launch(self.run) if DIRECT else None
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.device, self.state = device, state
        self.globals = _Globals(ready.kernel.used_global_vals)
        tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        # Per tensor: its position, dtype (torch dtypes are singletons: compared by identity), 16-byte alignment and
        # the position the same object was first at (a launcher's stand-in for an unused pointer passes a tensor
        # again): checked there when it is the same object again.
        first = {}
        self.tensors = tuple((i, args[i].dtype, args[i].data_ptr() % 16 == 0, first.setdefault(id(args[i]), i))
                             for i in tensor_pos)
        self.scalar_pos = tuple(i for i, a in enumerate(args) if type(a) in _SCALAR_TYPES)
        self.other_pos = tuple(i for i in range(len(args)) if i not in tensor_pos and i not in self.scalar_pos)
        self.scalars = tuple([args[i] for i in self.scalar_pos])
        self.scalar_types = tuple(map(type, self.scalars))
        self.other_spec = ready.other_spec(args, self.other_pos)


class ReadyKernel:
    """``kernel[grid](*args, **const)`` for one fixed ``grid`` and ``const`` (the kernel's trailing parameters by
    name, constexprs and fixed runtime values, plus launch options such as ``num_warps``); ``args`` are its leading
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
        self._num_args = num_args
        self._grid3 = (self.grid + (1, 1))[:3]
        self._params = params[:num_args]

    def other_spec(self, args: tuple, positions: tuple) -> list:
        """Triton's own specialization of ``args`` at ``positions`` (what its binder computes for them)."""
        backend = self._backend
        params = self._params
        return [_specialize(backend, args[i], params[i].is_const, not params[i].do_not_specialize,
                            not params[i].do_not_specialize_on_alignment) for i in positions]

    def _state(self):
        """What the JIT reads besides the arguments and the globals, ``(device, state)``; None when a hook asks for
        the JIT."""
        rt = _knobs.runtime
        if (self.kernel.pre_run_hooks or rt.add_stages_inspection_hook is not None
                or not _hooks_empty(rt.launch_enter_hook) or not _hooks_empty(rt.launch_exit_hook)):
            return None
        drv = _driver.active
        return drv.get_current_device(), (rt.debug, _knobs.compilation.instrumentation_mode, drv)

    def __call__(self, *args):
        v = self._variant
        if v is not None:
            st = self._state()
            if st is not None and st[0] == v.device and st[1] == v.state and v.globals.same(self.kernel):
                kernel_args = self._kernel_args(v, args)
                if kernel_args is not None:
                    g0, g1, g2 = self._grid3
                    stream = st[1][2].get_current_stream(v.device)
                    if v.direct is not None:
                        launch, cooperative, pdl, annotations, signature = v.direct
                        launch(g0, g1, g2, stream, v.function, cooperative, pdl, v.metadata, None, None, None, None,
                               None, annotations, signature, kernel_args)
                    else:
                        v.run(g0, g1, g2, stream, v.function, v.metadata, None, None, None, *kernel_args)
                    return
        self._jit(args)

    def _kernel_args(self, v: _Variant, args: tuple) -> list | None:
        """Every parameter of the launch (``args``, then the fixed ones) when ``args`` look like the call ``v`` was
        remembered from (see the module docstring), tensors as their addresses where the launch is direct; else
        None (the JIT path decides)."""
        if len(args) != self._num_args:
            return None
        out = [*args, *self._tail]
        try:
            direct = v.direct is not None
            for i, dtype, aligned, j in v.tensors:
                a = args[i]
                if j != i and a is args[j]:  # the same object as at j again: checked there
                    out[i] = out[j]
                    continue
                ptr = a.data_ptr()
                if a.dtype is not dtype or (ptr % 16 == 0) is not aligned:
                    return None
                if direct:  # the C launcher's own check, in Python: a CPU tensor takes the JIT path
                    if not a.is_cuda:
                        return None
                    out[i] = ptr
            if v.scalar_pos:
                scalars = tuple([args[i] for i in v.scalar_pos])
                if scalars != v.scalars or tuple(map(type, scalars)) != v.scalar_types:
                    return None
            if v.other_pos and self.other_spec(args, v.other_pos) != v.other_spec:
                return None
        except Exception:  # e.g. not a tensor where the variant had one: the JIT path decides (and names it)
            return None
        return out

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


class StreamCounters:
    """The counters (an int32 control block) of one ready launch, one zeroed tensor per CUDA stream that launches it.

    For kernels that leave their counters zero: a tensor then serves every later launch *in order* after it
    (CUDA-graph replays included), but two launches that may overlap must not share one.  Launches on one stream
    never overlap, launches on two streams may (a model's side stream, two micro-batches), hence one tensor per
    stream: the stream a launch is queued on, also while a CUDA graph is captured (its nodes then keep that capture
    stream's tensor).  The lookup is a dict hit on the raw stream handle, the one Triton launches on.  Off CUDA
    (the interpreter) one tensor serves every call."""

    def __init__(self, numel: int, device):
        import torch

        self.numel, self.device = numel, torch.device(device)
        self._index = None
        if self.device.type == "cuda":
            self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.by_stream: dict = {}

    def get(self):
        import torch
        import triton

        stream = None if self._index is None else triton.runtime.driver.active.get_current_stream(self._index)
        cnt = self.by_stream.get(stream)
        if cnt is None:
            cnt = self.by_stream[stream] = torch.zeros(self.numel, dtype=torch.int32, device=self.device)
        return cnt
