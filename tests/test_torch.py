"""wsarena.torch on CPU tensors: the functions, modules and convert() against torch.nn.functional's convolutions
and their autograd gradients.

Tolerances: float64 results and gradients within 1e-10 of torch's, relative to the largest magnitude (of that
tensor; for a whole model's gradients, of the largest gradient of the model), float32 within 1e-4
(``torch.autograd.gradcheck`` with its own float64 defaults for the analytic-vs-numerical check); bfloat16 under
autocast within 2e-2 (two bfloat16 roundings of a float32 sum: the inputs' and the output's).
"""

import contextlib
import copy
import functools
import sys
import threading
import warnings

import numpy as np
import pytest

import wsarena
from wsarena import ops

torch = pytest.importorskip("torch")  # before the helpers, which import it
F = torch.nn.functional
wt = pytest.importorskip("wsarena.torch")

from .torch_models import small_resnet, step

TOL64 = 1e-10


def close(got, ref, tol=TOL64):
    scale = float(ref.detach().abs().max()) or 1.0
    return float((got.detach().double() - ref.detach().double()).abs().max()) / scale <= tol


def gradients(y, ref, inputs):
    """The gradients with respect to ``inputs`` of ``y`` and of ``ref``, for one random gradient of the output."""
    dy = torch.randn_like(ref)
    return torch.autograd.grad(y, inputs, dy), torch.autograd.grad(ref, inputs, dy)


CASES = [  # nd, input shape, weight shape, keyword arguments
    (1, (2, 4, 17), (6, 2, 3), {"stride": 2, "padding": 1, "dilation": 1, "groups": 2}),
    (2, (2, 4, 9, 8), (6, 4, 3, 2), {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 1}),
    (2, (1, 6, 7, 7), (6, 1, 3, 3), {"stride": 1, "padding": "same", "dilation": 1, "groups": 6}),  # depthwise
    (3, (1, 2, 5, 6, 5), (4, 2, 3, 3, 1), {"stride": 1, "padding": "valid", "dilation": 1, "groups": 1}),
    # one value in a sequence, which PyTorch takes for every dimension (as nn.Conv2d(..., stride=(2,)) passes it)
    (2, (2, 4, 9, 8), (6, 2, 3, 3), {"stride": (2,), "padding": [1], "dilation": (2,), "groups": 2}),
]
FUNCTIONS = {1: (wt.conv1d, F.conv1d), 2: (wt.conv2d, F.conv2d), 3: (wt.conv3d, F.conv3d)}


def tensors(x_shape, w_shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(w_shape, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(w_shape[0], dtype=dtype, generator=g).requires_grad_()
    return x, w, b


@pytest.mark.parametrize(("nd", "x_shape", "w_shape", "kw"), CASES)
def test_outputs_and_gradients_match_torch(nd, x_shape, w_shape, kw):
    ours, theirs = FUNCTIONS[nd]
    x, w, b = tensors(x_shape, w_shape)
    y, ref = ours(x, w, b, **kw), theirs(x, w, b, **kw)
    assert close(y, ref)
    got, expected = gradients(y, ref, (x, w, b))
    assert all(close(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize(("nd", "x_shape", "w_shape", "kw"), CASES)
def test_gradcheck_in_float64(nd, x_shape, w_shape, kw):
    ours, _ = FUNCTIONS[nd]
    x, w, b = tensors(x_shape, w_shape)
    assert torch.autograd.gradcheck(lambda x, w, b: ours(x, w, b, **kw), (x, w, b))


def test_forward_and_both_gradients_run_through_wsarenas_three_ops(monkeypatch):
    calls = []
    for name in ("conv_forward", "conv_backward_data", "conv_backward_filter"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x, w, b = tensors((2, 4, 9, 9), (6, 4, 3, 3))
    wt.conv2d(x, w, b, padding=1).sum().backward()
    assert calls == ["conv_forward", "conv_backward_data", "conv_backward_filter"]
    calls.clear()
    wt.conv2d(x.detach(), w, padding=1).sum().backward()  # no input gradient wanted: none computed
    assert calls == ["conv_forward", "conv_backward_filter"]


def _counted(monkeypatch):
    """The names of wsarena's ops as they are called, in order."""
    calls = []
    for name in ("conv_forward", "conv_backward_data", "conv_backward_filter"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def test_a_backward_computes_only_the_gradients_asked_for_as_torchs_does(monkeypatch):
    """``torch.autograd.grad(y, x)`` (an adversarial input, a saliency map) asks nothing of the weights, which still
    require gradients: PyTorch's convolution computes no weight gradient then, nor an input gradient for a weight's
    alone (``backward(inputs=...)`` alike), and neither does wsarena's."""
    calls = _counted(monkeypatch)
    torch.manual_seed(0)
    theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(),
                                 torch.nn.ConvTranspose2d(4, 2, 2, stride=2)).double()
    ours = wt.convert(copy.deepcopy(theirs))
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    asked = [  # what is asked for, and the passes its backward runs: the transposed layer's first
        (lambda m: [x], ["conv_forward", "conv_backward_data"]),
        (lambda m: [m[0].weight], ["conv_forward", "conv_backward_filter"]),
        (lambda m: [m[2].weight], ["conv_backward_filter"]),
        (lambda m: [x, m[0].bias], ["conv_forward", "conv_backward_data"]),
    ]
    for inputs, passes in asked:
        y = ours(x)
        calls.clear()
        got = torch.autograd.grad(y.pow(2).sum(), inputs(ours))
        assert calls == passes
        expected = torch.autograd.grad(theirs(x).pow(2).sum(), inputs(theirs))
        assert all(close(g, e) for g, e in zip(got, expected))
        y = ours(x)
        calls.clear()
        y.pow(2).sum().backward(inputs=inputs(ours))
        assert calls == passes
    # a gradient penalty of the input alone: no weight gradient at either order
    (dx,) = torch.autograd.grad(ours(x).pow(2).sum(), x, create_graph=True)
    calls.clear()
    (got,) = torch.autograd.grad(dx.pow(2).sum(), x)
    assert "conv_backward_filter" not in calls
    (dx,) = torch.autograd.grad(theirs(x).pow(2).sum(), x, create_graph=True)
    assert close(got, torch.autograd.grad(dx.pow(2).sum(), x)[0])
    # a frozen layer (its weight requires no gradient) under a trained one, on an input that requires none
    ours[0].weight.requires_grad_(False)
    y = ours(x.detach())
    calls.clear()
    y.pow(2).sum().backward()
    assert calls == ["conv_forward", "conv_backward_filter"]  # the transposed layer's; the frozen one's bias alone


def test_unbatched_input_as_torch_takes_it():
    x, w, b = tensors((4, 9, 9), (6, 4, 3, 3))
    y, ref = wt.conv2d(x, w, b, padding=1), F.conv2d(x, w, b, padding=1)
    assert y.shape == (6, 9, 9) and close(y, ref)
    got, expected = gradients(y, ref, (x, w, b))
    assert all(close(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("nd", [2, 3])
def test_channels_last_runs_as_nhwc_and_gives_torchs_memory_format(nd, dtype):
    """Channels-last results and gradients, as PyTorch's; but a 3-D float64 convolution's are contiguous, as
    PyTorch's CPU kernel for it writes them."""
    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    x, w, b = tensors((2, 4, *(7,) * nd), (6, 4, *(3,) * nd), dtype)
    xl = x.detach().to(memory_format=fmt).requires_grad_()
    wl = w.detach().to(memory_format=fmt).requires_grad_()
    ours, theirs = FUNCTIONS[nd]
    y, ref = ours(xl, wl, b, padding=1), theirs(xl, wl, b, padding=1)
    assert y.stride() == ref.stride()
    assert y.is_contiguous(memory_format=fmt) == (nd == 2 or dtype == torch.float32)
    tol = TOL64 if dtype == torch.float64 else 1e-4
    assert close(y, ref, tol)
    got, expected = gradients(y, ref, (xl, wl, b))
    assert all(close(g, e, tol) and g.stride() == e.stride() for g, e in zip(got, expected))


@pytest.mark.parametrize("nd", [2, 3])
def test_float64_channels_last_on_cuda_runs_contiguous_as_torchs(nd):
    """PyTorch computes a float64 convolution on CUDA contiguous whatever its operands' format (cuDNN's format for
    it, ``cudnn_conv_suggest_memory_format``, is contiguous for float64), a float32 one channels-last. Seen here on
    a FakeTensorMode's CUDA tensors, which need no GPU: the operators' fake kernels give the layout chosen
    (test_torch_gpu.py compares with PyTorch's own, gradients too, on a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    with FakeTensorMode():
        for dtype in (torch.float64, torch.float32):
            x = torch.empty(2, 4, *(7,) * nd, device="cuda", dtype=dtype).to(memory_format=fmt)
            w = torch.empty(6, 4, *(3,) * nd, device="cuda", dtype=dtype)
            y = FUNCTIONS[nd][0](x, w, padding=1)
            yt = getattr(wt, f"conv_transpose{nd}d")(x, w.transpose(0, 1), stride=2)
            for out in (y, yt):
                assert out.is_contiguous(memory_format=fmt) == (dtype == torch.float32)
                assert out.is_contiguous() == (dtype == torch.float64)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "last"),
    [
        ((2, 1, 7, 7), (6, 1, 3, 3), "xw"),  # one input channel, as a greyscale image in a channels-last model
        ((2, 4, 7, 7), (6, 4, 1, 1), "w"),  # a 1x1 kernel in channels-last memory beside a contiguous input
        ((2, 4, 7, 7), (6, 4, 3, 3), ""),
    ],
)
def test_tensors_channels_last_in_both_senses_run_in_the_format_torch_reads_from_their_strides(x_shape, w_shape, last):
    x, w, b = tensors(x_shape, w_shape)
    x, w = (t.detach().to(memory_format=torch.channels_last) if name in last else t.detach()
            for name, t in (("x", x), ("w", w)))
    y, ref = wt.conv2d(x, w, b, padding=1), F.conv2d(x, w, b, padding=1)
    assert close(y, ref)
    assert y.stride() == ref.stride()  # torch's own output is channels-last in the first two cases
    assert (y.stride()[1] == 1) == bool(last)


def check_cpu_autocast(ours, theirs, operands, **kw):
    """Under CPU autocast to bfloat16, ``ours(x, w, b, **kw)`` of the float32 ``operands`` gives the dtype and (within
    2e-2) the values of ``theirs``'s, and float32 gradients within 2e-2 of theirs."""
    x, w, b = (t.detach().float().requires_grad_() for t in operands)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x, w, b, **kw)
        ref = theirs(x, w, b, **kw)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert close(y, ref, 2e-2)
    got = torch.autograd.grad(y.float().sum(), (x, w, b))
    expected = torch.autograd.grad(ref.float().sum(), (x, w, b))
    assert all(g.dtype == torch.float32 for g in got)
    assert all(close(g, e, 2e-2) for g, e in zip(got, expected))


def test_autocast_on_the_cpu_gives_torchs_dtype_and_values():
    check_cpu_autocast(wt.conv2d, F.conv2d, tensors((2, 4, 9, 9), (6, 4, 3, 3)), padding=1)


def test_float64_is_left_alone_by_autocast_as_torch_leaves_it():
    x, w, b = tensors((1, 2, 5, 5), (3, 2, 3, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wt.conv2d(x, w, b).dtype == F.conv2d(x, w, b).dtype == torch.float64


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")  # torch's own, of its copy
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kernel", [2, 4, (3, 2, 1)])
def test_padding_same_with_an_even_kernel_pads_as_torch_pads(nd, kernel):
    """An odd total padding (an even kernel; an odd one with an odd dilation does not make it so) is one more at
    the end of the dimension, as torch's own convolution pads it, and a module with it converts."""
    kernel = kernel[:nd] if isinstance(kernel, tuple) else (kernel,) * nd
    x, w, b = tensors((2, 4, *(7,) * nd), (6, 2, *kernel))
    ours, theirs = FUNCTIONS[nd]
    kw = {"padding": "same", "dilation": (1, 3, 2)[:nd], "groups": 2}
    y, ref = ours(x, w, b, **kw), theirs(x, w, b, **kw)
    assert y.shape == ref.shape == (2, 6, *(7,) * nd) and close(y, ref)
    assert all(close(g, e) for g, e in zip(*gradients(y, ref, (x, w, b))))
    module = getattr(torch.nn, f"Conv{nd}d")(4, 6, kernel, **kw, dtype=torch.float64)
    expected = module(x)
    assert type(wt.convert(module)) is getattr(wt, f"Conv{nd}d") and close(module(x), expected)


@pytest.mark.parametrize("autocast", [False, True])
def test_meta_tensors_give_torchs_shapes_through_a_converted_model(autocast):
    """A model made on the meta device (to size it before allocating it) runs there as torch's own convolutions:
    autocast has no mode for that device, which is no error."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ConvTranspose2d(8, 4, 2, 2))
    model = model.to("meta")
    x = torch.empty(2, 3, 15, 15, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = model(x)
        y = wt.convert(model)(x)
    assert y.device.type == "meta" and y.shape == ref.shape == (2, 4, 16, 16) and y.dtype == ref.dtype


def _skip_unless_compiling_everywhere():
    """Skips the test, one of another thread compiling meanwhile, where ``torch.compiler.is_compiling()`` is true
    only in the frames Dynamo traces (PyTorch 2.11, 2.7): 2.13 holds it for the whole process while a compile runs,
    its backend's call included, and so for eager code on other threads, which it tests. Asked of a compile on this
    thread, before the test starts its own: on 2.11, a torch.compile on another thread left a later FakeTensorMode
    entered in a dual level to crash the process (a segmentation fault)."""
    if not _flag_held_through_the_compile():
        pytest.skip("this PyTorch holds torch.compiler.is_compiling() true only in the frames Dynamo traces, not "
                    "for the process while a compile runs: no eager call on another thread is taken for a compile")


@functools.cache
def _flag_held_through_the_compile():
    seen = []

    def backend(gm, example_inputs):
        seen.append(torch.compiler.is_compiling())
        return gm

    torch.compile(lambda t: t + 1, backend=backend)(torch.zeros(1))
    return seen == [True]


def _only_traced_frames_compiling(monkeypatch):
    """PyTorch before 2.13 (2.11, 2.7), simulated: ``torch.compiler.is_compiling()`` true only in the frames Dynamo
    traces (the compile session's flag left unset), and wsarena.torch's test of a compile the one it takes there
    (``_ops._compiling_traced``), where a PyTorch that holds the flag through the compile takes the flag alone."""
    from wsarena.torch import _autograd, _ops

    monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)
    monkeypatch.setattr(_ops, "compiling", _ops._compiling_traced)
    monkeypatch.setattr(_autograd, "_compiling", _ops._compiling_traced)


def test_a_compile_is_told_by_is_compiling_alone_where_pytorch_holds_it_through_the_compile():
    """wsarena.torch's test of a compile is ``torch.compiler.is_compiling()`` itself, at no cost over it, exactly
    where PyTorch holds that true through the compile, its backend's call included (2.13), as a compile shows here
    (not the name the choice reads); elsewhere (2.11, 2.7) the test that asks Dynamo's tracing context as well. Both
    are true in a function Dynamo runs rather than traces, and false in eager code under a dispatch mode."""
    from torch.utils.flop_counter import FlopCounterMode

    from wsarena.torch import _autograd, _ops

    held = _flag_held_through_the_compile()
    assert (_ops.compiling is torch.compiler.is_compiling) == held
    assert _ops.compiling is (torch.compiler.is_compiling if held else _ops._compiling_traced)
    assert _autograd._compiling is _ops.compiling
    seen = []

    @torch._dynamo.allow_in_graph
    def block(t):
        seen.append((_ops.compiling(), _ops._compiling_traced()))
        return t + 1

    torch._dynamo.reset()
    torch.compile(lambda t: block(t) * 2, backend="aot_eager")(torch.zeros(2))
    assert seen and all(s == (True, True) for s in seen)
    with FlopCounterMode(display=False):
        assert (_ops.compiling(), _ops._compiling_traced()) == (False, False)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after: a test's compiles of shared code (a module's forward, on other
    devices) count toward its recompile limit, which a later test's fullgraph=True compile would then exceed."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("trace", ["compile", "export"])
def test_a_model_on_the_meta_device_compiles_and_exports_with_a_meta_input(trace, fresh_dynamo):
    """As PyTorch's own model does: the autocast check asked autocast about the meta device, which it has no mode
    for (a RuntimeError), where the trace does not ask whether autocast is available."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ConvTranspose2d(8, 4, 2, 2))
    model = model.to("meta")
    x = torch.empty(2, 3, 15, 15, device="meta")
    ref = model(x)
    wt.convert(model)
    if trace == "compile":
        y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    else:
        y = torch.export.export(model, (x,)).module()(x)
    assert y.device.type == "meta" and y.shape == ref.shape == (2, 4, 16, 16) and y.dtype == ref.dtype


@pytest.mark.parametrize(
    "call",
    [
        lambda x, w, b: wt.conv2d(x, w.to("meta"), b),
        lambda x, w, b: wt.conv2d(x, w, b.to("meta")),
        lambda x, w, b: wt.conv_transpose2d(x, w.transpose(0, 1).to("meta")),
        lambda x, w, b: wt.convert(torch.nn.Conv2d(4, 2, 3, dtype=x.dtype)).to("meta")(x),
        lambda x, w, b: wt.ConvFunction.apply(x, w.to("meta"), [1, 1], [0, 0], [1, 1], 1, "NCHW"),
        lambda x, w, b: wt.WeightGradFunction.apply(x, torch.ones(1, 2, 4, 4, device="meta", dtype=x.dtype),
                                                    [2, 4, 3, 3], [1, 1], [0, 0], [1, 1], 1, "NCHW"),
    ],
)
def test_a_meta_operand_beside_a_real_one_is_refused(call):
    """A model left partly on the meta device (weights never loaded) run on a real input ran the operators' fake
    kernel: an unwritten result on the input's device, its values whatever the allocator left there. (A meta input
    beside real weights gives a meta result, as PyTorch's convolution does: wsarena.torch.layers reads a model so.)"""
    x, w, b = (t.detach() for t in tensors((1, 4, 6, 6), (2, 4, 3, 3)))
    with pytest.raises(TypeError, match="on the meta device, which holds no values"):
        call(x, w, b)
    assert close(wt.conv2d(x, w, b), torch.nn.functional.conv2d(x, w, b))  # nothing left behind


def test_a_meta_bias_beside_real_operands_is_refused_under_torch_compile(fresh_dynamo):
    """The bias is no operand of the operators, whose fake kernels refuse a meta weight: a compiled model with a
    meta bias (one a checkpoint left unloaded) added it by PyTorch's in-place add, which adds nothing from the meta
    device, and gave the convolution without its bias."""
    model = wt.convert(torch.nn.Conv2d(4, 2, 3, dtype=torch.float64))
    model.bias = torch.nn.Parameter(torch.ones(2, dtype=torch.float64, device="meta"))
    x = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match="bias is on the meta device, which holds no values"):
        torch.compile(model, backend="eager")(x)


def test_a_meta_bias_is_refused_in_eager_while_another_thread_compiles(fresh_dynamo):
    """torch.compiler.is_compiling() is the process's, true while any thread compiles: a call in eager mode in
    another thread meanwhile is checked as any other (a meta bias there was added as nothing)."""
    _skip_unless_compiling_everywhere()
    x, w, b = (t.detach() for t in tensors((1, 4, 6, 6), (2, 4, 3, 3)))
    compiling, done = threading.Event(), threading.Event()

    def backend(gm, example_inputs):  # holds the compilation open while the test's thread runs
        compiling.set()
        done.wait(30)
        return gm

    worker = threading.Thread(target=lambda: torch.compile(lambda t: t + 1, backend=backend)(torch.zeros(2)))
    worker.start()
    try:
        assert compiling.wait(30) and torch.compiler.is_compiling()
        with pytest.raises(TypeError, match="bias is on the meta device, which holds no values"):
            wt.conv2d(x, w, b.to("meta"))
    finally:
        done.set()
        worker.join()
    assert close(wt.conv2d(x, w, b), torch.nn.functional.conv2d(x, w, b))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x, w: wt.conv2d(x, w, padding="same", dilation=1, stride=1)[..., :0], None, None),
        (lambda x, w: wt.conv2d(x, w, stride=0), ValueError, "stride"),
        (lambda x, w: wt.conv2d(x, w.float()), TypeError, "dtypes differ"),
        (lambda x, w: wt.conv2d(x[0, 0], w), ValueError, "3- or 4-D input"),
        (lambda x, w: wt.conv2d(x, w, groups=3), ValueError, "groups=3"),
        (lambda x, w: wt.conv2d(x, w, torch.zeros(2, 1, dtype=x.dtype)), ValueError, r"bias must have shape \(2,\)"),
        (lambda x, w: wt.conv2d(x, w, torch.zeros(1, 2, dtype=x.dtype)), ValueError, r"not \(1, 2\)"),
        (lambda x, w: wt.conv2d(x, w, 0.5), TypeError, "bias must be a tensor or None, not float"),
        (lambda x, w: wt.conv2d(x.long(), w.long()), TypeError, "conv2d takes float16, .* tensors, not torch.int64"),
        (lambda x, w: wt.conv2d(x.cdouble(), w.cdouble()), TypeError, "not torch.complex128"),
        (lambda x, w: wt.conv2d(x.numpy(), w), TypeError, "must be tensors"),
        # a sparse input failed in PyTorch's contiguous() with "unsupported memory format option Contiguous"
        (lambda x, w: wt.conv2d(x.to_sparse(), w), TypeError, r"dense tensors \(torch.strided\), not torch.sparse_coo"),
        (lambda x, w: wt.conv_transpose2d(x, w.transpose(0, 1).to_sparse()), TypeError, "and torch.sparse_coo"),
        (lambda x, w: wt.conv2d(x.float().to_mkldnn(), w.float()), TypeError, "not torch._mkldnn and torch.strided"),
    ],
)
def test_bad_arguments_are_clear_errors(call, error, match):
    x, w, _ = (t.detach() for t in tensors((1, 4, 6, 6), (2, 4, 3, 3)))
    if error is None:
        call(x, w)
        return
    with pytest.raises(error, match=match):
        call(x, w)


@pytest.mark.parametrize("cls", ["Conv1d", "Conv2d", "Conv3d"])
def test_modules_take_torchs_constructor_and_state_dict(cls):
    torch.manual_seed(0)
    theirs = getattr(torch.nn, cls)(4, 6, 3, stride=2, padding=1, groups=2, dtype=torch.float64)
    ours = getattr(wt, cls)(4, 6, 3, stride=2, padding=1, groups=2, dtype=torch.float64)
    assert isinstance(ours, getattr(torch.nn, cls))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, *(8,) * int(cls[-2]), dtype=torch.float64)
    assert close(ours(x), theirs(x))


def test_padding_modes_other_than_zeros_are_refused():
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        wt.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    conv = wt.Conv2d(3, 4, 3, padding=1)
    conv.padding_mode = "circular"  # changed after construction: refused when it runs
    with pytest.raises(ValueError, match="padding_mode='circular'"):
        conv(torch.zeros(1, 3, 5, 5))


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("setting", ["stride", "padding", "dilation"])
def test_one_value_in_a_sequence_runs_in_every_dimension_and_other_lengths_are_refused_as_torchs(setting, nd):
    """``nn.Conv2d(..., padding=(2,))``, or ``conv.padding = [2]`` set after construction, runs as padding 2 in every
    dimension in PyTorch (ATen's expand_param_if_needed): so do wsarena's function and modules, made so, changed so
    or converted, against ``F.conv{nd}d`` with the explicit ``(2,) * nd`` in float64 (within 1e-10). A sequence of
    another length, which PyTorch refuses, is refused."""
    ours, theirs = FUNCTIONS[nd]
    cls = f"Conv{nd}d"
    x, w, b = (t.detach() for t in tensors((2, 4, *(9,) * nd), (6, 4, *(3,) * nd)))
    ref = theirs(x, w, b, **{setting: (2,) * nd})
    made = getattr(wt, cls)(4, 6, 3, dtype=torch.float64, **{setting: (2,)})
    changed = getattr(wt, cls)(4, 6, 3, dtype=torch.float64)
    setattr(changed, setting, [2])
    converted = getattr(torch.nn, cls)(4, 6, 3, dtype=torch.float64)
    setattr(converted, setting, (2,))
    wt.convert(converted)
    for module in (made, changed, converted):
        module.load_state_dict({"weight": w, "bias": b})
        assert close(module(x), ref)
    assert close(ours(x, w, b, **{setting: [2]}), ref) and close(ours(x, w, b, **{setting: (2,)}), ref)
    for wrong in ((), (2,) * (nd + 1)):
        with pytest.raises(RuntimeError, match=f"expected {setting} to be a single integer value"):
            theirs(x, w, b, **{setting: wrong})
        with pytest.raises(ValueError, match=f"{setting}=.* must have one entry per spatial dimension"):
            ours(x, w, b, **{setting: wrong})
        setattr(changed, setting, wrong)
        with pytest.raises(ValueError, match=f"{setting}=.* must have one entry per spatial dimension"):
            changed(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_convert_keeps_a_resnet_style_model_outputs_and_gradients(dtype):
    torch.manual_seed(0)
    model = small_resnet().to(dtype)
    reference = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, 16, 16, dtype=dtype)
    target = torch.tensor([0, 1, 2, 3])
    assert wt.convert(model) is model
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 9 and all(type(m) is wt.Conv2d for m in convs)
    assert dict(model.named_parameters()) == params  # the same Parameter objects: optimizers made before still train
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert state.keys() == model.state_dict().keys()
    loss, grads = step(model, x, target)
    ref_loss, ref_grads = step(reference, x, target)
    tol = TOL64 if dtype == torch.float64 else 1e-4  # float32: sums in another order, relative to the largest
    assert close(loss, ref_loss, tol)
    assert grads.keys() == ref_grads.keys()
    # relative to the largest gradient of the model: the stem's bias, before batch norm, has a gradient of zero
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert all(float((grads[k] - ref_grads[k]).abs().max()) <= tol * scale for k in grads)


def test_convert_refuses_what_it_cannot_run_and_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match=r"nothing was converted: 1: padding_mode='reflect'"):
        wt.convert(model)
    assert all(type(m) is torch.nn.Conv2d for m in model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        wt.convert(lambda x: x)


def test_convert_leaves_subclasses_alone():
    class Custom(torch.nn.Conv2d):
        pass

    class CustomTranspose(torch.nn.ConvTranspose2d):
        pass

    model = torch.nn.Sequential(Custom(2, 2, 1), CustomTranspose(2, 2, 3), torch.nn.ConvTranspose2d(2, 2, 3),
                                torch.nn.Conv1d(2, 2, 1))
    wt.convert(model)
    assert [type(m) for m in model] == [Custom, CustomTranspose, wt.ConvTranspose2d, wt.Conv1d]


def test_convert_leaves_a_lazy_convolution_until_a_forward_has_made_it_pytorchs():
    """As the README says: a lazy module is a subclass, left as it is; its first forward makes it torch.nn.Conv2d,
    which convert() then converts, and the model gives PyTorch's result (float64, 1e-10)."""
    model = torch.nn.Sequential(torch.nn.LazyConv2d(4, 3, padding=1)).double()
    wt.convert(model)
    assert type(model[0]) is torch.nn.LazyConv2d
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ref = model(x)
    assert type(model[0]) is torch.nn.Conv2d
    wt.convert(model)
    assert type(model[0]) is wt.Conv2d
    assert close(model(x), ref)


def test_convert_converts_parametrized_convolutions_and_keeps_their_parametrizations():
    """weight_norm and spectral_norm (torch.nn.utils.parametrizations) and parametrize's own make a class of their
    own per module: converted to one over wsarena's, whose removal leaves wsarena's module."""
    parametrize = torch.nn.utils.parametrize

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv2d(3, 4, 3, padding=1)),
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.ConvTranspose2d(4, 4, 3, stride=2)),
        torch.nn.Conv1d(2, 2, 1),
    ).double().eval()  # eval: spectral_norm's power iteration does not change its vectors between the two runs
    parametrize.register_parametrization(model[2], "weight", Doubled())
    reference = copy.deepcopy(model)
    keys = model.state_dict().keys()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    wt.convert(model)
    assert [parametrize.type_before_parametrizations(m) for m in model] == [wt.Conv2d, wt.ConvTranspose2d, wt.Conv1d]
    assert all(parametrize.is_parametrized(m, "weight") for m in model) and model.state_dict().keys() == keys
    y, ref = model[:2](x), reference[:2](x)
    assert close(y, ref)
    params = [model[0].parametrizations.weight.original0, model[0].parametrizations.weight.original1]
    ref_params = [reference[0].parametrizations.weight.original0, reference[0].parametrizations.weight.original1]
    dy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, params, dy), torch.autograd.grad(ref, ref_params, dy)
    assert all(close(g, r) for g, r in zip(got, want))
    x1 = torch.randn(1, 2, 4, dtype=torch.float64)
    assert close(model[2](x1), F.conv1d(x1, 2 * model[2].parametrizations.weight.original, model[2].bias))
    assert close(copy.deepcopy(model)[:2](x), ref)
    parametrize.remove_parametrizations(model[2], "weight")
    assert type(model[2]) is wt.Conv1d


ALL_SIX = [
    torch.nn.Conv1d(2, 4, 3), torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Conv3d(2, 4, 1),
    torch.nn.ConvTranspose1d(2, 4, 3, stride=2), torch.nn.ConvTranspose2d(2, 4, 2), torch.nn.ConvTranspose3d(2, 4, 1),
]


def test_revert_gives_each_converted_convolution_pytorchs_class_back_and_keeps_its_state():
    """The same objects, parameters (an optimizer made before trains them still), hooks and state_dict; the model
    trained through wsarena computes as PyTorch's modules compute it."""
    torch.manual_seed(3)
    model = torch.nn.ModuleList(copy.deepcopy(ALL_SIX)).double()
    classes = [type(m) for m in model]
    params = [id(p) for p in model.parameters()]
    calls = []
    model[1].register_forward_hook(lambda m, i, o: calls.append(type(m)))
    wt.convert(model)
    assert [type(m) for m in model] == [wt.Conv1d, wt.Conv2d, wt.Conv3d, wt.ConvTranspose1d, wt.ConvTranspose2d,
                                        wt.ConvTranspose3d]
    inputs = [torch.randn(1, 2, *(6,) * (i % 3 + 1), dtype=torch.float64) for i in range(6)]
    trained = [m(x) for m, x in zip(model, inputs)]
    assert wt.revert(model) is model
    assert [type(m) for m in model] == classes and [id(p) for p in model.parameters()] == params
    reverted = [m(x) for m, x in zip(model, inputs)]
    assert all(close(r, t) for r, t in zip(reverted, trained))
    assert calls == [wt.Conv2d, torch.nn.Conv2d]
    one = wt.Conv2d(2, 4, 3)  # made as wsarena's, not converted: PyTorch's all the same
    assert type(wt.revert(one)) is torch.nn.Conv2d and one.state_dict().keys() == {"weight", "bias"}


def test_revert_keeps_parametrizations_and_leaves_subclasses_and_other_modules_alone():
    parametrize = torch.nn.utils.parametrize

    class Mine(wt.Conv2d):
        pass

    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv2d(3, 4, 3, padding=1)), Mine(4, 4, 1),
        torch.nn.BatchNorm2d(4),
    ).double()
    keys = model.state_dict().keys()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    ref = wt.convert(model)(x)
    wt.revert(model)
    assert parametrize.type_before_parametrizations(model[0]) is torch.nn.Conv2d
    assert [type(m) for m in model[1:]] == [Mine, torch.nn.BatchNorm2d] and model.state_dict().keys() == keys
    assert close(model(x), ref)
    parametrize.remove_parametrizations(model[0], "weight")
    assert type(model[0]) is torch.nn.Conv2d
    with pytest.raises(TypeError, match="must be a torch.nn.Module, not list"):
        wt.revert([torch.nn.Conv2d(1, 1, 1)])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # TorchScript and its ONNX exporter are deprecated
def test_a_reverted_model_exports_to_onnx_and_scripts_as_pytorchs_own():
    """What takes only PyTorch's own modules: TorchScript's ONNX exporter, which cannot export a Python autograd
    Function, and torch.jit.script, which wsarena's modules refuse."""
    import io

    import onnx  # a dependency of wsarena's own

    model = wt.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                           torch.nn.ConvTranspose2d(4, 2, 2, stride=2)))
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(RuntimeError, match="ConvFunction"):
        torch.onnx.export(model, (x,), io.BytesIO(), dynamo=False)
    with pytest.raises(TypeError, match=r"wsarena\.torch\.revert\(model\)"):
        torch.jit.script(model)
    wt.revert(model)
    exported = io.BytesIO()
    torch.onnx.export(model, (x,), exported, dynamo=False)
    graph = onnx.load_from_string(exported.getvalue()).graph
    assert [node.op_type for node in graph.node] == ["Conv", "Relu", "ConvTranspose"]
    assert close(torch.jit.script(model)(x), model(x), 0)


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_convert_refuses_torchscript_convolutions_and_changes_nothing():
    """A scripted or traced model runs TorchScript's code, not its modules' classes: converting it would change
    nothing, so it is refused, as are scripted convolutions inside an ordinary model."""
    x = torch.randn(1, 3, 5, 5)
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))
    traced = torch.jit.trace(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), x)
    for model in (scripted, traced):
        with pytest.raises(TypeError, match=r"TorchScript.*0: Conv2d.*convert the model before torch.jit.trace"):
            wt.convert(model)
    inside = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.jit.script(torch.nn.Conv2d(3, 4, 3)))
    with pytest.raises(TypeError, match=r"nothing was converted: 1: Conv2d"):
        wt.convert(inside)
    assert type(inside[0]) is torch.nn.Conv2d
    helper = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.jit.script(torch.nn.ReLU()))
    assert type(wt.convert(helper)[0]) is wt.Conv2d  # TorchScript without a convolution is no matter
    converted = wt.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))
    traced = torch.jit.trace(converted, x)
    assert wt.convert(traced) is traced  # traced once converted: nothing left to convert


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_convert_refuses_traced_parametrized_convolutions_of_pytorchs_only():
    """parametrize names its class after the module's (ParametrizedConv2d), in its own Python module: a traced
    weight_norm convolution of PyTorch's is refused as a plain one is, one of wsarena's (converted before tracing,
    or parametrized as it was made) is not, and one reverted to PyTorch's is again."""
    weight_norm = torch.nn.utils.parametrizations.weight_norm
    x = torch.randn(1, 3, 5, 5)
    traced = torch.jit.trace(torch.nn.Sequential(weight_norm(torch.nn.Conv2d(3, 4, 3))), x)
    with pytest.raises(TypeError, match=r"nothing was converted: 0: ParametrizedConv2d"):
        wt.convert(traced)
    made = wt.Conv2d(3, 4, 3)
    torch.nn.utils.parametrize.register_parametrization(made, "weight", torch.nn.Identity())
    for ours in (wt.convert(torch.nn.Sequential(weight_norm(torch.nn.Conv2d(3, 4, 3)))), torch.nn.Sequential(made)):
        traced = torch.jit.trace(ours, x)
        assert wt.convert(traced) is traced
    # reverted, each is PyTorch's again, its class in parametrize's module: traced, it is refused as PyTorch's is
    for reverted in (wt.revert(wt.convert(torch.nn.Sequential(weight_norm(torch.nn.Conv2d(3, 4, 3))))),
                     wt.revert(torch.nn.Sequential(made))):
        assert type(reverted[0]).__module__ == torch.nn.utils.parametrize.__name__
        with pytest.raises(TypeError, match=r"nothing was converted: 0: ParametrizedConv2d"):
            wt.convert(torch.jit.trace(reverted, x))


def test_a_converted_model_trains_under_the_cap():
    torch.manual_seed(1)
    model = wt.convert(small_resnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    wsarena.configure(cap_workspace=0)
    with pytest.warns(wsarena.WorkspaceCapWarning):  # the cap excludes the fastest algorithms
        first, _ = step(model, x, target)
    opt.step()
    for _ in range(4):
        loss, _ = step(model, x, target)
        opt.step()
    assert float(loss) < float(first)
    assert wsarena.get_arena("cpu").stats()["high_water_bytes"] == 0


def test_torch_compile_takes_the_custom_operators_in_one_graph():
    torch.manual_seed(2)
    model = small_resnet().double()
    reference = copy.deepcopy(model)
    wt.convert(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, target = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1])
    loss, grads = step(compiled, x, target)
    grads = {k.removeprefix("_orig_mod."): g for k, g in grads.items()}
    ref_loss, ref_grads = step(reference, x, target)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert close(loss, ref_loss)
    assert all(float((grads[k] - ref_grads[k]).abs().max()) <= TOL64 * scale for k in ref_grads)


@pytest.mark.parametrize("make", [lambda: wt.Conv2d(3, 4, 3), lambda: wt.ConvTranspose2d(3, 4, 3, stride=2)])
def test_a_traced_call_reads_nothing_from_the_module_registry(make):
    """The checks a traced call runs (torch.compile, torch.export) read no ``sys.modules``: TorchDynamo would wrap
    that dictionary of thousands of entries and guard on it, and a lazily loaded module (CuPy's cupyx) loading
    while it went through the entries failed a strict export with "dictionary changed size during iteration"."""
    explained = torch._dynamo.explain(make())(torch.randn(1, 3, 8, 8))
    assert explained.graph_count == 1
    assert not [g.name for g in explained.out_guards if "sys.modules" in g.name]


def test_public_names_are_listed_sorted_and_resolve():
    assert wt.__all__ == sorted(wt.__all__)
    assert all(getattr(wt, name) is not None for name in wt.__all__)
    public = {n for n, v in vars(wt).items()
              if not n.startswith("_") and type(v).__name__ != "module"} - {"annotations"}
    assert public <= set(wt.__all__)


def _caps(warned):
    """The cap warnings among all those ``pytest.warns`` recorded, PyTorch's own included (torch.compile warns on
    CPython 3.13.0 that its guards may run slower there)."""
    return [w for w in warned if issubclass(w.category, wsarena.WorkspaceCapWarning)]


def _cap_warnings(run, passes=("fwd",)):
    """The (file, line) of each cap warning ``run()`` gives under a cap of 0, checking that ``passes`` warned."""
    wsarena.configure(cap_workspace=0)  # not config(): a thread of its own would not see it
    with pytest.warns(wsarena.WorkspaceCapWarning) as warned:
        run()
    caps = _caps(warned)
    assert {str(w.message).split(" for ")[1].split(" of ")[0] for w in caps} == set(passes)
    return {(w.filename, w.lineno) for w in caps}


def _line(offset=0):
    """The number of the line that calls this, plus ``offset``."""
    return sys._getframe(1).f_lineno + offset


def _backward(y, thread):
    """``y.sum().backward()``, in this thread or, ``thread``, in a new one whose stack holds none of the test's lines
    and whose context none of its ``config()`` blocks (as PyTorch's CUDA autograd thread)."""
    if thread:
        worker = threading.Thread(target=y.sum().backward)  # PyTorch's and threading's frames only
        worker.start()
        worker.join()
    else:
        y.sum().backward()


@pytest.mark.parametrize("module", [lambda: wt.Conv2d(4, 6, 3), lambda: wt.ConvTranspose2d(4, 6, 3, stride=2)])
@pytest.mark.parametrize("thread", [False, True])
def test_cap_warnings_through_a_module_name_the_module_call_for_all_three_passes(module, thread):
    """Forward warns at the module call; backward passes too (the forward whose gradient they compute), also where
    the backward runs on a thread whose stack holds no line of the caller's, as PyTorch's CUDA autograd thread."""
    conv = module()
    x = torch.randn(2, 4, 8, 8, requires_grad=True)

    def run():
        nonlocal where
        where = _line(1)
        y = conv(x)
        _backward(y, thread)

    where = None
    sites = _cap_warnings(run, ("fwd", "bwd_data", "bwd_filter"))
    assert sites == {(__file__, where)}
    assert x.grad is not None


def test_cap_warnings_of_torch_tensors_through_the_ops_name_the_calling_line():
    x, w, _ = (t.detach() for t in tensors((2, 4, 8, 8), (6, 4, 3, 3)))
    assert _cap_warnings(lambda: ops.conv_forward(x, w)) == {(__file__, _line())}


def test_cap_warnings_under_torch_compile_name_the_call_and_the_backward_call():
    """A compiled backward runs the operators without wsarena.torch's functions: its warnings name backward()."""
    compiled = torch.compile(wt.Conv2d(4, 6, 3), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    lines = []

    def run():
        lines.append(_line(1))
        y = compiled(x)
        lines.append(_line(1))
        y.sum().backward()

    assert _cap_warnings(run, ("fwd", "bwd_data", "bwd_filter")) == {(__file__, lines[0]), (__file__, lines[1])}


def test_a_config_block_in_a_compiled_function_is_a_graph_break_whose_calls_run_under_it():
    """Dynamo cannot trace the block's context variable: it runs the block eagerly between compiled pieces."""
    conv = wt.Conv2d(4, 6, 3)
    x = torch.randn(2, 4, 8, 8)

    def capped(x):
        with wsarena.config(cap_workspace=0):
            return conv(x)

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(capped, backend="aot_eager", fullgraph=True)(x)
    with pytest.warns(wsarena.WorkspaceCapWarning) as warned:
        y = torch.compile(capped, backend="aot_eager")(x)
    assert "cap 0 B" in str(_caps(warned)[0].message)
    assert wsarena.get_config().cap_workspace is None  # the block ended
    torch.testing.assert_close(y, torch.nn.functional.conv2d(x, conv.weight, conv.bias))  # float32's defaults


def _dense(operand):
    """Whether an operand the ops get is dense: a tensor, or on the host the NumPy view wsarena.torch makes of one."""
    return operand.flags.c_contiguous if isinstance(operand, np.ndarray) else operand.is_contiguous()


def test_gradients_reach_the_ops_dense_in_the_layout_they_run_in(monkeypatch):
    """An expanded ``sum()`` gradient, or an NCHW one beside channels-last operands, is made dense by PyTorch: a
    copy by the ops would be in their array library's memory, which a captured CUDA graph does not keep."""
    dense = []
    for name in ("conv_forward", "conv_backward_data", "conv_backward_filter"):
        real = getattr(ops, name)

        def record(a, b, *args, _real=real, **kwargs):
            dense.append(_dense(a) and _dense(b))  # (N, *spatial, C) views when channels-last
            return _real(a, b, *args, **kwargs)

        monkeypatch.setattr(ops, name, record)
    for fmt in (torch.contiguous_format, torch.channels_last):
        x, w, b = (t.detach().to(memory_format=fmt).requires_grad_() if t.dim() == 4 else t
                   for t in tensors((2, 4, 7, 7), (6, 4, 3, 3)))
        wt.conv2d(x, w, b).sum().backward()
        y = wt.conv_transpose2d(x, w.detach().transpose(0, 1).contiguous(memory_format=fmt).requires_grad_())
        y.backward(torch.ones(y.shape[0], 1, 1, 1, dtype=y.dtype).expand(y.shape))
    assert dense == [True] * 12


@pytest.fixture
def leased():
    """The sizes of the CPU arena's leases, in order (a fresh arena for the test)."""
    from wsarena.arena import Arena, HostProvider, set_arena

    class Recording(Arena):
        def lease(self, nbytes, **kw):
            sizes.append(nbytes)
            return super().lease(nbytes, **kw)

    sizes = []
    previous = set_arena("cpu", Recording(HostProvider()))
    yield sizes
    set_arena("cpu", previous)


@pytest.mark.parametrize("thread", [False, True])
def test_backward_passes_run_under_the_settings_their_forward_ran_under(thread, leased):
    """A config() block around the forward reaches its backward passes, also on a thread of their own (PyTorch's
    CUDA autograd thread), and one around backward() alone does not change them: the same rule on every device."""
    conv = wt.Conv2d(4, 6, 3)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)

    def backward(y):
        leased.clear()
        _backward(y, thread)
        assert len(leased) == 2  # both backward passes ran, and leased
        return max(leased)

    with wsarena.config(cap_workspace=0), pytest.warns(wsarena.WorkspaceCapWarning) as warned:
        assert backward(conv(x)) == 0  # no backward pass leased a byte under the cap of 0
    passes = {str(w.message).split(" for ")[1].split(" of ")[0] for w in warned}
    assert passes == {"fwd", "bwd_data", "bwd_filter"}
    with wsarena.config(cap_workspace=0):
        y = conv(x)
    assert backward(y) == 0  # outside the block: still capped, as its forward was
    y = conv(x)
    with wsarena.config(cap_workspace=0):
        assert backward(y) > 0  # the forward ran uncapped: so do its backward passes


@pytest.mark.parametrize("thread", [False, True])
def test_configure_between_a_forward_and_its_backward_reaches_the_backward(thread, leased):
    """Outside any config() block a backward pass runs under the process-wide settings of its own time."""
    conv = wt.Conv2d(4, 6, 3)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    y = conv(x)
    wsarena.configure(cap_workspace=0)  # conftest resets the settings after the test
    leased.clear()
    with pytest.warns(wsarena.WorkspaceCapWarning):
        _backward(y, thread)
    assert leased == [0, 0]


def test_checkpoint_context_serves_every_recompute(leased):
    from torch.utils.checkpoint import checkpoint

    conv = wt.Conv2d(4, 6, 3)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    warnings.simplefilter("ignore", wsarena.WorkspaceCapWarning)  # pytest restores the filters after the test
    with wsarena.config(cap_workspace=0):
        y = checkpoint(conv, x, use_reentrant=False, context_fn=wt.checkpoint_context).sum()
    leased.clear()
    y.backward(retain_graph=True)
    first = list(x.grad)
    y.backward()  # recomputes again, entering the same recompute context again
    assert leased == [0] * 6 and len(first) == 2


def test_a_checkpointed_forward_is_recomputed_under_its_settings_with_checkpoint_context(leased):
    from torch.utils.checkpoint import checkpoint

    conv = wt.Conv2d(4, 6, 3)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    warnings.simplefilter("ignore", wsarena.WorkspaceCapWarning)  # pytest restores the filters after the test
    for context_fn, recomputed in ((wt.checkpoint_context, 0), (None, "uncapped")):
        kwargs = {"context_fn": context_fn} if context_fn else {}
        with wsarena.config(cap_workspace=0):
            y = checkpoint(conv, x, use_reentrant=False, **kwargs)
        leased.clear()
        y.sum().backward()  # recomputes the forward, then its two backward passes
        assert len(leased) == 3
        if recomputed == 0:
            assert leased == [0, 0, 0]
        else:  # without it the recomputed forward runs under the settings where backward() runs: uncapped
            assert leased[0] > 0 and leased[1:] == [0, 0]


def test_checkpoint_context_under_torch_compile_gives_torchs_results():
    """A compiled checkpoint takes from its context_fn only two TorchDispatchModes: checkpoint_context gives those of
    PyTorch's own compiled checkpointing there, where its two other contexts failed the compile with an
    AssertionError ("must generate a tuple of two `TorchDispatchMode`s")."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.ConvTranspose2d(4, 2, 3)).double()
    ours = wt.convert(copy.deepcopy(theirs))

    def run(model, **kwargs):
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        compiled = torch.compile(lambda t: checkpoint(model, t, use_reentrant=False, **kwargs), backend="aot_eager",
                                 fullgraph=True)
        y = compiled(x)
        return y, torch.autograd.grad(y.pow(2).sum(), (x, *model.parameters()))

    (got, got_grads), (expected, expected_grads) = run(ours, context_fn=wt.checkpoint_context), run(theirs)
    assert close(got, expected) and all(close(g, e) for g, e in zip(got_grads, expected_grads))


def test_checkpoint_context_under_torch_compile_where_checkpoint_looks_for_functional_arguments(monkeypatch):
    """The test above where torch.utils.checkpoint tells a compile by functional tensors among the checkpointed
    function's arguments, as PyTorch 2.7 does (simulated): checkpoint_context, given no arguments, still gives
    the two TorchDispatchModes, where it gave its eager contexts and the compile failed."""
    import torch.utils.checkpoint as checkpointing
    from torch._subclasses.functional_tensor import FunctionalTensor

    def is_compiling(func, args, kwargs):  # PyTorch 2.7's test
        return any(isinstance(arg, FunctionalTensor) or torch._is_functional_tensor(arg)
                   for arg in args if isinstance(arg, torch.Tensor))

    monkeypatch.setattr(checkpointing, "_is_compiling", is_compiling)
    monkeypatch.setattr("wsarena.torch._functional._checkpoint_compiling", is_compiling)
    torch._dynamo.reset()
    test_checkpoint_context_under_torch_compile_gives_torchs_results()


def test_checkpoint_context_under_functionalize_gives_torchs_results_or_torchs_errors():
    """A convolution checkpointed with checkpoint_context under an eager torch.func.functionalize: its result and
    gradients are torch.nn.functional.conv2d's in float64, and where PyTorch's checkpointing fails there for its own
    convolution, it fails alike. torch.func.functionalize holds no functional dispatch mode (it functionalizes at a
    torch.func level), so checkpoint_context gives its eager contexts there, not the selective checkpointing it
    gives under a compile's trace. PyTorch 2.13 runs the checkpointed forward there and refuses its recompute, for
    every operator (a CheckpointError); earlier ones refuse the forward; torch.func.grad refuses checkpoint's
    saved-tensor hooks. The same without functionalize, where both run on every PyTorch."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, dtype=torch.float64, generator=generator)
               for shape in ((2, 3, 8, 8), (4, 3, 3, 3), (4,)))
    contexts = []

    def context_fn():
        contexts.extend(wt.checkpoint_context())
        return contexts[-2:]

    def runs(conv, **kwargs):
        def f(x, w, b):
            return checkpoint(lambda *t: torch.tanh(conv(*t, padding=1)), x, w, b, use_reentrant=False, **kwargs)

        def with_autograd(function):
            operands = [t.clone().requires_grad_() for t in (x, w, b)]
            y = function(*operands)
            return (y, *torch.autograd.grad(y.pow(2).sum(), operands))

        functionalized = torch.func.functionalize(f)
        loss = torch.func.functionalize(lambda *t: f(*t).pow(2).sum())
        return [
            lambda: with_autograd(f),
            lambda: (functionalized(x, w, b),),
            lambda: with_autograd(functionalized),
            lambda: torch.func.grad(loss, argnums=(0, 1, 2))(x, w, b),
        ]

    def outcome(run):
        try:
            return run()
        except RuntimeError as e:  # PyTorch's own refusal (CheckpointError is one), as for its convolution (below)
            return type(e)

    for got, expected in zip(map(outcome, runs(wt.conv2d, context_fn=context_fn)), map(outcome, runs(F.conv2d))):
        if isinstance(expected, type):
            assert got is expected
        else:
            assert not isinstance(got, type), got
            assert len(got) == len(expected) and all(close(g, e) for g, e in zip(got, expected))
    assert contexts and not any(isinstance(c, TorchDispatchMode) for c in contexts)


def test_selective_checkpointing_that_saves_the_operators_results_matches_torchs(leased):
    """torch.utils.checkpoint's selective checkpointing, with a policy that saves the forward operators' results,
    wsarena's and torch's: the recompute runs none of them, and the results and gradients are torch's. The bias was
    added in place to the operator's result the policy saved, which it refused ("Tensor cached during selective
    activation checkpoint has been mutated")."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    saved = {torch.ops.wsarena.conv_forward.default, torch.ops.wsarena.conv_backward_data.default,
             torch.ops.aten.convolution.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.ConvTranspose2d(4, 2, 3)).double()
    ours = wt.convert(copy.deepcopy(theirs))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)

    def run(model):
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        y = checkpoint(model, x, use_reentrant=False, context_fn=context_fn)
        leased.clear()
        return y, torch.autograd.grad(y, (x, *model.parameters()), torch.ones_like(y))

    got, got_grads = run(ours)
    assert len(leased) == 4  # the backward: the two layers' backward passes, no forward recomputed
    expected, expected_grads = run(theirs)
    assert close(got, expected) and all(close(g, e) for g, e in zip(got_grads, expected_grads))


class Stream:
    """What prepare_capture and the arena read of a torch.cuda.Stream, for the tests below without a GPU."""

    def __init__(self, handle: int = 0x7001) -> None:
        self.handle, self.device = handle, torch.device("cuda", 0)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def test_prepare_capture_gives_the_capture_stream_the_largest_workspace(monkeypatch):
    """Without a GPU: PyTorch's CUDA streams stood in for by a class of the test's own, and device 0's arena by one over
    a RecordingProvider. prepare_capture() makes torch.cuda.graph's default capture stream where PyTorch has not made
    it yet (make_graphed_callables captures there), and reserves there the largest buffer the arena holds, at most the
    cap; a stream given is the one prepared."""
    from wsarena.arena import Arena, set_arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.torch import _graphs

    monkeypatch.setattr(_graphs, "gpu_unusable_reason", lambda: "the CUDA driver sees no device")
    with pytest.raises(wsarena.BackendUnavailableError, match="prepare_capture needs a GPU: the CUDA driver sees"):
        wt.prepare_capture()
    monkeypatch.setattr(_graphs, "gpu_unusable_reason", lambda: None)  # as on a GPU machine, below
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    arena = Arena(RecordingProvider(device_id=0))
    previous = set_arena(0, arena)
    try:
        assert wt.prepare_capture() == 0  # nothing to give before the eager step
        made = torch.cuda.graph.default_capture_stream
        assert type(made) is Stream
        arena.reserve(3000, stream=0x51)  # the eager step's largest workspace
        arena.reserve(1000, stream=0x52)
        held = wt.prepare_capture()
        assert torch.cuda.graph.default_capture_stream is made and held == arena.stats().streams[0x51].capacity_bytes
        assert arena.held_bytes(stream=made) == held
        with wsarena.config(cap_workspace=2048):
            assert wt.prepare_capture(Stream(0x7002)) == 2048
        with pytest.raises(TypeError, match="torch.cuda.Stream"):
            wt.prepare_capture(0x51)
    finally:
        set_arena(0, previous)
        arena.close()


def test_prepare_capture_of_a_stream_object_dropped_after_it_still_serves_the_capture(monkeypatch):
    """PyTorch gives a new Stream object for the same stream each time it is asked (torch.cuda.current_stream()). The
    buffer prepare_capture gives is the stream's, keyed by its handle as wsarena.torch's calls key it: tied to the
    object it came through, that object's death would leave it an orphan whose stream CUDA must be asked about before
    it is used again, which a capture cannot do (each captured call a CaptureError)."""
    import gc

    from wsarena.arena import Arena, set_arena
    from wsarena.arena.testing import RecordingProvider
    from wsarena.torch import _graphs

    monkeypatch.setattr(_graphs, "gpu_unusable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    provider = RecordingProvider(device_id=0)
    provider.stream_ids = {0x51: 1, 0x7002: 2}  # CUDA tells streams apart, as cudaStreamGetId does
    arena = Arena(provider)
    previous = set_arena(0, arena)
    try:
        arena.reserve(3000, stream=0x51)  # the eager step's
        held = wt.prepare_capture(Stream(0x7002))  # an object nothing keeps
        gc.collect()
        graph = provider.begin_capture(0x7002)
        with arena.lease(held, stream=0x7002) as ws:  # as a captured call leases: by the handle
            assert ws.pin is not None and ws.nbytes == held == 3072
        provider.end_capture(graph)
        assert len(provider.allocations) == 2  # the eager step's buffer and the prepared one: none during the capture
        graph.close()
    finally:
        set_arena(0, previous)
        arena.close()
