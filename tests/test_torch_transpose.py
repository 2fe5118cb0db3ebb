"""wsarena.torch's transposed convolutions on CPU tensors: conv_transpose1d/2d/3d, ConvTranspose1d/2d/3d and
convert() against torch.nn.functional's and torch.nn's, with their autograd gradients.

Tolerances as in test_torch.py: float64 within 1e-10 of torch's relative to the largest magnitude, float32 within
1e-4 (sums in another order), bfloat16 under autocast within 2e-2; gradcheck with its own float64 defaults.
"""

import copy

import pytest

from wsarena import ops

torch = pytest.importorskip("torch")  # before test_torch's helpers, which import it
F = torch.nn.functional
wt = pytest.importorskip("wsarena.torch")

from .test_torch import TOL64, check_cpu_autocast, close, gradients

CASES = [  # nd, input shape, weight shape (C_in, C_out/groups, *kernel), keyword arguments
    (1, (2, 4, 7), (4, 3, 3), {"stride": 3, "padding": 1, "output_padding": 2, "groups": 2, "dilation": 2}),
    (2, (2, 4, 5, 6), (4, 2, 3, 2),
     {"stride": (2, 3), "padding": (1, 0), "output_padding": (1, 2), "dilation": (1, 2)}),
    (2, (1, 6, 4, 4), (6, 1, 3, 3), {"stride": 2, "padding": 1, "output_padding": 1, "groups": 6}),  # depthwise
    (2, (2, 3, 5, 5), (3, 4, 1, 1), {}),  # every default
    (3, (1, 2, 3, 4, 3), (2, 3, 2, 3, 1), {"stride": 2, "output_padding": (1, 0, 1), "dilation": (1, 1, 2)}),
    (2, (2, 4, 5, 6), (4, 3, 3, 3), {"stride": [2], "padding": (1,), "output_padding": (1,), "dilation": (1,)}),
    (1, (2, 3, 5), (3, 2, 2), {}),  # every default, in each dimension
    (3, (1, 2, 3, 4, 3), (2, 3, 2, 1, 2), {}),
]
FUNCTIONS = {1: (wt.conv_transpose1d, F.conv_transpose1d), 2: (wt.conv_transpose2d, F.conv_transpose2d),
             3: (wt.conv_transpose3d, F.conv_transpose3d)}
TOLERANCES = {torch.float64: TOL64, torch.float32: 1e-4}


def tensors(x_shape, w_shape, groups=1, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(w_shape, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(w_shape[1] * groups, dtype=dtype, generator=g).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("nd", "x_shape", "w_shape", "kw"), CASES)
def test_outputs_and_gradients_match_torch(nd, x_shape, w_shape, kw, dtype):
    ours, theirs = FUNCTIONS[nd]
    x, w, b = tensors(x_shape, w_shape, kw.get("groups", 1), dtype)
    y, ref = ours(x, w, b, **kw), theirs(x, w, b, **kw)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert close(y, ref, TOLERANCES[dtype])
    got, expected = gradients(y, ref, (x, w, b))
    assert all(close(g, e, TOLERANCES[dtype]) for g, e in zip(got, expected))


@pytest.mark.parametrize(("nd", "x_shape", "w_shape", "kw"), CASES[:3])
def test_gradcheck_in_float64(nd, x_shape, w_shape, kw):
    ours, _ = FUNCTIONS[nd]
    x, w, b = tensors(x_shape, w_shape, kw.get("groups", 1))
    assert torch.autograd.gradcheck(lambda x, w, b: ours(x, w, b, **kw), (x, w, b))


def test_the_passes_are_the_convolutions_three_in_other_roles(monkeypatch):
    """Forward is backward-data; the input gradient is a forward; the weight gradient is backward-filter with the
    gradient as the convolution's input and the transposed convolution's input as its output gradient."""
    calls = []
    for name in ("conv_forward", "conv_backward_data", "conv_backward_filter"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: calls.append(
            (_name, tuple(a[0].shape), tuple(a[1].shape))) or _real(*a, **k))
    x, w, b = tensors((2, 4, 5, 5), (4, 3, 3, 3))
    y = wt.conv_transpose2d(x, w, b, stride=2, output_padding=1)
    y.sum().backward()
    assert y.shape == (2, 3, 12, 12)
    assert calls == [("conv_backward_data", (2, 4, 5, 5), (4, 3, 3, 3)),  # dy of the convolution: x
                     ("conv_forward", (2, 3, 12, 12), (4, 3, 3, 3)),  # the gradient, convolved
                     ("conv_backward_filter", (2, 3, 12, 12), (2, 4, 5, 5))]  # the gradient as input, x as dy


def test_unbatched_input_as_torch_takes_it():
    x, w, b = tensors((4, 5, 5), (4, 3, 3, 3))
    y = wt.conv_transpose2d(x, w, b, stride=2)
    assert y.shape == (3, 11, 11) and close(y, F.conv_transpose2d(x, w, b, stride=2))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("nd", [2, 3])
def test_channels_last_runs_as_nhwc_and_gives_torchs_memory_format(nd, dtype):
    """Channels-last results and input gradients, as PyTorch's; but a 3-D float64 transposed convolution's are
    contiguous, as PyTorch's CPU kernel for it writes them."""
    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    x, w, b = tensors((2, 4, *(4,) * nd), (4, 3, *(3,) * nd), dtype=dtype)
    xl = x.detach().to(memory_format=fmt).requires_grad_()
    ours, theirs = FUNCTIONS[nd]
    kw = {"stride": 2, "padding": 1, "output_padding": 1}
    y, ref = ours(xl, w, b, **kw), theirs(xl, w, b, **kw)
    assert y.stride() == ref.stride()
    assert y.is_contiguous(memory_format=fmt) == (nd == 2 or dtype == torch.float32)
    assert close(y, ref, TOLERANCES[dtype])
    got, expected = gradients(y, ref, (xl, w, b))
    assert all(close(g, e, TOLERANCES[dtype]) for g, e in zip(got, expected))
    assert got[0].stride() == expected[0].stride()


def test_autocast_on_the_cpu_gives_torchs_dtype_and_values():
    check_cpu_autocast(wt.conv_transpose2d, F.conv_transpose2d, tensors((2, 4, 5, 5), (4, 3, 3, 3)),
                       stride=2, padding=1)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"output_padding": 1}, ValueError, r"output_padding=\(1, 1\) must be smaller than stride=\(1, 1\)"),
        ({"output_padding": 1, "dilation": 2}, ValueError, "smaller than stride"),  # torch takes it; wsarena not
        ({"groups": 3}, ValueError, r"groups=3 must be >= 1 and divide the input channels \(4\)"),
        ({"padding": "same"}, TypeError, "padding must be an int"),
        ({"padding": 5}, ValueError, "leaves an output of size"),
        ({"stride": 0}, ValueError, "stride"),
        ({"bias": torch.zeros(4, dtype=torch.float64)}, ValueError, r"bias must have shape \(2,\)"),  # the output's
        ({"bias": torch.zeros(2, 1, dtype=torch.float64)}, ValueError, r"not \(2, 1\)"),
    ],
)
def test_bad_arguments_are_clear_errors(kw, error, match):
    x, w, _ = (t.detach() for t in tensors((1, 4, 4, 4), (4, 2, 3, 3)))
    with pytest.raises(error, match=match):
        wt.conv_transpose2d(x, w, **kw)


def test_an_input_whose_channels_the_weight_does_not_take_is_refused():
    x, w, _ = (t.detach() for t in tensors((1, 3, 4, 4), (4, 2, 3, 3)))
    with pytest.raises(ValueError, match=r"has 3 channels; weight_shape=\(4, 2, 3, 3\) takes 4"):
        wt.conv_transpose2d(x, w)
    with pytest.raises(TypeError, match="dtypes differ"):
        wt.conv_transpose2d(x, w.float())


@pytest.mark.parametrize("cls", ["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"])
def test_modules_take_torchs_constructor_state_dict_and_output_size(cls):
    nd = int(cls[-2])
    kw = {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "dilation": 1, "dtype": torch.float64}
    torch.manual_seed(0)
    theirs = getattr(torch.nn, cls)(4, 6, 3, **kw)
    ours = getattr(wt, cls)(4, 6, 3, **kw)
    assert isinstance(ours, getattr(torch.nn, cls))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, *(5,) * nd, dtype=torch.float64)
    assert close(ours(x), theirs(x)) and ours(x).shape[2:] == (10,) * nd
    size = [9] * nd  # the other size within one stride (output_padding 0), given as forward's output_size
    assert ours(x, output_size=size).shape[2:] == theirs(x, output_size=size).shape[2:] == tuple(size)
    assert close(ours(x, output_size=size), theirs(x, output_size=size))


def test_padding_modes_and_output_padding_wsarena_cannot_run_are_refused():
    with pytest.raises(ValueError, match='Only "zeros" padding mode'):  # PyTorch's own check
        wt.ConvTranspose2d(3, 4, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match=r"ConvTranspose2d: output_padding=\(1, 1\) is not smaller than stride"):
        wt.ConvTranspose2d(3, 4, 3, output_padding=1, dilation=2)
    conv = wt.ConvTranspose2d(3, 4, 3)
    conv.padding_mode = "circular"  # changed after construction: refused when it runs
    with pytest.raises(ValueError, match="ConvTranspose2d: padding_mode='circular'"):
        conv(torch.zeros(1, 3, 5, 5))


@pytest.mark.parametrize(("attribute", "value"), [
    ("stride", 2), ("output_padding", 1), ("stride", [3, 2]), ("output_padding", (1,)), ("stride", [3]),
])
def test_parameters_set_after_construction_as_ints_or_lists_run_as_torchs(attribute, value):
    """PyTorch's transposed modules read their parameters each forward, and an int there (or one value in a
    sequence) is one per dimension:
    converted or made by wsarena, a module so changed runs as PyTorch's; one whose output_padding it makes too
    large is refused by the module, and left to PyTorch by convert."""
    torch.manual_seed(0)
    theirs = torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, dtype=torch.float64)
    setattr(theirs, attribute, value)
    ours = wt.convert(torch.nn.Sequential(copy.deepcopy(theirs)))[0]
    assert type(ours) is wt.ConvTranspose2d
    made = wt.ConvTranspose2d(3, 4, 3, stride=2, padding=1, dtype=torch.float64)
    made.load_state_dict(theirs.state_dict())
    setattr(made, attribute, value)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    assert close(ours(x), theirs(x)) and close(made(x), theirs(x))
    theirs.stride = ours.stride = made.stride = 1  # now output_padding=1 (or 0) with stride 1
    if attribute == "output_padding":
        with pytest.raises(ValueError, match=r"output_padding=\(1, 1\) is not smaller than stride=\(1, 1\)"):
            made(x)
        assert type(wt.convert(torch.nn.Sequential(theirs))[0]) is torch.nn.ConvTranspose2d
    else:
        assert close(made(x), theirs(x))


class EncoderDecoder(torch.nn.Module):
    """Convolutions down, transposed convolutions (1-D, 2-D, one grouped) back up, as a segmentation net has."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU())
        self.up = torch.nn.Sequential(
            torch.nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1), torch.nn.ReLU(),
            torch.nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1, groups=2, bias=False), torch.nn.ReLU(),
        )
        self.line = torch.nn.ConvTranspose1d(8, 2, 3, stride=2, padding=1, output_padding=1, dilation=2)

    def forward(self, x):
        y = self.up(self.down(x))
        return self.line(y.flatten(2))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_convert_swaps_transposed_convolutions_and_keeps_outputs_and_gradients(dtype):
    torch.manual_seed(0)
    model = EncoderDecoder().to(dtype)
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert wt.convert(model) is model
    assert [type(m) for m in model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)] == [
        wt.Conv2d, wt.Conv2d, wt.ConvTranspose2d, wt.ConvTranspose2d, wt.ConvTranspose1d]
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    x = torch.randn(2, 3, 16, 16, dtype=dtype)
    y, ref = model(x), reference(x)
    tol = TOLERANCES[dtype]
    assert y.shape == ref.shape and close(y, ref, tol)
    dy = torch.randn_like(ref)
    y.backward(dy)
    ref.backward(dy)
    # relative to the largest gradient of the model, as in test_torch.py
    scale = max(float(p.grad.abs().max()) for p in reference.parameters())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= tol * scale, name
    roundtrip = EncoderDecoder().to(dtype)
    roundtrip.load_state_dict(model.state_dict())  # a converted model's state_dict loads into torch's own
    assert close(roundtrip(x), ref, tol)


def test_convert_leaves_a_transposed_convolution_it_cannot_run_to_pytorch():
    """output_padding below the dilation but not the stride: PyTorch runs it, no backward-data gives it."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1),
                                torch.nn.ConvTranspose2d(4, 4, 3, output_padding=1, dilation=2)).double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    ref = model(x)
    wt.convert(model)
    assert [type(m) for m in model] == [wt.ConvTranspose2d, torch.nn.ConvTranspose2d]
    assert close(model(x), ref, TOL64)
    with pytest.raises(ValueError, match=r"output_padding=\(1, 1\) is not smaller than stride=\(1, 1\)"):
        wt.ConvTranspose2d(4, 4, 3, output_padding=1, dilation=2)


def test_torch_compile_takes_a_model_with_transposed_convolutions_in_one_graph():
    torch.manual_seed(3)
    model = EncoderDecoder().double()
    reference = copy.deepcopy(model)
    compiled = torch.compile(wt.convert(model), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y, ref = compiled(x), reference(x)
    assert close(y, ref)
    y.sum().backward()
    ref.sum().backward()
    assert all(close(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
