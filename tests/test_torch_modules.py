"""wsarena.torch's modules as PyTorch's tools see them, on CPU tensors: their signature, state_dict both ways,
copies and pickles of converted models, TorchScript (refused clearly), torch.jit.trace and torch.export.

Tolerance as in test_torch.py: float64 within 1e-10 of torch's, relative to the largest magnitude.
"""

import copy
import inspect
import io
import pickle
import warnings

import pytest

import wsarena

torch = pytest.importorskip("torch")  # before test_torch's helpers, which import it
wt = pytest.importorskip("wsarena.torch")
nn = torch.nn

from .test_torch import close, leased  # noqa: F401 - leased: the fixture

NAMES = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


@pytest.mark.parametrize("name", NAMES)
def test_the_classes_signatures_are_torchs_and_instances_keep_their_calls(name):
    """inspect (and what builds a model from a config by it) sees nn.ConvNd's arguments, not (*args, **kwargs)."""
    ours, theirs = getattr(wt, name), getattr(nn, name)
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert "padding_mode" in inspect.signature(ours).parameters
    module = ours(2, 2, 1)
    assert inspect.signature(module) == inspect.signature(theirs(2, 2, 1))


def test_a_subclass_with_its_own_init_has_that_signature():
    """A model's own layer made from wsarena's class is built by its own arguments, as one made from PyTorch's."""

    class Layer(wt.Conv2d):
        def __init__(self, channels, *, kernel=3):
            super().__init__(channels, channels, kernel, padding=kernel // 2)

    class Plain(Layer):  # no __init__ of its own: Layer's
        pass

    assert list(inspect.signature(Layer).parameters) == ["channels", "kernel"]
    assert list(inspect.signature(Plain).parameters) == ["channels", "kernel"]
    assert Layer(2).kernel_size == (3, 3)


def test_a_parametrized_module_of_wsarenas_has_torchs_signature():
    """The class parametrize makes (or convert() makes over a parametrized PyTorch module) is read as the class it
    extends, nn.Conv2d's arguments, not by looking itself up again until the recursion limit."""
    made = wt.Conv2d(2, 2, 1)
    torch.nn.utils.parametrize.register_parametrization(made, "weight", nn.Identity())
    converted = wt.convert(torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(2, 2, 1)))
    for module in (made, converted):
        assert isinstance(module, wt.Conv2d) and type(module).__name__ == "ParametrizedConv2d"
        assert inspect.signature(type(module)) == inspect.signature(nn.Conv2d)


@pytest.mark.parametrize("name", NAMES[:3])
def test_state_dicts_load_both_ways_between_torchs_modules_and_wsarenas(name):
    torch.manual_seed(0)
    nd = int(name[-2])
    kw = {"padding": "same", "dilation": 2, "groups": 2, "bias": False, "dtype": torch.float64}
    theirs, ours = getattr(nn, name)(4, 6, 3, **kw), getattr(wt, name)(4, 6, 3, **kw)
    x = torch.randn(2, 4, *(7,) * nd, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    assert close(ours(x), theirs(x))
    nn.init.normal_(ours.weight)
    theirs.load_state_dict(ours.state_dict())
    assert close(theirs(x), ours(x))


def test_converted_models_deepcopy_pickle_and_save_as_wsarenas():
    torch.manual_seed(0)
    shared = nn.Conv2d(4, 4, 3, padding=1)
    model = wt.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(shared, nn.ReLU(), shared),
                                     nn.ConvTranspose2d(4, 2, 2, stride=2)))
    x = torch.randn(1, 3, 8, 8)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False))
    for other in copies:
        assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()]
        assert other[1][0] is other[1][2]  # a shared module stays shared
        assert torch.equal(other(x), expected)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch.ao's import
def test_batch_norms_folded_before_converting_or_by_fuse_conv_bn_eval_give_torchs_results():
    """As the README says: PyTorch's fusion tools that look for its classes fold before convert(), and
    fuse_conv_bn_eval folds into wsarena's modules, which it keeps."""
    from torch.fx.experimental import optimization

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    model = model.double().eval()
    for norm in (model[1], model[4]):
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fused = (torch.ao.quantization.fuse_modules(copy.deepcopy(model), [["0", "1", "2"], ["3", "4"]]),
             optimization.fuse(copy.deepcopy(model)))
    for folded in map(wt.convert, fused):
        convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
        assert len(convs) == 2 and all(type(m) is wt.Conv2d for m in convs)
        assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
        assert close(folded(x), model(x))
    with pytest.raises(AssertionError, match="did not find fuser method.*wsarena"):
        torch.ao.quantization.fuse_modules(wt.convert(copy.deepcopy(model)), [["0", "1"]])
    conv = torch.nn.utils.fusion.fuse_conv_bn_eval(wt.convert(copy.deepcopy(model))[0], model[1])
    assert type(conv) is wt.Conv2d and close(conv(x), model[1](model[0](x)))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("make", [lambda: wt.Conv2d(3, 4, 3),
                                  lambda: wt.convert(nn.Sequential(nn.Sequential(nn.ConvTranspose1d(3, 4, 3))))])
def test_torchscript_is_refused_naming_the_module_and_what_takes_it(make):
    with pytest.raises(TypeError, match=r"wsarena.torch.Conv\w+ cannot be compiled by TorchScript.*torch.compile"):
        torch.jit.script(make())


def assert_runs_and_trains_as(traced, model, x):
    """``traced(x)`` gives ``model(x)``, and the gradients of its sum reach the model's parameters as its own do."""
    assert close(traced(x), model(x))
    traced(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert all(close(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_torch_jit_trace_records_the_passes_without_warnings_and_trains():
    """A trace that reads no tensor as a Python number (channels-last strides, a bias's shape, 'same' padding)."""
    torch.manual_seed(0)
    model = nn.Sequential(wt.Conv2d(3, 4, 4, padding="same"), nn.ReLU(), wt.ConvTranspose2d(4, 2, 3, stride=2))
    model = model.double().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's own
        traced = torch.jit.trace(model, x)
    assert_runs_and_trains_as(traced, model, x)


def test_torch_fx_symbolic_trace_records_each_convolution_as_one_call_and_trains():
    """As fx records F.conv2d: a converted model's graph calls wsarena.torch's functions (what feature extractors and
    fx passes build on), and runs and trains as the model does. Each ran on fx's Proxy objects and raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding="same"), nn.ReLU(), nn.ConvTranspose1d(4, 2, 3, stride=2))
    model = wt.convert(model.double())
    graph = torch.fx.symbolic_trace(model)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets == [wt.conv1d, wt.conv_transpose1d]
    x = torch.randn(2, 3, 9, dtype=torch.float64)
    assert_runs_and_trains_as(graph, model, x)


def test_a_tensor_subclass_with_torch_function_sees_the_call():
    """A ``__torch_function__`` subclass is handed wsarena.torch's function, as it is handed F.conv2d."""
    seen = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    y = wt.conv2d(x.as_subclass(Logged), w, padding=1)
    assert seen[0] is wt.conv2d and type(y) is Logged
    assert close(y.as_subclass(torch.Tensor), torch.nn.functional.conv2d(x, w, padding=1))


def test_torch_export_takes_the_custom_operators():
    model = nn.Sequential(wt.Conv2d(3, 4, 3, padding=1), wt.ConvTranspose2d(4, 2, 2, stride=2)).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    exported = torch.export.export(model, (x,))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"wsarena.conv_forward.default", "wsarena.conv_backward_data.default"} <= targets
    assert close(exported.module()(x), model(x))


@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_model_trains_as_torchs_does(strict, leased):  # noqa: F811 - the fixture
    """The exported graph holds the operators themselves, not the Functions: their gradients are registered with
    them (without, a backward through a non-strict export raised, and a strict one dropped the convolutions'
    gradients), and run under the forward's settings too."""
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.ConvTranspose2d(4, 2, 2, stride=2)).double()
    ours = wt.convert(copy.deepcopy(theirs))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    warnings.simplefilter("ignore", wsarena.WorkspaceCapWarning)  # pytest restores the filters after the test

    def gradients(model):
        exported = torch.export.export(model, (x,), strict=strict).module()
        given = x.clone().requires_grad_()
        with wsarena.config(cap_workspace=0):
            y = exported(given)
        leased.clear()
        y.pow(2).sum().backward()
        # by name: a strict export on PyTorch 2.9 lists a converted model's parameters in another order
        return {"input": given.grad, **{name: p.grad for name, p in exported.named_parameters()}}

    expected = gradients(theirs)
    got = gradients(ours)
    assert len(leased) == 4 and max(leased) == 0  # both layers' two backward passes, under the forward's cap
    assert got.keys() == expected.keys() and len(got) == 5
    assert all(got[name] is not None and close(got[name], e) for name, e in expected.items())


def test_a_saved_exported_program_loads_in_a_new_process_that_imports_wsarena_torch(tmp_path):
    """``torch.export.save`` writes the operators by name (``torch.ops.wsarena.*``): a process that imports
    wsarena.torch first (README) loads and runs the program, giving PyTorch's results (float64, 1e-10); one that
    does not cannot resolve them, as with any custom operator's library."""
    import subprocess
    import sys

    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.ConvTranspose2d(4, 2, 2, stride=2)).double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    torch.export.save(torch.export.export(wt.convert(copy.deepcopy(theirs)), (x,)), tmp_path / "model.pt2")
    torch.save({"x": x, "expected": theirs(x).detach()}, tmp_path / "data.pt")
    script = (
        "import sys, torch\n"
        "if sys.argv[1] == 'import': import wsarena.torch\n"
        f"data = torch.load({str(tmp_path / 'data.pt')!r})\n"
        f"y = torch.export.load({str(tmp_path / 'model.pt2')!r}).module()(data['x'])\n"
        "error = (y - data['expected']).abs().max() / data['expected'].abs().max()\n"
        "print(float(error))\n"
    )
    run = [sys.executable, "-c", script]
    loaded = subprocess.run([*run, "import"], capture_output=True, text=True, timeout=240, check=False)
    assert loaded.returncode == 0, loaded.stderr
    assert float(loaded.stdout) < 1e-10
    missing = subprocess.run([*run, "no-import"], capture_output=True, text=True, timeout=240, check=False)
    assert missing.returncode != 0 and "torch.ops.wsarena.conv_forward" in missing.stderr


def test_flop_counter_counts_a_converted_model_as_torchs():
    """``torch.utils.flop_counter.FlopCounterMode`` counts each operator by PyTorch's formula for the pass it is: a
    converted model's forward and backward count what PyTorch's convolutions count (they counted nothing), grouped,
    transposed and 1-D ones among them, and so under ``vmap``."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=4),
                           nn.ConvTranspose2d(8, 4, 3, stride=2, groups=2), nn.Flatten(2),
                           nn.Conv1d(4, 6, 2, dilation=2))
    ours = wt.convert(copy.deepcopy(theirs))
    x = torch.randn(2, 3, 10, 10, requires_grad=True)

    def counted(model):
        with FlopCounterMode(display=False) as counter:
            y = model(x)
            forward = counter.get_total_flops()
            y.sum().backward()
            both = counter.get_total_flops()
            torch.func.vmap(model)(x.detach().expand(3, -1, -1, -1, -1))
        return forward, both, counter.get_total_flops()

    got = counted(ours)
    assert got == counted(theirs) and 0 < got[0] < got[1] < got[2]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_custom_operators_pass_torch_library_opcheck(fmt, dtype):
    """PyTorch's own check of a custom operator: its schema, fake (torch.compile's) against real results, and its
    registered gradient (the operands require grad)."""
    layout = "NHWC" if fmt == torch.channels_last else "NCHW"
    x = torch.randn(2, 4, 7, 7, dtype=dtype).contiguous(memory_format=fmt).requires_grad_()  # and the gradients
    w = torch.randn(6, 2, 3, 3, dtype=dtype).contiguous(memory_format=fmt).requires_grad_()
    conv = ([2, 1], [1, 1], [1, 2], 2, layout)
    y = torch.ops.wsarena.conv_forward(x, w, *conv).detach().requires_grad_()
    ops = torch.ops.wsarena
    for op, args in ((ops.conv_forward.default, (x, w, *conv)),
                     (ops.conv_backward_data.default, (y, w, list(x.shape), *conv)),
                     (ops.conv_backward_filter.default, (x, y, list(w.shape), *conv))):
        torch.library.opcheck(op, args)
