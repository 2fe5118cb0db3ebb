"""GPU only: PyTorch CUDA tensors through the ops and wsarena.torch (transposed convolutions too), PyTorch's stream
and allocator, a step captured by torch.cuda.graph, CUDA array interface operands, and RAPIDS RMM under CuPy's
allocator.

Tolerances, relative to the largest magnitude: against the float64 direct convolution of the inputs rounded to the
tested dtype, float32 1e-5 (cuDNN in full float32: no TF32), float16 2e-2 and bfloat16 5e-2 (as
test_cudnn_backend.py). Against PyTorch's own convolution with TF32 off: float32 1e-4 for a whole training step
(sums in another order through batch norm), float16/bfloat16 as above.
"""

import copy

import numpy as np
import pytest

import wsarena
from wsarena import conv_backward_data, conv_backward_filter, conv_forward
from wsarena.arena import CupyProvider, TorchProvider, get_arena

from .reference import ref_conv_backward_data, ref_conv_backward_filter, ref_conv_forward

torch = pytest.importorskip("torch")  # before the helpers, which import it
F = torch.nn.functional

from .torch_models import small_resnet, step

pytestmark = pytest.mark.gpu

TOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}
KW = {"stride": 2, "padding": 1, "dilation": 1, "groups": 2}


@pytest.fixture(autouse=True)
def _no_tf32():
    """PyTorch's reference in full float32, as wsarena computes it."""
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before
    torch.cuda.synchronize()


def rel(got, ref):
    got = got.detach().double().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got, np.float64)
    ref = ref.detach().double().cpu().numpy() if isinstance(ref, torch.Tensor) else ref
    return float(np.max(np.abs(got - ref))) / (float(np.max(np.abs(ref))) or 1.0)


def cuda_problem(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 9, 9, generator=g).to("cuda", getattr(torch, dtype))
    w = torch.randn(6, 2, 3, 3, generator=g).to("cuda", getattr(torch, dtype))
    dy = torch.randn(2, 6, 5, 5, generator=g).to("cuda", getattr(torch, dtype))
    return x, w, dy


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_cuda_tensors_through_the_three_ops(dtype):
    x, w, dy = cuda_problem(dtype)
    x64, w64, dy64 = (t.double().cpu().numpy() for t in (x, w, dy))
    got = (conv_forward(x, w, **KW), conv_backward_data(dy, w, tuple(x.shape), **KW),
           conv_backward_filter(x, dy, tuple(w.shape), **KW))
    refs = (ref_conv_forward(x64, w64, **KW), ref_conv_backward_data(dy64, w64, x64.shape, **KW),
            ref_conv_backward_filter(x64, dy64, w64.shape, **KW))
    for result, ref in zip(got, refs):
        assert isinstance(result, torch.Tensor) and result.is_cuda and result.dtype == x.dtype
        assert rel(result, ref) <= TOL[dtype]
    out = torch.full_like(got[0], float("nan"))
    assert conv_forward(x, w, **KW, out=out) is out and rel(out, refs[0]) <= TOL[dtype]


def test_cuda_tensors_that_require_grad_are_taken_under_no_grad():
    """As on the host (test_interop.py): where no gradient is recorded, parameters go in as they are; their DLPack
    export alone would refuse them."""
    x, w, _ = cuda_problem("float32")
    x64, w64 = (t.double().cpu().numpy() for t in (x, w))
    w.requires_grad_()
    with torch.no_grad():
        got = conv_forward(x, w, **KW)
    assert got.is_cuda and not got.requires_grad and rel(got, ref_conv_forward(x64, w64, **KW)) <= TOL["float32"]
    with pytest.raises(TypeError, match="detach"):
        conv_forward(x, w, **KW)


@pytest.fixture
def leased_streams(monkeypatch):
    """The CUDA stream of every workspace lease taken, zero-byte ones too: an engine that needs no workspace (cuDNN
    picks one for these small problems on an H200) leases 0 bytes, which no sub-arena records."""
    from wsarena.arena import Arena
    from wsarena.arena.streams import raw_handle

    streams = []
    lease = Arena.lease

    def recorded(self, *args, **kwargs):
        ws = lease(self, *args, **kwargs)
        streams.append(raw_handle(ws.stream))  # ws.cuda_stream is set when bytes are granted
        return ws

    monkeypatch.setattr(Arena, "lease", recorded)
    return streams


def test_stream_none_runs_on_torchs_current_stream_with_torchs_memory(leased_streams):
    x, w, _ = cuda_problem("float32")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(side):
        y = conv_forward(x, w, **KW)
    torch.cuda.current_stream().wait_stream(side)
    assert leased_streams and set(leased_streams) == {side.cuda_stream}
    arena = get_arena(x.device.index)
    assert type(arena.provider) is TorchProvider  # made by a call with torch operands
    arena.reserve(1 << 20, stream=side)  # whether or not the call needed workspace
    assert arena.stats().capacity_bytes >= 1 << 20
    assert torch.cuda.memory_allocated() - before >= arena.stats().capacity_bytes  # counted in torch's pool
    assert rel(y, ref_conv_forward(x.double().cpu().numpy(), w.double().cpu().numpy(), **KW)) <= TOL["float32"]


def test_an_explicit_torch_stream_and_cupy_operands_mixed_in(leased_streams):
    import cupy

    x, w, _ = cuda_problem("float32")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    y = conv_forward(x, cupy.asarray(w), **KW, stream=side)  # both views zero-copy on one device: allowed
    side.synchronize()
    assert isinstance(y, torch.Tensor)
    assert leased_streams and set(leased_streams) == {side.cuda_stream}
    assert rel(y, ref_conv_forward(x.double().cpu().numpy(), w.double().cpu().numpy(), **KW)) <= TOL["float32"]


def test_a_cpu_tensor_beside_a_cuda_tensor_is_refused():
    x, w, _ = cuda_problem("float32")
    with pytest.raises(TypeError, match="cannot mix host and device memory"):
        conv_forward(x.cpu(), w, **KW)


class _InterfaceOnly:
    """A CUDA array known only by ``__cuda_array_interface__`` (as Numba's are)."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = array.__cuda_array_interface__


def test_cuda_array_interface_operands():
    import cupy

    x, w, _ = cuda_problem("float32")
    xc, wc = cupy.asarray(x), cupy.asarray(w)
    y = conv_forward(_InterfaceOnly(xc), _InterfaceOnly(wc), **KW)
    assert isinstance(y, cupy.ndarray)  # no library to go back to
    assert rel(cupy.asnumpy(y), ref_conv_forward(x.double().cpu().numpy(), w.double().cpu().numpy(), **KW)) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_functions_match_torchs_convolution_and_gradients(dtype, channels_last):
    import wsarena.torch as wt

    x, w, _ = cuda_problem(dtype)
    if channels_last:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    b = torch.randn(6, device="cuda", dtype=x.dtype)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    y, ref = wt.conv2d(x, w, b, **KW), F.conv2d(x, w, b, **KW)
    assert y.dtype == ref.dtype and rel(y, ref) <= TOL[dtype]
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(ref)
    for got, expected in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(ref, (x, w, b), dy)):
        assert rel(got, expected) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_transposed_functions_match_torchs_and_gradients(dtype, channels_last):
    import wsarena.torch as wt

    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(shape, generator=g).to("cuda", getattr(torch, dtype))
               for shape in ((2, 4, 9, 9), (4, 3, 3, 3), (6,)))  # weight (C_in, C_out/groups, *kernel)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    kw = {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "dilation": 1}
    y, ref = wt.conv_transpose2d(x, w, b, **kw), F.conv_transpose2d(x, w, b, **kw)
    assert y.shape == ref.shape == (2, 6, 18, 18) and y.dtype == ref.dtype and rel(y, ref) <= TOL[dtype]
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(ref)
    for got, expected in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(ref, (x, w, b), dy)):
        assert rel(got, expected) <= TOL[dtype]


@pytest.mark.parametrize("nd", [2, 3])
def test_float64_channels_last_comes_out_in_torchs_memory_format(nd):
    """PyTorch computes a float64 convolution on CUDA contiguous whatever its operands' format; results and
    gradients have its strides, and its values within float64's 1e-10."""
    import wsarena.torch as wt

    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(shape, generator=g, dtype=torch.float64).to("cuda") for shape in
            ((2, 4, *(7,) * nd), (6, 4, *(3,) * nd)))
    x, w = (t.to(memory_format=fmt).requires_grad_() for t in (x, w))
    ours, theirs = getattr(wt, f"conv{nd}d"), getattr(F, f"conv{nd}d")
    y, ref = ours(x, w, padding=1), theirs(x, w, padding=1)
    assert y.stride() == ref.stride() and rel(y, ref) <= 1e-10
    dy = torch.randn_like(ref)
    for got, expected in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        assert got.stride() == expected.stride() and rel(got, expected) <= 1e-10


def test_gradients_of_gradients_and_per_sample_gradients_on_cuda_match_torchs():
    """A gradient penalty's second backward and vmap(grad) over samples, float32 on cuDNN against PyTorch's."""
    import wsarena.torch as wt

    x, w, _ = (t.requires_grad_() for t in cuda_problem("float32"))

    def penalty(conv):
        (dx,) = torch.autograd.grad(conv(x, w, **KW).tanh().sum(), x, create_graph=True)
        return torch.autograd.grad(dx.pow(2).sum(), (x, w))

    for got, expected in zip(penalty(wt.conv2d), penalty(F.conv2d)):
        assert rel(got, expected) <= 1e-4

    def per_sample(conv):
        loss = lambda w, s: conv(s.unsqueeze(0), w, **KW).pow(2).sum()
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w.detach(), x.detach())

    assert rel(per_sample(wt.conv2d), per_sample(F.conv2d)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_on_cuda_gives_torchs_dtype(dtype):
    import wsarena.torch as wt

    x, w, _ = cuda_problem("float32")
    with torch.autocast("cuda", dtype=dtype):
        y, ref = wt.conv2d(x, w, **KW), F.conv2d(x, w, **KW)
    assert y.dtype == ref.dtype == dtype
    assert rel(y, ref) <= TOL[str(dtype).removeprefix("torch.")]


def test_a_training_step_of_a_converted_model_matches_torchs():
    import wsarena.torch as wt

    torch.manual_seed(0)
    model = small_resnet().cuda()
    reference = copy.deepcopy(model)
    wt.convert(model)
    wsarena.configure(cap_workspace="64MiB")
    x, target = torch.randn(8, 3, 32, 32, device="cuda"), torch.arange(8, device="cuda") % 5
    results = []
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        results.append(step(m, x, target))
        opt.step()
    (loss, grads), (ref_loss, ref_grads) = results
    assert rel(loss, ref_loss) <= 1e-4
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert all(float((grads[k] - ref_grads[k]).abs().max()) <= 1e-4 * scale for k in grads)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):  # after the optimizer's step
        assert rel(p, q) <= 1e-4, name
    assert get_arena(x.device.index).stats().high_water_bytes <= 64 << 20


def test_torch_compile_with_inductor_runs_the_converted_model():
    import wsarena.torch as wt

    torch.manual_seed(1)
    model = small_resnet().cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(wt.convert(model), fullgraph=True)
    x, target = torch.randn(4, 3, 32, 32, device="cuda"), torch.arange(4, device="cuda")
    loss, _ = step(compiled, x, target)
    ref_loss, _ = step(reference, x, target)
    assert rel(loss, ref_loss) <= 1e-4


def test_rmm_under_cupys_allocator_serves_the_arena():
    """RAPIDS RMM set as CuPy's allocator: CupyProvider's buffers come from RMM's resource."""
    try:  # missing, or installed but not importable (built for another CUDA); importorskip's exc_type needs pytest 8.2
        import rmm.allocators.cupy as cupy_allocators
    except ImportError as exc:
        pytest.skip(f"RAPIDS RMM cannot be imported: {exc}")
    import cupy
    import rmm

    x, w, _ = cuda_problem("float32")
    xc, wc = cupy.asarray(x), cupy.asarray(w)
    upstream = rmm.mr.get_current_device_resource()
    stats = rmm.mr.StatisticsResourceAdaptor(upstream)
    rmm.mr.set_current_device_resource(stats)
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(cupy_allocators.rmm_cupy_allocator)
    try:
        wsarena.configure(allocator="cupy")
        wsarena.arena.reset_arenas()
        arena = get_arena(xc.device.id)
        arena.reserve(8 << 20)
        assert type(arena.provider) is CupyProvider
        counts = stats.allocation_counts  # a Statistics object; a dict before RMM 24.10
        assert (counts["current_bytes"] if isinstance(counts, dict) else counts.current_bytes) >= 8 << 20
        y = conv_forward(xc, wc, **KW)
        assert rel(cupy.asnumpy(y), ref_conv_forward(x.double().cpu().numpy(), w.double().cpu().numpy(), **KW)) <= 1e-5
        wsarena.arena.reset_arenas()
    finally:
        cupy.cuda.set_allocator(previous)
        rmm.mr.set_current_device_resource(upstream)


def test_a_step_captured_by_torch_cuda_graph_replays_equal_to_the_eager_step():
    """Forward and backward of a converted model captured with ``torch.cuda.graph``, replayed on new inputs, give
    the eager step's loss and gradients (float32, within 1e-4 of the largest: some backward-filter algorithms sum
    in a nondeterministic order).

    Streams: inside ``torch.cuda.graph(graph, stream=side)`` PyTorch's current stream is ``side``, so wsarena's ops
    (PyTorch operands, ``stream=None``) run on it, and so do the backward passes, which autograd runs, on its own
    thread, on the stream of their forward. A capture uses the workspace the stream's sub-arena already holds, so
    the eager steps run on ``side`` first: on ``torch.cuda.graph``'s own default stream the sub-arena would hold
    nothing, and a capture cannot grow it (each call would run an algorithm that needs no workspace, the test
    below). The eager steps also choose every algorithm and make the cuDNN handles of both threads, which a capture
    cannot. Replays run on ``side``, whose workspace they share.
    """
    import wsarena.torch as wt

    torch.manual_seed(2)
    model = wt.convert(small_resnet()).cuda()
    target = torch.arange(4, device="cuda") % 5
    inputs = [torch.randn(4, 3, 32, 32, device="cuda") for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = [step(model, x, target) for x in inputs]  # also the warm-up
    arena = get_arena(inputs[0].device.index)
    allocations = arena.stats().allocations
    static_x = inputs[0].clone()
    model.zero_grad(set_to_none=True)  # the capture allocates the gradients from the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_loss = F.cross_entropy(model(static_x).float(), target)
        static_loss.backward()
    held = arena.stats()
    assert held.allocations == allocations and held.streams[side.cuda_stream].pinned_bytes > 0
    grads = {name: p.grad for name, p in model.named_parameters()}
    for i in (2, 0, 1, 2):
        with torch.cuda.stream(side):
            static_x.copy_(inputs[i])
            graph.replay()
        side.synchronize()
        loss, ref_grads = eager[i]
        assert rel(static_loss, loss) <= 1e-4
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        assert all(float((grads[k] - ref_grads[k]).abs().max()) <= 1e-4 * scale for k in ref_grads), i
    del graph


def _converted_and_its_eager_step(seed):
    """A converted small model on the GPU, a batch, its target, and the eager step's loss and gradients."""
    import wsarena.torch as wt

    torch.manual_seed(seed)
    model = wt.convert(small_resnet()).cuda()
    target = torch.arange(4, device="cuda") % 5
    x = torch.randn(4, 3, 32, 32, device="cuda")
    return model, x, target, step(model, x, target)


def _steps_as_eager(graphed, x, target, eager):
    """The graphed model's step gives the eager step's loss and gradients (float32, 1e-4 of the largest)."""
    eager_loss, eager_grads = eager
    loss, grads = step(graphed, x, target)
    torch.cuda.synchronize()
    scale = max(float(g.abs().max()) for g in eager_grads.values())
    return rel(loss, eager_loss) <= 1e-4 and all(
        float((grads[k] - eager_grads[k]).abs().max()) <= 1e-4 * scale for k in eager_grads
    )


def test_a_model_graphed_by_make_graphed_callables_replays_the_eager_step_and_names_its_fallback(monkeypatch):
    """``torch.cuda.make_graphed_callables`` warms up on a stream of its own and captures on ``torch.cuda.graph``'s
    default stream, whose sub-arena holds nothing and cannot grow during the capture: each convolution is captured
    with an algorithm that fits in it, with one ``CaptureFallbackWarning`` for that stream where the eager step's
    choices needed workspace. The graphed model still gives the eager step's loss and gradients.

    ``torch.cuda.Stream()`` hands out PyTorch's pooled streams in turn, 32 of a priority: a default capture stream
    made by an earlier test could be the one the warm-up gets, which would size it. One made just before the
    warm-up's is never that one."""
    import warnings

    model, x, target, eager = _converted_and_its_eager_step(3)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", torch.cuda.Stream())
    arena = get_arena(x.device.index)
    allocations = arena.stats().allocations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", wsarena.CaptureFallbackWarning)
        graphed = torch.cuda.make_graphed_callables(model, (torch.randn_like(x),))
    fallbacks = [w for w in caught if issubclass(w.category, wsarena.CaptureFallbackWarning)]
    stats = arena.stats()
    capture_stream = torch.cuda.graph.default_capture_stream.cuda_stream
    assert stats.streams.get(capture_stream) is None or stats.streams[capture_stream].capacity_bytes == 0
    assert len(fallbacks) == (1 if stats.high_water_bytes > 0 else 0), [str(w.message) for w in fallbacks]
    assert (stats.allocations > allocations) == (stats.high_water_bytes > 0)  # the warm-up's new stream grew
    assert _steps_as_eager(graphed, x, target, eager)


def test_prepare_capture_lets_make_graphed_callables_capture_the_eager_steps_choices():
    """After the eager step, ``wsarena.torch.prepare_capture()`` gives ``torch.cuda.graph``'s default capture stream
    the largest workspace the arena holds: ``make_graphed_callables`` then captures every convolution with no
    fallback (a CaptureFallbackWarning is an error here), and the graphed model gives the eager step's loss and
    gradients."""
    import warnings

    import wsarena.torch as wt

    model, x, target, eager = _converted_and_its_eager_step(4)
    arena = get_arena(x.device.index)
    held = wt.prepare_capture()
    capture_stream = torch.cuda.graph.default_capture_stream.cuda_stream
    assert held == arena.held_bytes(stream=capture_stream) >= arena.stats().high_water_bytes > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", wsarena.CaptureFallbackWarning)
        graphed = torch.cuda.make_graphed_callables(model, (torch.randn_like(x),))
    assert arena.stats().streams[capture_stream].pinned_bytes == held
    assert _steps_as_eager(graphed, x, target, eager)
