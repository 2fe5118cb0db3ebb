"""wsarena.torch with symbolic sizes, on CPU tensors: ``torch.compile(dynamic=True)`` and ``torch.export`` with
``Dim`` objects keep the batch and spatial sizes symbolic, as they keep those of torch's own convolutions; and each call
signature's arguments are checked once.

Tolerance as in test_torch.py: float64 within 1e-10 of torch's, relative to the largest magnitude.
"""

import copy
import itertools

import pytest

from wsarena import _geometry

torch = pytest.importorskip("torch")  # before test_torch's helpers, which import it
F = torch.nn.functional
wt = pytest.importorskip("wsarena.torch")
from wsarena.torch import _shapes

from .test_torch import _only_traced_frames_compiling, close

nn = torch.nn
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")  # torch's own


def models():
    """torch's model and the same converted: a strided convolution, a transposed one with output padding, and an
    even kernel under ``padding="same"`` (which pads the input by PyTorch first)."""
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
                           nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1),
                           nn.Conv2d(2, 2, 2, padding="same")).double()
    return theirs, wt.convert(copy.deepcopy(theirs))


SHAPES = [(2, 3, 8, 9), (3, 3, 10, 12), (5, 3, 7, 7)]  # batch and spatial sizes all differ


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_compile_with_dynamic_shapes_makes_one_graph_for_every_batch_and_size(fmt):
    """Checked as ints, the sizes were fixed to the first call's: a graph per shape (3 here)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    theirs, ours = models()
    counter = CompileCounterWithBackend("aot_eager")  # runs the operators' fake kernels, forward and backward
    compiled = torch.compile(ours, backend=counter, dynamic=True, fullgraph=True)
    for shape in SHAPES:
        x = torch.randn(shape, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
        y = compiled(x)
        (dx,) = torch.autograd.grad(y.pow(2).sum(), x)
        ref = theirs(x)
        (ref_dx,) = torch.autograd.grad(ref.pow(2).sum(), x)
        assert y.shape == ref.shape and close(y, ref) and close(dx, ref_dx)
        assert y.is_contiguous(memory_format=fmt)
    assert counter.frame_count == 1


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_a_dynamic_batch_and_sizes_runs_at_other_sizes(strict):
    """Checked as ints, the sizes were fixed, and torch.export refused the Dims (``b`` specialized to 2)."""
    theirs, ours = models()
    dims = {0: torch.export.Dim("b"), 2: torch.export.Dim("h", min=5), 3: torch.export.Dim("w", min=5)}
    x = torch.randn(SHAPES[0], dtype=torch.float64)
    exported = torch.export.export(ours, (x,), dynamic_shapes=(dims,), strict=strict)
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"wsarena.conv_forward.default", "wsarena.conv_backward_data.default"} <= targets
    for shape in SHAPES[1:]:
        x = torch.randn(shape, dtype=torch.float64)
        y, ref = exported.module()(x), theirs(x)
        assert y.shape == ref.shape and close(y, ref)


GEOMETRIES = [  # nd, input shape, weight shape, keyword arguments; transposed
    (1, (2, 4, 17), (6, 2, 3), {"stride": 2, "padding": 1, "groups": 2}, False),
    (2, (2, 4, 9, 8), (6, 4, 3, 2), {"stride": (2, 3), "padding": (1, 0), "dilation": (1, 2)}, False),
    (3, (2, 2, 7, 6, 9), (4, 2, 3, 1, 2), {"stride": (1, 2, 3), "padding": (0, 1, 1), "dilation": (2, 1, 1)}, False),
    (1, (2, 4, 9), (4, 3, 3), {"stride": 3, "padding": 1, "output_padding": 2, "dilation": 2}, True),
    (2, (2, 4, 7, 6), (4, 2, 2, 3), {"stride": (2, 1), "padding": (0, 1), "groups": 2, "output_padding": (1, 0)},
     True),
]


@pytest.mark.parametrize(("nd", "x_shape", "w_shape", "kw", "transposed"), GEOMETRIES)
def test_traced_output_sizes_are_torchs_symbolic_sizes(nd, x_shape, w_shape, kw, transposed):
    """The fake kernels' output sizes, as expressions of the symbolic input sizes, equal those of torch's own
    convolution in the same trace, at every size in a range (both are floor divisions, not always written alike)."""
    names = ("conv_transpose" if transposed else "conv") + f"{nd}d"
    ours, theirs = getattr(wt, names), getattr(F, names)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(w_shape, dtype=torch.float64, generator=g)

    class Both(nn.Module):  # the weight a buffer: a strict export (PyTorch 2.7's default) takes no closed-over one
        def __init__(self):
            super().__init__()
            self.register_buffer("w", w)

        def forward(self, x):
            return ours(x, self.w, **kw), theirs(x, self.w, **kw)

    x = torch.randn(x_shape, dtype=torch.float64, generator=g)
    dims = {0: torch.export.Dim("b"), **{d: torch.export.Dim(f"s{d}", min=x_shape[d]) for d in range(2, nd + 2)}}
    exported = torch.export.export(Both(), (x,), dynamic_shapes=(dims,))
    got, expected = (node.meta["val"] for node in exported.graph.find_nodes(op="output")[0].args[0])
    symbols = sorted({s for n in expected.shape if isinstance(n, torch.SymInt) for s in n.node.expr.free_symbols},
                     key=str)
    assert len(symbols) == nd + 1  # the batch's and each spatial size's
    for values in itertools.product(range(x_shape[2], x_shape[2] + 7), repeat=len(symbols)):
        at = dict(zip(symbols, values))
        assert [_value(n, at) for n in got.shape] == [_value(n, at) for n in expected.shape]
    y, ref = exported.module()(x)
    assert close(y, ref)


def _value(size, at):
    return int(size.node.expr.xreplace(at)) if isinstance(size, torch.SymInt) else size


TOO_SMALL = [  # a module, an input too small for it, what is wrong
    (lambda: wt.Conv2d(3, 4, 5), (2, 3, 3, 6),
     r"kernel \(5, 5\) \(dilation \(1, 1\)\) is larger than the padded input"),
    (lambda: wt.ConvTranspose2d(3, 4, 3, padding=2), (2, 3, 2, 6), r"padding=\(2, 2\) leaves an output of no elements"),
]


@pytest.mark.parametrize("decorator", ["allow_in_graph", "nonstrict_trace"])
def test_sizes_stay_symbolic_in_a_function_dynamo_runs_where_only_its_traced_frames_are_compiling(decorator,
                                                                                                  monkeypatch):
    """A convolution in a function Dynamo runs on its fake tensors rather than traces (``allow_in_graph``'s,
    ``nonstrict_trace``'s; in a strict export on PyTorch 2.7, a module of torch.nn's classes), where
    ``torch.compiler.is_compiling()`` is false, as before PyTorch 2.13 (simulated here by the compile session's flag
    left unset): the sizes stay symbolic, one graph for every batch and size. They were made ints, fixed to the
    traced values (a compile a size; on 2.7 a strict export refused its Dims as constants)."""
    from torch._dynamo.testing import CompileCounter

    _only_traced_frames_compiling(monkeypatch)
    conv = wt.Conv2d(3, 4, 3).double()
    block = getattr(torch._dynamo, decorator)(lambda x, w, b: wt.conv2d(x, w, b))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: block(x, conv.weight, conv.bias).tanh(), backend=counter, dynamic=True)
    for shape in ((2, 3, 8, 9), (3, 3, 10, 7), (4, 3, 6, 11)):
        x = torch.randn(shape, dtype=torch.float64)
        assert close(compiled(x), F.conv2d(x, conv.weight, conv.bias).tanh())
    assert counter.frame_count == 1


@pytest.mark.parametrize(("make", "small", "reason"), TOO_SMALL)
@pytest.mark.parametrize("first", [False, True])
def test_a_traced_input_too_small_is_refused_with_the_reason(make, small, reason, first):
    """Under torch.compile a RuntimeError that names the reason (a call outside it raises ValueError), whether the
    small input is the first traced or comes after a valid one (the size's guard fails, and the retrace refuses
    it); a transposed convolution's, unchecked, would be the ops' error about a convolution of no elements."""
    if not _shapes._TRACED_MESSAGE:
        pytest.skip("this PyTorch's Dynamo has no rule for torch._check's message (2.7): its error names no reason")
    compiled = torch.compile(make().double(), backend="aot_eager", dynamic=True)
    if not first:
        compiled(torch.randn(2, 3, 9, 9, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=reason):
        compiled(torch.randn(small, dtype=torch.float64))


@pytest.mark.parametrize(("make", "small", "reason"), TOO_SMALL)
def test_a_dynamo_without_a_rule_for_checks_messages_compiles_in_one_graph_and_refuses_a_small_input(
        make, small, reason, monkeypatch):
    """Where Dynamo has no rule of its own for ``torch._check`` (PyTorch 2.7, simulated here), the checks go
    without their message: that Dynamo put the message function in the graph and failed (``Unsupported: Failed to
    convert args/kwargs to proxy``), for every compiled convolution. One graph (``fullgraph=True``) with dynamic
    sizes, torch's results, and a too small input a RuntimeError."""
    monkeypatch.setattr(_shapes, "_TRACED_MESSAGE", False)
    real = torch._check
    messages = []
    monkeypatch.setattr(torch, "_check", lambda cond, *message: messages.append(message) or real(cond, *message))
    torch._dynamo.reset()
    module = make().double()
    compiled = torch.compile(module, backend="aot_eager", dynamic=True, fullgraph=True)
    for size in (9, 11):
        x = torch.randn(2, 3, size, size, dtype=torch.float64)
        assert close(compiled(x), wt.revert(copy.deepcopy(module))(x))
    assert messages and all(m == () for m in messages)
    with pytest.raises(RuntimeError):
        compiled(torch.randn(small, dtype=torch.float64))


def test_each_call_signature_is_checked_once(monkeypatch):
    """The arguments of a repeated call (a training step's) are checked on its first call; other strides are a
    signature of their own."""
    checked = []
    real = _geometry.conv_geometry
    monkeypatch.setattr("wsarena.torch._shapes.conv_geometry", lambda *a, **k: checked.append(k) or real(*a, **k))
    conv, x = wt.Conv2d(3, 4, 3).double(), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for _ in range(3):
        y = conv(x)
    assert close(y, F.conv2d(x, conv.weight, conv.bias)) and len(checked) == 1
    for _ in range(3):
        y = wt.conv2d(x, conv.weight, stride=2)
    assert close(y, F.conv2d(x, conv.weight, stride=2)) and len(checked) == 2
    with pytest.raises(TypeError, match="stride must be an int"):
        wt.conv2d(x, conv.weight, stride=True)  # a bool equals 1 as a key: never taken for the signature of 1


@pytest.mark.parametrize("transposed", [False, True])
def test_operands_of_other_strides_are_a_signature_of_their_own(transposed):
    """A signature's record keeps whether an operand is channels-last, which follows from its strides: the same
    shapes and parameters with an input or a weight of the other format give a result in that call's format."""
    torch.manual_seed(0)
    conv = (wt.ConvTranspose2d(3, 4, 3, stride=2) if transposed else wt.Conv2d(3, 4, 3)).double()
    ref = F.conv_transpose2d if transposed else F.conv2d
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    weight = conv.weight.detach().clone()
    last = torch.channels_last
    for x_format, w_format in [(None, None), (last, None), (None, None), (None, last), (last, last), (None, None)]:
        xf = x if x_format is None else x.contiguous(memory_format=x_format)
        with torch.no_grad():
            conv.weight.copy_(weight)
            conv.weight.data = conv.weight.data.contiguous(memory_format=w_format or torch.contiguous_format)
            y = conv(xf)
        expected = last if last in (x_format, w_format) else torch.contiguous_format
        assert y.is_contiguous(memory_format=expected) and not y.is_contiguous(
            memory_format=torch.contiguous_format if expected is last else last)
        assert close(y, ref(x, weight, conv.bias, **({"stride": 2} if transposed else {})))
