"""When wsarena.torch calls its custom operators through PyTorch's dispatcher, and when straight: an ordinary
forward and backward on plain tensors skip the dispatcher (its cost is measured in bench/bench_interop.py), and
whatever watches or transforms operators (a dispatch mode, the profiler, forward AD, batched gradients) still sees
them and gets torch's results.

Tolerance as in test_torch.py: float64 within 1e-10 of torch's, relative to the largest magnitude.
"""

from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")  # before test_torch's helpers, which import it
F = torch.nn.functional
wt = pytest.importorskip("wsarena.torch")
from wsarena.torch import _ops

from .test_torch import close

NAMES = ["conv_forward", "conv_backward_data", "conv_backward_filter"]


@pytest.fixture
def straight(monkeypatch):
    """The names of the operators run straight, without the dispatcher, in order."""
    calls = []
    for op, kernel in list(_ops._KERNELS.items()):
        monkeypatch.setitem(_ops._KERNELS, op, lambda *a, _k=kernel: calls.append(_k.__name__.lstrip("_")) or _k(*a))
    return calls


def tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64, generator=g).requires_grad_()
    conv = wt.Conv2d(4, 6, 3, padding=1).double()
    return x, conv


def test_an_ordinary_forward_and_backward_run_the_operators_straight(straight):
    x, conv = tensors()
    y = conv(x)
    y.pow(2).sum().backward()
    assert straight == NAMES
    ref = F.conv2d(x, conv.weight, conv.bias, padding=1)
    assert close(y, ref)


def test_the_operators_run_straight_where_a_dispatch_key_set_equals_only_itself(straight, monkeypatch):
    """As before PyTorch 2.8 (2.7), whose DispatchKeySet defines no ``==``: two sets of the same keys were unequal,
    so the operators never ran straight. Simulated by key sets that compare by identity; an ordinary forward and
    backward run them straight still."""

    class Keys:
        def __init__(self, keys):
            self.keys = keys

        def __getattr__(self, name):
            return getattr(self.keys, name)

    dispatch_keys = torch._C._dispatch_keys
    monkeypatch.setattr(torch._C, "_dispatch_keys", lambda t: Keys(dispatch_keys(t)))
    monkeypatch.setattr(_ops, "_plain_keys", {})
    assert torch._C._dispatch_keys(torch.empty(0)) != torch._C._dispatch_keys(torch.empty(0))
    test_an_ordinary_forward_and_backward_run_the_operators_straight(straight)


def test_a_dispatch_mode_sees_every_operator(straight):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "wsarena":
                seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    x, conv = tensors()
    with Watch():
        conv(x).pow(2).sum().backward()
    assert seen == NAMES and straight == []


def test_the_profiler_records_every_operator(straight):
    x, conv = tensors()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        conv(x).pow(2).sum().backward()
    names = {event.name for event in profile.events()}
    assert {f"wsarena::{name}" for name in NAMES} <= names and straight == []


def test_gradients_batched_by_autograd_go_through_the_dispatcher(straight):
    """``is_grads_batched`` batches a backward's tensors (dispatch key Batched): the operators' vmap rules batch
    them, where the straight path would see one sample's worth of memory."""
    x, conv = tensors()
    y, ref = conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1)
    dys = torch.randn(3, *y.shape, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, conv.weight), dys, is_grads_batched=True)
    expected = torch.autograd.grad(ref, (x, conv.weight), dys, is_grads_batched=True)
    assert all(close(g, e) for g, e in zip(got, expected))
    assert straight == ["conv_forward"]  # the forward alone: its tensors are plain


def test_meta_tensors_go_through_the_dispatcher(straight):
    """A meta tensor has no memory: the operators' fake kernels give its shape."""
    x = torch.empty(2, 4, 7, 7, device="meta")
    y = wt.Conv2d(4, 6, 3, stride=2, device="meta")(x)
    assert y.device.type == "meta" and y.shape == (2, 6, 3, 3) and straight == []


class Recorded(torch.Tensor):
    """A subclass seen only by the dispatcher (``__torch_dispatch__``, no ``__torch_function__``, as DTensor):
    it records each operator and runs it on the tensor it wraps."""

    seen: ClassVar[list] = []
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                   device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        cls.seen.append(func.__name__.split(".")[0])
        out = func(*tree_map(lambda t: t.elem if isinstance(t, Recorded) else t, args), **(kwargs or {}))
        return tree_map(lambda t: Recorded(t) if isinstance(t, torch.Tensor) else t, out)


@pytest.fixture
def fresh(monkeypatch):
    """As in a new process: no plain tensor's dispatch keys known yet."""
    monkeypatch.setattr(_ops, "_plain_keys", {})


def test_a_meta_tensor_first_in_a_process_goes_through_the_dispatcher(fresh, straight):
    """The first call's device must not become what a plain tensor is: a meta one has no memory to run on."""
    x = torch.empty(2, 4, 7, 7, device="meta")
    y = wt.Conv2d(4, 6, 3, stride=2, device="meta")(x)
    assert y.device.type == "meta" and y.shape == (2, 6, 3, 3) and straight == []


def test_a_first_call_under_a_fake_mode_leaves_subclasses_to_the_dispatcher(fresh, straight, monkeypatch):
    """A first call under a dispatch mode (a FakeTensorMode's trace) must not take the mode's tensors for plain
    ones: a subclass with the same dispatch keys would then skip its ``__torch_dispatch__``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():
        wt.conv2d(torch.empty(2, 4, 7, 7), torch.empty(6, 4, 3, 3))
    monkeypatch.setattr(Recorded, "seen", [])
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(shape, dtype=torch.float64, generator=g) for shape in ((2, 4, 7, 7), (6, 4, 3, 3)))
    with torch.no_grad():
        y = wt.conv2d(Recorded(x), Recorded(w))
    assert "conv_forward" in Recorded.seen and straight == []
    assert close(y.elem, F.conv2d(x, w))
    x, conv = tensors()
    conv(x).pow(2).sum().backward()
    assert straight == NAMES  # and plain tensors still run straight


def test_a_first_call_in_inference_mode_leaves_ordinary_calls_straight(fresh, straight):
    """Tensors made in inference mode have no autograd keys; those of a first call there are not a plain
    tensor's, or no call after it would run straight."""
    x, conv = tensors()
    with torch.inference_mode():
        ref = conv(x)
    assert straight == ["conv_forward"]
    straight.clear()
    y = conv(x)
    y.pow(2).sum().backward()
    assert straight == NAMES and close(y, ref)


def test_torch_function_modes_and_subclasses_see_the_operators(straight):
    """A torch-function mode is shown the call, and a subclass that handles torch functions gets its class back, as
    from torch.nn.functional's convolution: the mode sees wsarena.torch's function (as it sees torch.conv2d), and
    the operator only when the function runs with the mode in force (a mode that calls it as it is; inside its
    ``__torch_function__`` the mode is not). While a mode is in force, only the torch-function check keeps the
    operators off the straight path. A subclass's call runs with subclasses' torch functions off, as PyTorch runs
    torch.conv2d for it, and its result comes back of its class."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    class Through(TorchFunctionMode):  # lets the function run with the mode in force
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            if func is wt.conv2d:
                with self:
                    return func.__wrapped__(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    x, conv = tensors()
    with Watch():
        conv(x)
    assert seen == [str(wt.conv2d)]
    straight.clear()  # the mode had the call; calling it on, it runs without the mode, as torch.conv2d does
    with Through():
        conv(x)
    assert seen[1] == str(wt.conv2d) and "wsarena.conv_forward.default" in seen and straight == []
    xs = x.detach().as_subclass(Sub)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            y, ref = conv(xs), F.conv2d(xs, conv.weight, conv.bias, padding=1)
        assert type(y) is type(ref) is Sub and close(y, ref)


# -- inference mode ------------------------------------------------------------------------------------------------
# An inference tensor carries its backend's and Autocast's dispatch keys alone (an ordinary one ADInplaceOrView's
# and Autograd's too); inference mode excludes the Autograd keys and includes no ADInplaceOrView, which the operators
# fall through anyway (they mutate nothing). Either way the dispatcher reaches the operator's backend kernel alone,
# the same Python function, run in the same mode.


def operands(dtype=torch.float64):
    """Each operator's arguments, float64 or a half type: ``(op, a, b, *rest)``."""
    g = torch.Generator().manual_seed(1)
    x, w, dy = (torch.randn(s, generator=g).to(dtype) for s in ((2, 4, 7, 7), (6, 4, 3, 3), (2, 6, 5, 5)))
    conv = ([1, 1], [0, 0], [1, 1], 1, "NCHW")
    return [(_ops.conv_forward, x, w, *conv), (_ops.conv_backward_data, dy, w, [2, 4, 7, 7], *conv),
            (_ops.conv_backward_filter, x, dy, [6, 4, 3, 3], *conv)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_inference_mode_runs_the_operators_straight_as_the_dispatcher_would(straight, dtype):
    """Inference and ordinary operands mixed (activations made in inference mode, ordinary weights): each operator
    runs straight and gives the dispatcher's result bit for bit, an inference tensor without gradient, and leaves
    the ordinary operands' version counters as they were."""
    for name, (op, a, b, *rest) in zip(NAMES, operands(dtype)):
        versions = a._version, b._version
        with torch.inference_mode():
            ia, ib = a.clone(), b.clone()  # inference tensors
            for pair in ((ia, b), (a, ib), (ia, ib), (a, b)):
                got = _ops.call(op, *pair, *rest)
                assert straight[-1] == name
                expected = op(*pair, *rest)  # the operator itself: always through the dispatcher
                assert torch.equal(got, expected) and got.dtype == expected.dtype == dtype
                assert got.is_inference() and expected.is_inference()
                assert not got.requires_grad and not expected.requires_grad
        assert (a._version, b._version) == versions
    assert len(straight) == 12


def test_inference_tensors_outside_inference_mode_run_straight(straight):
    """Used without gradient after inference mode, inference tensors reach the backend kernel alone too; the
    results are ordinary tensors, the dispatcher's, with version counters of their own."""
    for op, a, b, *rest in operands():
        with torch.inference_mode():
            made = a.clone()
        with torch.no_grad():
            got, expected = _ops.call(op, made, b, *rest), op(made, b, *rest)
        assert torch.equal(got, expected) and not got.is_inference() and not expected.is_inference()
        assert got._version == expected._version == 0
    assert len(straight) == 3


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_results_have_version_0_as_the_dispatchers_do(dtype):
    """A result is new: nothing has written it since it was made, as for PyTorch's own convolutions, also where a
    half type on the CPU is computed in float32 and copied into it."""
    for op, a, b, *rest in operands(dtype):
        with torch.no_grad():
            assert _ops.call(op, a, b, *rest)._version == op(a, b, *rest)._version == 0
    assert F.conv2d(*operands(dtype)[0][1:3])._version == 0


def test_a_module_in_inference_mode_runs_straight_and_matches_torch(straight):
    x, conv = tensors()
    with torch.inference_mode():
        y = conv(x)
        h = conv.weight.new_ones(6, 6, 1, 1)  # an inference tensor as a second layer's weight
        z = wt.conv2d(y, h)
        ref = F.conv2d(F.conv2d(x, conv.weight, conv.bias, padding=1), h)
    assert straight == ["conv_forward", "conv_forward"]
    assert z.is_inference() and not z.requires_grad and close(z, ref)


def test_inference_mode_leaves_what_the_dispatcher_handles_to_it(straight, monkeypatch):
    """Inference mode lets inference tensors' keys through, not any tensor's: a negated view (dispatch key
    Negative, which the dispatcher resolves first), a subclass seen only by the dispatcher, and a dispatch mode
    all still go through it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, conv = tensors()
    w, b = conv.weight.detach(), conv.bias.detach()
    with torch.inference_mode():
        xi = x.detach().clone()
        y = wt.conv2d(torch._neg_view(xi), w, b, padding=1)
        assert close(y, F.conv2d(-xi, w, b, padding=1))
        assert straight == []

        monkeypatch.setattr(Recorded, "seen", [])
        y = wt.conv2d(Recorded(xi), Recorded(w.clone()))
        assert "conv_forward" in Recorded.seen and close(y.elem, F.conv2d(xi, w))
        assert straight == []

        seen = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func.__name__.split(".")[0])
                return func(*args, **(kwargs or {}))

        with Watch():
            wt.conv2d(xi, w)
        assert "conv_forward" in seen and straight == []


def test_a_forward_without_grad_runs_the_operator_and_no_function(straight, monkeypatch):
    """Under ``torch.no_grad()`` (and in inference mode) no gradient can be asked of the result: the operator runs
    alone, without an autograd Function's machinery (bench/bench_interop.py times the saving), and the result is
    PyTorch's; with grad on, a Function records the graph as before."""
    from wsarena.torch import _autograd

    applied = []
    for function, form in [*_autograd._OLDER.items(), *_autograd._BIASED.items()]:
        original = form.apply
        monkeypatch.setattr(form, "apply", lambda *a, _o=original, _n=function.__name__: applied.append(_n) or _o(*a))
    x, conv = tensors()
    with torch.no_grad():
        y = conv(x)
        t = wt.conv_transpose2d(y, conv.weight, padding=1)  # (6, 4, 3, 3): 6 channels in, 4 out
        ref = F.conv2d(x, conv.weight, conv.bias, padding=1)
        ref_t = F.conv_transpose2d(ref, conv.weight, padding=1)
    assert applied == [] and straight == ["conv_forward", "conv_backward_data"]
    assert y.grad_fn is None and not y.requires_grad and close(y, ref) and close(t, ref_t)
    y = conv(x)
    assert applied == ["ConvFunction"] and y.grad_fn is not None


def test_forward_ad_without_grad_still_gives_the_tangent():
    """Forward AD does not depend on grad mode: under ``torch.no_grad()`` a dual input's tangent comes through, as
    through PyTorch's convolution (a forward run as the bare operator would drop it)."""
    import torch.autograd.forward_ad as fwad

    x, conv = tensors()
    w = conv.weight.detach()
    direction = torch.randn_like(x)
    with torch.no_grad(), fwad.dual_level():
        ours = fwad.unpack_dual(wt.conv2d(fwad.make_dual(x.detach(), direction), w, padding=1)).tangent
        theirs = fwad.unpack_dual(F.conv2d(fwad.make_dual(x.detach(), direction), w, padding=1)).tangent
    assert ours is not None and close(ours, theirs)
