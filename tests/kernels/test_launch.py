"""``kernels/launch.py``: the ready kernel's choice between its fast path and Triton's JIT path.

CPU: a real ``JITFunction`` whose JIT launch and compiled variant are fakes (they record their calls), so every
decision is visible: a specialization change, a hook, another device or a Triton without the expected internals
sends the call to the JIT path; the same specialization takes the fast path with the arguments in the kernel's
order (tensors as their addresses where the launch is Triton's C function called directly).  GPU (``-m gpu``):
the fast path launches the same variant as the JIT path, bit for bit, also under CUDA graph capture, and a
misaligned pointer falls back.
"""

import copy

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from vllm_nvfp4_sm120.kernels import launch
from vllm_nvfp4_sm120.kernels.launch import ReadyKernel


def _toy(x_ptr, y_ptr, n, stride, n_dns, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class FakeCompiled:
    """A compiled variant: its launcher records what it was given."""

    def __init__(self, tag):
        self.tag, self.function, self.packed_metadata, self.launches = tag, f"fn{tag}", f"meta{tag}", []

    def run(self, *args):
        self.launches.append(args)


class FakeDriver:
    def __init__(self):
        self.device, self.streams = 0, []

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        self.streams.append(device)
        return 1000 + device


@pytest.fixture
def fake(monkeypatch):
    """A JIT function whose JIT launch returns a new FakeCompiled per call (and counts the calls)."""
    kernel = JITFunction(_toy, do_not_specialize=["n_dns"])
    drv = FakeDriver()
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_CompiledKernel", FakeCompiled)
    monkeypatch.setattr(launch._driver, "_active", drv, raising=False)
    kernel.device_caches[0] = ({}, {}, None, BaseBackend, None)
    kernel.device_caches[1] = ({}, {}, None, BaseBackend, None)
    jit_calls = []

    def run(*args, grid, warmup, **kwargs):
        jit_calls.append((grid, args, kwargs))
        return FakeCompiled(len(jit_calls))

    kernel.run = run
    kernel.jit_calls = jit_calls
    kernel.drv = drv
    return kernel


def _args(n=64, dtype=torch.float16, offset=0):
    x = torch.zeros(256, dtype=dtype)[offset:]
    y = torch.zeros(256, dtype=dtype)
    return x, y, n, 32, 17, 0.5


def _launches(ready):
    """The fast-path launches of the variant the ready kernel remembers."""
    return ready._variant.run.__self__.launches


def test_first_call_jit_then_fast_path_in_kernel_order(fake):
    ready = ReadyKernel(fake, (3, 2), BLOCK=16, num_warps=4)
    args = _args()
    ready(*args)
    assert len(fake.jit_calls) == 1
    grid, jargs, kwargs = fake.jit_calls[0]
    assert grid == (3, 2) and jargs == args and kwargs == {"BLOCK": 16, "num_warps": 4}
    assert ready._variant is not None
    ready(*args)
    ready(*args)
    assert len(fake.jit_calls) == 1
    # The launcher gets the grid, the stream, the function and metadata, no launch metadata or hooks, and every
    # parameter in the kernel's order: the call's arguments, the fixed ones, the defaults.
    assert _launches(ready) == [(3, 2, 1, 1000, "fn1", "meta1", None, None, None, *args, 16, False)] * 2


@pytest.mark.parametrize("change", [
    "misaligned", "dtype", "int_divisibility", "int_one", "int_to_bool", "int_width", "float_to_int", "tensor_to_int",
])
def test_specialization_change_takes_jit_path(fake, change):
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    first = ready._variant
    x, y, n, stride, n_dns, scale = _args()
    changed = {
        "misaligned": lambda: (torch.zeros(256, dtype=torch.float16)[1:], y, n, stride, n_dns, scale),
        "dtype": lambda: (x.to(torch.bfloat16), y, n, stride, n_dns, scale),
        "int_divisibility": lambda: (x, y, 65, stride, n_dns, scale),
        "int_one": lambda: (x, y, 1, stride, n_dns, scale),
        "int_to_bool": lambda: (x, y, n, stride, True, scale),
        "int_width": lambda: (x, y, n, stride, 2**40, scale),
        "float_to_int": lambda: (x, y, n, stride, n_dns, 16),
        "tensor_to_int": lambda: (x, 64, n, stride, n_dns, scale),
    }[change]()
    ready(*changed)
    assert len(fake.jit_calls) == 2, "a different specialization must go through the JIT"
    assert ready._variant is not first, "and its variant is the one remembered"
    ready(*_args())
    assert len(fake.jit_calls) == 3, "back to the first specialization: the JIT again"
    assert first.run.__self__.launches == []


@pytest.mark.parametrize("same", ["new_tensors", "aligned_offset"])
def test_same_specialization_takes_fast_path(fake, same):
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    args = {"new_tensors": _args, "aligned_offset": lambda: _args(offset=8)}[same]()  # 16 bytes in: aligned
    ready(*args)
    assert len(fake.jit_calls) == 1
    assert _launches(ready)[-1][9:] == (*args, 16, False)


@pytest.mark.parametrize("change", ["dns_int", "float_value"])
def test_other_scalar_goes_through_jit_once(fake, change):
    """A scalar value the variant does not depend on: the JIT picks (here: the same) variant, which is then the
    one remembered for the new value."""
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    x, y, n, stride, n_dns, scale = _args()
    args = (x, y, n, stride, 31, scale) if change == "dns_int" else (x, y, n, stride, n_dns, 0.25)
    ready(*args)
    ready(*args)
    assert len(fake.jit_calls) == 2
    assert _launches(ready) == [(1, 1, 1, 1000, "fn2", "meta2", None, None, None, *args, 16, False)]


class Desc:
    """Stands for a TMA descriptor: an argument that is neither a tensor nor a plain scalar."""

    def __init__(self, block):
        self.block = block


def test_other_arguments_use_tritons_specialization(fake, monkeypatch):
    seen = []

    def spec(backend, arg, is_const, specialize, align):
        seen.append(arg)
        return ("tensordesc", arg.block) if isinstance(arg, Desc) else ("?", None)

    monkeypatch.setattr(launch, "_specialize", spec)
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    x, y, n, stride, n_dns, scale = _args()
    ready(x, Desc(16), n, stride, n_dns, scale)
    ready(x, Desc(16), n, stride, n_dns, scale)
    assert len(fake.jit_calls) == 1 and len(seen) == 2, "a new descriptor with the same block: fast path"
    ready(x, Desc(32), n, stride, n_dns, scale)
    assert len(fake.jit_calls) == 2, "another block: another variant"


def test_misaligned_variant_is_remembered(fake):
    """A kernel launched on a misaligned pointer: the JIT compiles that variant, and the fast path then takes it."""
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args(offset=1))
    ready(*_args(offset=3))
    assert len(fake.jit_calls) == 1
    assert len(_launches(ready)) == 1


def test_hooks_and_knobs_take_jit_path(fake, monkeypatch):
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    hook = lambda metadata: None  # noqa: E731
    launch._knobs.runtime.launch_enter_hook.add(hook)
    try:
        ready(*_args())
        assert len(fake.jit_calls) == 2, "a launch hook (a profiler) must see the launch"
    finally:
        launch._knobs.runtime.launch_enter_hook.remove(hook)
    ready(*_args())
    assert len(fake.jit_calls) == 2, "hook gone: fast path again"
    monkeypatch.setattr(launch._knobs.runtime, "debug", True)
    ready(*_args())
    assert len(fake.jit_calls) == 3, "debug mode compiles another variant"
    monkeypatch.setattr(launch._knobs.runtime, "debug", False)
    fake.pre_run_hooks.append(lambda *a, **k: None)
    ready(*_args())
    assert len(fake.jit_calls) == 4, "a pre-run hook must run"


def test_other_device_takes_jit_path(fake):
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    fake.drv.device = 1
    ready(*_args())
    assert len(fake.jit_calls) == 2
    ready(*_args())
    assert len(fake.jit_calls) == 2 and fake.drv.streams[-1] == 1, "the stream of the current device"


def test_changed_global_takes_jit_path(fake):
    scope = {"G": 1}
    fake.used_global_vals[("G", id(scope))] = (1, scope)
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    ready(*_args())
    assert len(fake.jit_calls) == 1
    scope["G"] = 2
    ready(*_args())
    assert len(fake.jit_calls) == 2, "the JIT path raises its error for a changed global"


@pytest.mark.parametrize("why", ["no_internals", "interpreter", "not_a_jit_function", "callable_grid",
                                 "fixed_not_trailing", "missing_internal"])
def test_without_expected_triton_always_jit_path(fake, monkeypatch, why):
    kernel, grid, const = fake, (1,), dict(BLOCK=16)
    if why == "no_internals":
        monkeypatch.setattr(launch, "_JITFunction", None)
    elif why == "interpreter":
        monkeypatch.setattr(launch, "interpreting", lambda: True)
    elif why == "not_a_jit_function":
        class Wrapper:  # e.g. an autotuner around the kernel
            def __getitem__(self, grid):
                return lambda *a, **kw: fake.run(*a, grid=grid, warmup=False, **kw)
        kernel = Wrapper()
    elif why == "callable_grid":
        grid = lambda meta: (1,)  # noqa: E731
    elif why == "fixed_not_trailing":
        const = dict(BLOCK=16, n=64)
    elif why == "missing_internal":
        monkeypatch.delattr(type(launch._knobs.runtime), "add_stages_inspection_hook")
    if why == "callable_grid":
        with pytest.raises(TypeError):  # a ready kernel's grid is fixed: a callable one is not a grid
            ReadyKernel(kernel, grid, **const)
        return
    ready = ReadyKernel(kernel, grid, **const)
    args = _args()[:2] + _args()[3:] if why == "fixed_not_trailing" else _args()
    for _ in range(3):
        ready(*args)
    assert len(fake.jit_calls) == 3
    assert ready._variant is None


def test_jit_result_not_a_compiled_kernel_is_not_remembered(fake):
    fake.run = lambda *a, grid, warmup, **kw: fake.jit_calls.append(a)  # returns None (e.g. a compile hook's)
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    ready(*_args())
    assert len(fake.jit_calls) == 2 and ready._variant is None


class FakeCudaLauncher:
    """Triton's CUDA launcher as the fast path sees it: the C launch function and what it needs."""

    def __init__(self, scratch=0, gsan=False):
        self.global_scratch_size, self.profile_scratch_size, self.gsan_enabled = scratch, 0, gsan
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.arg_annotations, self.kernel_signature = "annotations", b"signature"
        self.launches, self.calls = [], []

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, *args):
        self.calls.append(args)


class CudaLike(torch.Tensor):
    """A CPU tensor that says it is on the GPU (the direct launch reads only its address)."""

    @property
    def is_cuda(self):
        return True


def _cuda_like_args():
    x, y, *scalars = _args()
    return (x.as_subclass(CudaLike), y.as_subclass(CudaLike), *scalars)


@pytest.fixture
def direct(fake, monkeypatch):
    """The fake kernel with Triton's CUDA launcher in its compiled variants (no scratch: the direct launch)."""
    launchers = []

    class Compiled(FakeCompiled):
        def __init__(self, tag):
            super().__init__(tag)
            self.run = FakeCudaLauncher(**fake.launcher_kwargs)
            launchers.append(self.run)

    monkeypatch.setattr(launch, "_CompiledKernel", Compiled)
    fake.launcher_kwargs = {}
    fake.run = lambda *args, grid, warmup, **kwargs: (fake.jit_calls.append((grid, args, kwargs)),
                                                      Compiled(len(fake.jit_calls)))[1]
    fake.launchers = launchers
    return fake


def test_direct_launch_passes_addresses(direct):
    ready = ReadyKernel(direct, (3, 2), BLOCK=16)
    args = _cuda_like_args()
    ready(*args)
    ready(*args)
    assert len(direct.jit_calls) == 1
    launcher = direct.launchers[0]
    assert launcher.calls == [], "the C launch function, not the Python wrapper around it"
    x, y, *scalars = args
    # The grid, the stream, the function, cooperative / PDL, metadata, no launch metadata, hooks or scratch, the
    # annotations and signature, then every parameter: the tensors as their addresses, the scalars, the fixed ones.
    assert launcher.launches == [(3, 2, 1, 1000, "fn1", False, True, "meta1", None, None, None, None, None,
                                  "annotations", b"signature", [x.data_ptr(), y.data_ptr(), *scalars, 16, False])]


def test_direct_launch_cpu_tensor_takes_jit_path(direct):
    ready = ReadyKernel(direct, (1,), BLOCK=16)
    ready(*_cuda_like_args())
    ready(*_args())  # a plain CPU tensor: an address the GPU cannot read; the JIT path raises Triton's error
    assert len(direct.jit_calls) == 2
    assert direct.launchers[0].launches == []


@pytest.mark.parametrize("launcher", [dict(scratch=128), dict(gsan=True)])
def test_launcher_with_scratch_or_sanitizer_is_called_whole(direct, launcher):
    direct.launcher_kwargs = launcher
    ready = ReadyKernel(direct, (1,), BLOCK=16)
    args = _cuda_like_args()
    ready(*args)
    ready(*args)
    assert len(direct.jit_calls) == 1
    run = direct.launchers[0]
    assert run.launches == [] and run.calls == [(1, 1, 1, 1000, "fn1", "meta1", None, None, None, *args, 16, False)]


@pytest.mark.parametrize("fixed", [("scale",), ("n_dns", "scale"), ("n", "stride", "n_dns", "scale")])
def test_fixed_runtime_scalars_are_in_every_launch(direct, fixed):
    """Runtime scalars fixed when the ready kernel is made: the JIT gets them by name, the direct launch in the
    kernel's order after the per-call tensors."""
    x, y, *scalars = _cuda_like_args()
    values = dict(zip(("n", "stride", "n_dns", "scale"), scalars))
    per_call = [values[n] for n in ("n", "stride", "n_dns", "scale") if n not in fixed]
    ready = ReadyKernel(direct, (2,), **{n: values[n] for n in fixed}, BLOCK=16)
    ready(x, y, *per_call)
    assert direct.jit_calls == [((2,), (x, y, *per_call), {**{n: values[n] for n in fixed}, "BLOCK": 16})]
    x2, y2 = (torch.zeros(64, dtype=torch.float16).as_subclass(CudaLike) for _ in range(2))
    ready(x2, y2, *per_call)
    assert len(direct.jit_calls) == 1
    assert direct.launchers[0].launches[-1][-1] == [x2.data_ptr(), y2.data_ptr(), *scalars, 16, False]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "cpu", "not_a_tensor", "int_to_fixed_position"])
def test_fixed_scalars_keep_the_tensor_checks(direct, change):
    ready = ReadyKernel(direct, (1,), n=64, stride=32, n_dns=17, scale=0.5, BLOCK=16)
    x, y = _cuda_like_args()[:2]
    ready(x, y)
    odd = {"misaligned": lambda: (torch.zeros(256, dtype=torch.float16)[1:].as_subclass(CudaLike), y),
           "dtype": lambda: (x.to(torch.bfloat16).as_subclass(CudaLike), y),
           "cpu": lambda: (torch.zeros(256, dtype=torch.float16), y),
           "not_a_tensor": lambda: (x, 64),
           "int_to_fixed_position": lambda: (x, y, 64)}[change]()
    ready(*odd)
    assert len(direct.jit_calls) == 2, "another specialization (or a wrong call): the JIT path"
    assert direct.launchers[0].launches == []


@pytest.mark.parametrize("second", ["same_object", "equal_tensor", "other_dtype", "misaligned"])
def test_tensor_passed_twice(direct, second):
    """A tensor passed again (a stand-in for an unused pointer) is checked once when it is the same object; any
    other tensor there gets the full check."""
    ready = ReadyKernel(direct, (1,), BLOCK=16)
    x, y, *scalars = _cuda_like_args()
    ready(x, x, *scalars)
    other = {"same_object": lambda: x, "equal_tensor": lambda: y,
             "other_dtype": lambda: y.to(torch.bfloat16).as_subclass(CudaLike),
             "misaligned": lambda: torch.zeros(256, dtype=torch.float16)[1:].as_subclass(CudaLike)}[second]()
    ready(x, other, *scalars)
    fast = second in ("same_object", "equal_tensor")
    assert len(direct.jit_calls) == (1 if fast else 2)
    if fast:
        assert direct.launchers[0].launches[-1][-1] == [x.data_ptr(), other.data_ptr(), *scalars, 16, False]


@pytest.mark.parametrize("change", ["value_reassigned", "replaced_equal", "replaced_other", "deleted",
                                    "list_mutated", "tuple_replaced"])
def test_used_globals(fake, change):
    """The kernel's globals as the JIT checks them: any change of value takes the JIT path (whose check raises);
    an equal replacement does not."""
    scope = {"C": tl.constexpr("ptx"), "L": [1, 2], "T": (1, "a")}
    for name in scope:
        fake.used_global_vals[(name, id(scope))] = (copy.deepcopy(scope[name]), scope)
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    ready(*_args())
    assert len(fake.jit_calls) == 1
    if change == "value_reassigned":
        scope["C"].value = "other ptx"
    elif change == "replaced_equal":
        scope["C"] = tl.constexpr("ptx")
    elif change == "replaced_other":
        scope["C"] = tl.constexpr("other ptx")
    elif change == "deleted":
        del scope["C"]
    elif change == "list_mutated":
        scope["L"].append(3)
    elif change == "tuple_replaced":
        scope["T"] = (1, "b")
    ready(*_args())
    assert len(fake.jit_calls) == (1 if change == "replaced_equal" else 2)


def test_wrong_arguments_reach_the_jit_errors(fake):
    ready = ReadyKernel(fake, (1,), BLOCK=16)
    ready(*_args())
    ready(*_args()[:-1])  # one argument short: the JIT path (whose binder raises on a real kernel)
    assert len(fake.jit_calls) == 2


# ---- the interpreter and the GPU: the real JIT ------------------------------------------------------------------

@triton.jit(do_not_specialize=["n_dns"])
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, n_dns, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, (a * x.to(tl.float32) + y.to(tl.float32) + n_dns).to(out_ptr.dtype.element_ty), mask=mask)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _axpy_inputs(n, dtype, offset=0):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n + offset, generator=gen).to(dtype).to(DEVICE)[offset:]
    y = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    return x, y


def _axpy_ref(x, y, n_dns, a):
    return (a * x.float() + y.float() + n_dns).to(x.dtype)


def test_ready_kernel_matches_jit_launch_in_interpreter():
    if torch.cuda.is_available():
        pytest.skip("the interpreter case; the GPU tests below cover CUDA")
    n = 40
    x, y = _axpy_inputs(n, torch.float16)
    ready = ReadyKernel(_axpy_kernel, (triton.cdiv(n, 16),), BLOCK=16)
    assert ready._params is None, "the interpreter: the JIT path only"
    for n_dns in (3, 5):
        out = torch.empty_like(x)
        ready(x, y, out, n, n_dns, 0.5)
        torch.testing.assert_close(out, _axpy_ref(x, y, n_dns, 0.5), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 48, 1000])
def test_fast_path_equals_jit_path(dtype, n):
    x, y = _axpy_inputs(n, dtype)
    grid = (triton.cdiv(n, 128),)
    ready = ReadyKernel(_axpy_kernel, grid, BLOCK=128, num_warps=4)
    want = torch.empty_like(x)
    _axpy_kernel[grid](x, y, want, n, 7, 0.75, BLOCK=128, num_warps=4)
    outs = [torch.empty_like(x) for _ in range(3)]
    ready(x, y, outs[0], n, 7, 0.75)
    assert ready._variant is not None, "the fast path must be available on a GPU with Triton 3.8"
    assert ready._variant.direct is not None, "and its direct launch (no scratch memory in this kernel)"
    jit = ready._launch
    ready._launch = None  # the next calls must not reach the JIT
    for out in outs[1:]:
        ready(x, y, out, n, 7, 0.75)
    ready._launch = jit
    for out in outs:
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_misaligned_pointer_falls_back_and_is_exact():
    n = 1000
    ready = ReadyKernel(_axpy_kernel, (triton.cdiv(n, 128),), BLOCK=128)
    x, y = _axpy_inputs(n, torch.float16)
    ready(x, y, torch.empty_like(x), n, 1, 2.0)
    aligned = ready._variant
    xm, ym = _axpy_inputs(n, torch.float16, offset=1)  # x 2 bytes off 16-byte alignment
    assert xm.data_ptr() % 16
    out = torch.empty_like(xm)
    ready(xm, ym, out, n, 1, 2.0)
    assert ready._variant is not aligned, "the misaligned call must compile (or find) its own variant"
    torch.testing.assert_close(out, _axpy_ref(xm, ym, 1, 2.0), rtol=0, atol=0)
    out2 = torch.empty_like(xm)
    ready(xm, ym, out2, n, 1, 2.0)  # the misaligned variant's fast path
    assert torch.equal(out2, out)
    out3 = torch.empty_like(x)
    ready(x, y, out3, n, 1, 2.0)  # aligned again: the aligned variant
    torch.testing.assert_close(out3, _axpy_ref(x, y, 1, 2.0), rtol=0, atol=0)


@pytest.mark.gpu
def test_fast_path_under_cuda_graph_capture():
    n = 1000
    x, y = _axpy_inputs(n, torch.bfloat16)
    ready = ReadyKernel(_axpy_kernel, (triton.cdiv(n, 128),), BLOCK=128)
    out = torch.empty_like(x)
    ready(x, y, out, n, 2, 1.5)  # compile outside the capture
    assert ready._variant is not None
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ready(x, y, out, n, 2, 1.5)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out) == 0, "captured on the capture stream, not run on another"
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _axpy_ref(x, y, 2, 1.5), rtol=0, atol=0)
    x.copy_(torch.randn(n, device=DEVICE).to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _axpy_ref(x, y, 2, 1.5), rtol=0, atol=0)
