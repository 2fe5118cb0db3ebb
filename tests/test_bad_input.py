"""Misuse that used to escape as an internal error: the planner's and the arena's arguments, sizes beyond what
cuDNN takes (int32) or an array can hold, and NumPy integers where a size is expected."""

import json
import re

import numpy as np
import pytest

import wsarena
from wsarena._geometry import conv_geometry
from wsarena.arena import Arena, HostProvider
from wsarena.arena.testing import RecordingProvider
from wsarena.backends._cpu_backend import CpuBackend
from wsarena.errors import ArenaOutOfMemoryError, WorkspaceCapError
from wsarena.models import ModelError
from wsarena.tuning import tune

from .reference import ref_conv_backward_data, ref_conv_forward

pytestmark = pytest.mark.usefixtures("fresh_arena")  # from conftest: a host arena of the test's own

LAYERS = wsarena.load_model("resnet50")[:2]
INT32_MAX = 2**31 - 1  # the largest value a cuDNN descriptor holds
# what a layer list that is none is told load_model() reads (see the test that it reads them and no binary data)
LOADS = r"wsarena.load_model\(\) reads a zoo name, a path to a .onnx or .json file or a list of JSON layer dicts$"


@pytest.mark.parametrize(
    ("layers", "error", "match"),
    [
        ("resnet50", TypeError, r"layers must be a list of ConvLayer, not 'resnet50': load it with"),
        # binary data of any kind, as bytes was: a bytearray's ints were each refused ("layers[0] ... not int"); not
        # told to load it with load_model(), which refuses binary data too, but what load_model() reads
        (b"\x01", TypeError, r"layers must be a list of ConvLayer, not b'\\x01', binary data: " + LOADS),
        (bytearray(b"\x01"), TypeError,
         r"layers must be a list of ConvLayer, not bytearray\(b'\\x01'\), binary data: " + LOADS),
        (memoryview(b"\x01"), TypeError,
         r"layers must be a list of ConvLayer, not <memory at .*>, binary data: " + LOADS),
        (["resnet50"], TypeError, r"layers\[0\] must be a ConvLayer, not str 'resnet50': " + LOADS),
        # no iterable, said as binary data and a bad entry are, where it read "(from wsarena.load_model)"
        (None, TypeError, r"layers must be a list of ConvLayer, not None: " + LOADS),
        (5, TypeError, r"layers must be a list of ConvLayer, not 5: " + LOADS),
        ([], ValueError, "layers is empty"),
        ([*LAYERS, {"name": "a", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}], TypeError,
         r"layers\[2\] must be a ConvLayer, not dict"),
    ],
)
@pytest.mark.parametrize("entry", [wsarena.plan, tune])
def test_plan_and_tune_name_a_bad_layer_list(entry, layers, error, match):
    with pytest.raises(error, match=match):
        entry(layers, backend="cpu")


@pytest.mark.parametrize("data", [b"resnet50", bytearray(b"resnet50"), memoryview(b"resnet50")],
                         ids=["bytes", "bytearray", "memoryview"])
def test_load_model_reads_what_the_layer_list_errors_say_and_no_binary_data(tmp_path, data):
    # the errors of binary data as layers said "load it with wsarena.load_model()", which refuses it
    with pytest.raises(TypeError, match=r"source must be a zoo name, a path or a list of layers"):
        wsarena.load_model(data)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(wsarena.models.layers_to_json(LAYERS)))
    dicts = json.loads(path.read_text())["layers"]
    assert wsarena.load_model("resnet50")[:2] == wsarena.load_model(str(path)) == wsarena.load_model(dicts) == LAYERS


def test_plan_takes_any_iterable_of_layers_once():
    assert wsarena.plan(iter(LAYERS), backend="cpu").arena_bytes == wsarena.plan(LAYERS, backend="cpu").arena_bytes
    assert len(tune(iter(LAYERS), backend="cpu").uncapped.layers) == 2


@pytest.mark.parametrize("plan", [None, {"stream_bytes": [4096]}, 5, "plan"])
def test_reserve_for_names_a_bad_plan_and_changes_nothing(fresh_arena, plan):
    with pytest.raises(TypeError, match=r"plan must be a wsarena.plan\(\) result"):
        fresh_arena.reserve_for(plan)
    assert fresh_arena.stats().capacity_bytes == 0 and fresh_arena.stats().allocations == 0


def test_reserve_for_names_a_bad_size_in_the_plan(fresh_arena):
    class Plan:
        stream_bytes = (4096, 2.5)

    with pytest.raises(TypeError, match=r"plan.stream_bytes must be an int, not 2.5"):
        fresh_arena.reserve_for(Plan(), streams=["a", "b"])
    assert fresh_arena.stats().capacity_bytes == 0


@pytest.mark.parametrize("streams", [5, "ab", b"ab", bytearray(b"ab"), {"a", "b"}, {"a": 1, "b": 2}],
                         ids=["int", "str", "bytes", "bytearray", "set", "dict"])
def test_reserve_for_names_streams_that_are_not_a_list_of_them(fresh_arena, streams):
    # 5 raised "'int' object is not iterable"; "ab" was taken as the two CPU lanes "a" and "b"
    class Plan:
        stream_bytes = (4096, 4096)

    with pytest.raises(TypeError, match=r"streams must be a sequence of streams"):
        fresh_arena.reserve_for(Plan(), streams=streams)
    assert fresh_arena.stats().capacity_bytes == 0


@pytest.mark.parametrize("streams", [{"a", "b"}, frozenset({"a", "b"})], ids=["set", "frozenset"])
def test_reserve_for_says_why_a_set_of_streams_is_refused(fresh_arena, streams):
    # plan()'s streams and passes say that a set has no order: reserve_for's said only what it takes
    class Plan:
        stream_bytes = (4096, 4096)

    with pytest.raises(TypeError, match=(r"^streams must be a sequence of streams, one per planned stream, not "
                                         r"(frozenset\()?\{'[ab]', '[ab]'\}\)?: a set has no order, and each planned "
                                         r"stream's size goes to the stream at its place in streams$")):
        fresh_arena.reserve_for(Plan(), streams=streams)
    assert fresh_arena.stats().capacity_bytes == 0


@pytest.mark.parametrize(("stream", "error"), [([], TypeError), ({}, TypeError), (float("nan"), ValueError)])
def test_a_capture_question_about_what_is_no_stream_is_refused_by_an_arena_that_cannot_capture(fresh_arena, stream,
                                                                                               error):
    # The host arena answered capturing(stream=[]) with False, and keep_with_capture kept nothing and said so, where
    # its held_bytes, lease and reserve refuse that stream, as a device arena refuses it for all of them
    for ask in (lambda: fresh_arena.capturing(stream=stream), lambda: fresh_arena.keep_with_capture([], stream=stream),
                lambda: fresh_arena.held_bytes(stream=stream)):
        with pytest.raises(error, match=r"is not a lane key"):
            ask()
    assert fresh_arena.capturing(stream="lane") is False and fresh_arena.keep_with_capture([X], stream="lane") is False
    assert fresh_arena.stats().capacity_bytes == 0 and fresh_arena.stats().kept_bytes == 0


def test_reserve_for_takes_the_streams_from_any_ordered_iterable(fresh_arena):
    class Plan:
        stream_bytes = (4096, 8192)

    fresh_arena.reserve_for(Plan(), streams=(s for s in ["a", "b"]))  # a generator, as a list
    assert fresh_arena.held_bytes(stream="b") == 8192 and fresh_arena.held_bytes(stream="a") == 4096


def test_reserve_for_reads_no_further_than_one_stream_past_the_plan(fresh_arena):
    # an endless iterator (itertools.cycle of the streams) was read into a list until memory ran out
    class Plan:
        stream_bytes = (4096, 8192)

    pulled = []

    def endless():
        while len(pulled) < 100:
            pulled.append(len(pulled))
            yield f"lane{len(pulled)}"
        raise AssertionError("reserve_for read the streams past the plan's length")

    with pytest.raises(ValueError, match=r"the plan has 2 stream\(s\) but more were given"):
        fresh_arena.reserve_for(Plan(), streams=endless())
    assert len(pulled) == 3 and fresh_arena.stats().capacity_bytes == 0
    with pytest.raises(ValueError, match=r"the plan has 2 stream\(s\) but 3 were given"):
        fresh_arena.reserve_for(Plan(), streams=["a", "b", "c"])  # a list's length is told


BINARY = [bytes, bytearray, lambda b: memoryview(bytes(b))]


@pytest.mark.parametrize("binary", BINARY, ids=["bytes", "bytearray", "memoryview"])
def test_binary_data_is_no_shape_nor_list_of_values(fresh_arena, binary):
    """Binary data is a sequence of small ints: b"\\x02\\x04\\x06\\x06" was taken as the shape (2, 4, 6, 6), a
    memoryview as a stride, a bytearray as a layer's shape or the planner's stream indices, where text is refused and
    a layer's bytes too. Each is refused, naming the argument, and nothing is leased."""
    dy, w, x = np.ones((2, 6, 4, 4)), np.ones((6, 2, 3, 3)), np.ones((2, 4, 6, 6))
    with pytest.raises(TypeError, match=r"^input_shape must be a sequence of ints, not "):
        wsarena.conv_backward_data(dy, w, binary(x.shape), groups=2)
    with pytest.raises(TypeError, match=r"^weight_shape must be a sequence of ints, not "):
        wsarena.conv_backward_filter(x, dy, binary(w.shape), groups=2)
    for name in ("stride", "padding", "dilation"):
        with pytest.raises(TypeError, match=rf"^{name} must be an int"):
            wsarena.conv_forward(x, w, groups=2, **{name: binary((1, 1))})
    assert fresh_arena.stats().allocations == 0 and fresh_arena.stats().leases == 0
    layer = {"name": "c", "input_shape": (1, 3, 8, 8), "weight_shape": (4, 3, 3, 3)}
    for key, value in [*layer.items(), ("stride", (1, 1))][1:]:
        with pytest.raises(ModelError, match=rf"^layer 'c': {key} must be "):
            wsarena.ConvLayer(**{**layer, key: binary(value)})
    with pytest.raises(TypeError, match=r"^streams must be an int or a sequence of stream indices, not "):
        wsarena.plan(LAYERS, backend="cpu", streams=binary((0, 1)))
    with pytest.raises(TypeError, match=r"^passes must be a sequence of pass names such as \('fwd',\), not "):
        wsarena.plan(LAYERS, backend="cpu", passes=binary(b"fwd"))  # bytearray's were the names (102, 119, 100)
    with pytest.raises(TypeError, match=r"^source must be a zoo name, a path or a list of layers, not "):
        wsarena.load_model(binary(b"resnet50"))  # a memoryview's entries were each refused as no layer

    class Plan:
        stream_bytes = binary((16,))

    with pytest.raises(TypeError, match=r"^plan must be a wsarena.plan\(\) result"):
        fresh_arena.reserve_for(Plan())
    assert fresh_arena.stats().capacity_bytes == 0
    # the shapes and values themselves, as lists, are taken
    np.testing.assert_allclose(wsarena.conv_backward_data(dy, w, list(x.shape), groups=2),
                               ref_conv_backward_data(dy, w, x.shape, groups=2))


@pytest.mark.parametrize("name", ["stride", "padding", "dilation"])
@pytest.mark.parametrize("bad", [np.array([2, 2]), 2.0, None], ids=["array", "float", "none"])
def test_a_parameter_that_is_neither_an_int_nor_a_sequence_is_told_both_are_taken(fresh_arena, name, bad):
    """stride=np.array([2, 2]) was told "stride must be an int", as if the list [2, 2] were refused too: the message
    names what is taken, an int or one int per spatial dimension (and padding's two modes), and what was given."""
    x, w = np.arange(2 * 4 * 7 * 7.0).reshape(2, 4, 7, 7) % 5, np.ones((6, 2, 3, 3))
    modes = ", 'valid' or 'same'" if name == "padding" else ""
    taken = f"an int{',' if modes else ' or'} a sequence of 2 ints (one per spatial dimension){modes}"
    with pytest.raises(TypeError) as info:
        wsarena.conv_forward(x, w, groups=2, **{name: bad})
    assert str(info.value) == f"{name} must be {taken}, not {bad!r}"
    assert fresh_arena.stats().allocations == 0
    np.testing.assert_allclose(wsarena.conv_forward(x, w, groups=2, **{name: [2, 2]}),
                               ref_conv_forward(x, w, groups=2, **{name: 2}))


@pytest.mark.parametrize("array", [np.array(["NCHW", "cpu"]), np.array(["NCHW"]), np.array(["cpu"])],
                         ids=["two", "NCHW", "cpu"])
def test_an_array_is_no_choice_of_a_setting_or_an_argument(fresh_arena, array):
    """A choice compared an array with its names: one of two or more elements raised NumPy's "The truth value of an
    array with more than one element is ambiguous", naming nothing, and one of a single name was taken as that name
    (configure(backend=np.array(["cpu"])) set "cpu"). Each is refused, naming the setting or the argument, and
    changes nothing."""
    before = wsarena.get_config()
    for key in ("backend", "algo_search", "cudnn_api", "cudnn_heuristic", "allocator"):
        with pytest.raises(ValueError, match=rf"^{key} must be one of \(.*\), not array\(\["):
            wsarena.configure(**{key: array})
        with pytest.raises(ValueError, match=rf"^{key} must be one of "), wsarena.config(**{key: array}):
            pass
    assert wsarena.get_config() == before
    x, w = np.ones((1, 2, 5, 5)), np.ones((3, 2, 3, 3))
    with pytest.raises(ValueError, match=r"^layout must be one of \('NCHW', 'NHWC'\), not array\(\["):
        wsarena.conv_forward(x, w, layout=array)
    assert fresh_arena.stats().allocations == 0
    for kwargs, says in [({"backend": array}, "backend must be one of"), ({"search": array}, "search must be one of"),
                         ({"layout": array}, "layout must be 'NCHW' or 'NHWC'"),
                         ({"device_properties": "{}", "backend": array}, "device_properties plans for a cuDNN GPU")]:
        with pytest.raises(ValueError, match=rf"^{re.escape(says)}.*, not array\(\["):
            wsarena.plan(LAYERS, **{"backend": "cpu", **kwargs})
    with pytest.raises(ValueError, match=r"^asymmetric_pads must be 'widen' or 'error', not array\(\["):
        wsarena.load_model("resnet50", asymmetric_pads=array)
    with pytest.raises(ModelError, match=r'^JSON: layout must be "NCHW" or "NHWC", not array\(\['):
        wsarena.models.layers_from_json({"layers": [], "layout": array})
    np.testing.assert_allclose(wsarena.conv_forward(x, w, layout="NCHW"), ref_conv_forward(x, w))


def test_an_arena_of_a_provider_class_is_refused():
    # Arena(HostProvider) was taken; its first lease raised "allocate() missing 1 required positional argument"
    with pytest.raises(TypeError, match=r"provider .*HostProvider.* is a class: pass an instance"):
        wsarena.Arena(HostProvider)


X = np.ones((1, 1, 8, 8), np.float32)
W = np.ones((1, 1, 3, 3), np.float32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stride": 2**62}, r"stride=4611686018427387904 is above 2\*\*31 - 1"),
        ({"stride": (1, 2**31)}, r"stride=\(1, 2147483648\): 2147483648 is above 2\*\*31 - 1"),
        ({"padding": 2**40}, r"padding=1099511627776 is above 2\*\*31 - 1"),
        ({"padding": ((2**31, 2**31), (0, 0))}, r"padding=.*2147483648 is above 2\*\*31 - 1"),
        ({"dilation": 2**31}, r"dilation=2147483648 is above"),
        # within int32 but the output would not be: (8 + 2 * 2**30 - 3) + 1 > 2**31 - 1
        ({"padding": 2**30}, r"padding=\(1073741824, 1073741824\) makes the output 2147483654 long in dimension 0"),
    ],
)
def test_conv_arguments_beyond_int32_are_named_before_any_lease(fresh_arena, kwargs, match):
    for call in (
        lambda: wsarena.conv_forward(X, W, **kwargs),
        lambda: wsarena.conv_backward_data(np.ones((1, 1, 6, 6), np.float32), W, X.shape, **kwargs),
        lambda: wsarena.conv_backward_filter(X, np.ones((1, 1, 6, 6), np.float32), W.shape, **kwargs),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    stats = fresh_arena.stats()
    assert (stats.capacity_bytes, stats.allocations, stats.leases) == (0, 0, 0)


def test_the_largest_int32_values_are_accepted():
    g = conv_geometry((1, 1, 8, 8), (1, 1, 3, 3), stride=INT32_MAX, padding=INT32_MAX // 2 - 1)
    assert g.stride == (INT32_MAX, INT32_MAX) and g.output_size == (2, 2)
    y = wsarena.conv_forward(X, W, stride=INT32_MAX)
    assert y.shape == (1, 1, 1, 1) and y[0, 0, 0, 0] == 9.0
    # every window of the huge padding reads only zeros
    y = wsarena.conv_forward(X, W, stride=INT32_MAX, padding=INT32_MAX // 2 - 1)
    assert y.shape == (1, 1, 2, 2) and not y.any()


@pytest.mark.parametrize(
    ("shapes", "kwargs", "match"),
    [
        (((2**31, 1, 8, 8), (1, 1, 3, 3)), {}, r"input_shape=\(2147483648, 1, 8, 8\): 2147483648 is above"),
        (((1, 1, 8, 8), (1, 1, 3, 2**31)), {}, r"weight_shape=.*2147483648 is above"),
        (((2**31 - 2, 2**31 - 2, 8, 8), (2**31 - 2, 1, 3, 3)), {"groups": 2**31}, r"groups=2147483648 is above"),
        # each dimension fits in int32, the array does not fit in memory's address space
        (((INT32_MAX, INT32_MAX, INT32_MAX, 1), (1, INT32_MAX, 1, 1)), {},
         r"input_shape \(.*\) of float32 is \d+ bytes, more than an array can hold"),
        (((1, 1, 2**20, 2**20), (INT32_MAX, 1, 1, 1)), {}, r"the output shape \(1, 2147483647, 1048576, 1048576\)"),
    ],
)
def test_geometry_beyond_what_an_array_or_cudnn_holds_is_a_value_error(shapes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        conv_geometry(*shapes, **kwargs)


def test_with_batch_checks_the_same_limits():
    g = conv_geometry((1, 64, 2**14, 2**14), (1, 64, 1, 1))
    with pytest.raises(ValueError, match=r"batch=2147483648 is above"):
        g.with_batch(2**31)
    with pytest.raises(ValueError, match=r"input_shape \(2147483647, 64, 16384, 16384\) of float32 is"):
        g.with_batch(INT32_MAX)


def test_an_output_that_cannot_be_allocated_is_a_memory_error_naming_it(fresh_arena, monkeypatch):
    def no_room(self, shape, dtype):
        raise MemoryError(f"Unable to allocate an array with shape {shape}")

    monkeypatch.setattr(CpuBackend, "empty", no_room)
    with pytest.raises(MemoryError, match=r"no memory for the output: \(1, 1, 2000006, 2000006\) of float32 is "
                                          r"14.55 TiB \(check padding"):
        wsarena.conv_forward(X, W, padding=10**6)
    assert fresh_arena.stats().capacity_bytes == 0


def test_a_json_layer_with_a_huge_dimension_is_a_model_error(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps([{"name": "big", "input_shape": [1, 3, 10**30, 8], "weight_shape": [4, 3, 3, 3]}]))
    with pytest.raises(ModelError, match=r"layer 'big': input_shape=.* is above 2\*\*31 - 1"):
        wsarena.load_model(path)


@pytest.mark.parametrize("cap", [np.int64(5), np.uint32(5), np.int8(5)])
def test_numpy_integers_are_sizes(cap):
    assert wsarena.parse_size(cap) == 5 and type(wsarena.parse_size(cap)) is int
    assert wsarena.configure(cap_workspace=cap).cap_workspace == 5
    with wsarena.config(cap_workspace=cap) as cfg:
        assert cfg.cap_workspace == 5 and type(cfg.cap_workspace) is int
    assert wsarena.plan(LAYERS, backend="cpu", cap_workspace=cap).cap_workspace == 5
    arena = wsarena.get_arena("cpu")
    with arena.lease(5, cap=cap) as ws:
        assert ws.nbytes == 5
    with pytest.raises(wsarena.WorkspaceCapError):
        arena.lease(6, cap=cap)


@pytest.mark.parametrize("cap", [np.True_, True, 1.0, np.float64(5), np.array([5])])
def test_other_numbers_are_not_sizes(cap):
    with pytest.raises(TypeError, match="a size must be an int or a string"):
        wsarena.parse_size(cap)
    with pytest.raises(TypeError, match="a size must be an int"):
        wsarena.configure(cap_workspace=cap)
    assert wsarena.get_config().cap_workspace is None


# Found by the fuzz tests (tests/test_fuzz_*.py)


def test_a_dtype_the_backend_does_not_compute_in_names_the_operand():
    x, w = np.ones((1, 1, 4, 4), np.float16), np.ones((1, 1, 3, 3), np.float16)
    with pytest.raises(TypeError, match=r"^x has dtype float16: the cpu backend computes in float32 or float64"):
        wsarena.conv_forward(x, w)
    with pytest.raises(TypeError, match=r"^dy has dtype float16"):
        wsarena.conv_backward_data(np.ones((1, 1, 2, 2), np.float16), w, x.shape)


@pytest.mark.parametrize("cap", [".1", "-1", "lots", 1.5, -1])
def test_a_bad_cap_names_the_setting(cap):
    error = TypeError if cap == 1.5 else ValueError
    with pytest.raises(error, match=rf"^cap_workspace={re.escape(repr(cap))}: "):
        wsarena.configure(cap_workspace=cap)
    with pytest.raises(error, match=r"^cap_workspace="):
        wsarena.plan(LAYERS, backend="cpu", cap_workspace=cap)


def test_a_json_integer_of_too_many_digits_is_a_model_error(tmp_path):
    path = tmp_path / "digits.json"
    path.write_text('{"layers": [' + "9" * 5000 + "]}")
    with pytest.raises(ModelError, match=r"is not a JSON layer list: Exceeds the limit \(4300 digits\)"):
        wsarena.load_model(path)


def damaged_conv(tmp_path, attribute):
    """A one-conv ONNX model whose conv carries ``attribute`` (an AttributeProto), as a damaged file can."""
    import onnx

    from .onnx_graphs import conv, vi, weight

    node = conv("c", "x", "w", "y")
    node.attribute.append(attribute)
    graph = onnx.helper.make_graph([node], "g", [vi("x", [1, 3, 8, 8])], [vi("y", None)],
                                   initializer=[weight("w", (4, 3, 3, 3))])
    path = tmp_path / "damaged.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    return path


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda h: h.make_attribute("strides", h.make_graph([], "sub", [], [])), r"strides=.* must be a list of ints"),
        (lambda h: h.make_attribute("strides", [0, 0]), r"strides=\[0, 0\] must be a list of ints >= 1"),
        (lambda h: h.make_attribute("pads", [1.5, 1.0, 1.0, 1.0]), r"pads=\[1.5, 1.0, 1.0, 1.0\] must be a list"),
        (lambda h: h.make_attribute("group", 2.0), r"group=2.0 must be an int >= 1"),
        (lambda h: h.make_attribute("group", 0), r"group=0 must be an int >= 1"),
        (lambda h: h.make_attribute("auto_pad", [1, 2]), r"auto_pad=\[1, 2\] must be a string"),
    ],
)
def test_a_damaged_onnx_attribute_is_a_model_error_naming_the_node(tmp_path, make, match):
    import onnx

    path = damaged_conv(tmp_path, make(onnx.helper))
    with pytest.raises(ModelError, match=rf"damaged.onnx': ONNX node 'c': {match}"):
        wsarena.load_model(path)


def test_strides_of_zero_with_same_padding_are_a_model_error(tmp_path):
    import onnx

    path = damaged_conv(tmp_path, onnx.helper.make_attribute("strides", [0, 0]))
    model = onnx.load(str(path))
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("auto_pad", "SAME_UPPER"))
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=r"strides=\[0, 0\] must be a list of ints >= 1"):
        wsarena.load_model(path)


def test_an_auto_pad_that_is_not_utf8_is_a_model_error(tmp_path):
    import onnx

    path = damaged_conv(tmp_path, onnx.helper.make_attribute("auto_pad", b"SAME\xff"))
    with pytest.raises(ModelError, match="unknown auto_pad 'SAME\ufffd'"):
        wsarena.load_model(path)


class Shown:
    """An object whose repr() is ``text``."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


@pytest.mark.parametrize(("value", "shown"), [
    (tuple(range(100)), "(0, 1, 2, 3, 4, 5, ... 94 more)"),
    (list(range(100)), "[0, 1, 2, 3, 4, 5, ... 94 more]"),  # a list as a tuple
    (tuple(range(7)), "(0, 1, 2, 3, 4, 5, ... 1 more)"),
    (tuple(range(6)), "(0, 1, 2, 3, 4, 5)"),
    ((1,), "(1,)"),
    ((1, 10**5000), "(1, an integer of 16610 bits)"),  # repr() refuses past 4300 digits
    ((1, -(10**5000)), "(1, a negative integer of 16610 bits)"),  # its sign told: "must be >= 1, not ..."
    pytest.param(-(10**5000), "a negative integer of 16610 bits", id="negative-int"),  # an id: str() refuses it
    ({i: -i for i in range(10)}, "{0: 0, 1: -1, 2: -2, 3: -3, ... 6 more}"),
    ({"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}, "{'a': {'b': {'c': {'d': {'e': {'f': {...}}}}}}}"),  # too deep
    (set(range(10)), "{0, 1, 2, 3, 4, 5, ... 4 more}"),
    (frozenset(range(10)), "frozenset({0, 1, 2, 3, 4, 5, ... 4 more})"),
    ([list(range(10))], "[[0, 1, 2, 3, 4, 5, ... 4 more]]"),
    # another object's repr whole up to 120 characters (a stream object's class and address), then its middle cut
    (Shown("<tests.test_arena_streams.PtrStream object at 0x7ff7bd0c4a10>"),
     "<tests.test_arena_streams.PtrStream object at 0x7ff7bd0c4a10>"),
    (Shown("<" + "a" * 118 + ">"), "<" + "a" * 118 + ">"),
    (Shown("<" + "a" * 100_000 + ">"), "<" + "a" * 57 + "..." + "a" * 58 + ">"),
])
def test_an_error_quotes_a_long_container_with_how_many_items_it_leaves_out(value, shown):
    """reprlib ended a long tuple in "...", which reads as Python's Ellipsis there, and told nothing of its length."""
    from wsarena._sizes import short_repr

    assert short_repr(value) == shown


LONG = "ab" + "x" * 100_000 + "yz"  # shown as short_repr cuts it: 'abxxx...xxxyz'
HUGE = 10**5000  # repr() refuses it past 4300 digits: short_repr writes "an integer of 16610 bits"


class _Plan:
    """What arena.reserve_for() reads of a plan."""

    stream_bytes = (0,)
    backend = "cpu"


def _misuses():
    """``(id, call, error)``: each a call that echoes a value it was given, a long one or one repr() refuses."""
    from wsarena import _pass, cudagraph
    from wsarena.arena import set_arena
    from wsarena.backends import cpu, get_backend, resolve_backend_name
    from wsarena.cudnn import descriptors, graph
    from wsarena.models._onnx import check_asymmetric_pads

    x, w = np.ones((1, 2, 6, 6), np.float32), np.ones((3, 2, 3, 3), np.float32)
    geom = conv_geometry(x.shape, w.shape)
    y = np.empty((1, 3, 4, 4), np.float32)
    arena = wsarena.get_arena("cpu")
    return [
        ("reserve_for plan", lambda: arena.reserve_for(LONG), TypeError),
        ("reserve_for plan huge", lambda: arena.reserve_for(HUGE), TypeError),
        ("reserve_for streams", lambda: arena.reserve_for(_Plan(), streams=HUGE), TypeError),
        ("cpu workspace", lambda: cpu.run("fwd", "gemm_per_image", geom, x, w, y, LONG), ValueError),
        ("cpu algorithm", lambda: cpu.run("fwd", LONG, geom, x, w, y, None), ValueError),
        ("plan layers", lambda: wsarena.plan(LONG), TypeError),
        ("plan layers huge", lambda: wsarena.plan(HUGE), TypeError),
        ("plan layer", lambda: wsarena.plan([LONG]), TypeError),
        ("plan device_properties", lambda: wsarena.plan(LAYERS, device_properties=HUGE), TypeError),
        ("plan passes", lambda: wsarena.plan(LAYERS, passes=HUGE, backend="cpu"), TypeError),
        ("plan progress", lambda: wsarena.plan(LAYERS, progress=LONG, backend="cpu"), TypeError),
        ("layout", lambda: wsarena.conv_forward(x, w, layout=LONG), ValueError),
        ("backend", lambda: resolve_backend_name(LONG), ValueError),
        ("cudnn api", lambda: get_backend("cudnn", api=LONG), ValueError),
        ("capture mode", lambda: cudagraph.capture(mode=LONG).__enter__(), ValueError),
        ("pass", lambda: _pass.Pass(LONG), ValueError),
        ("asymmetric_pads", lambda: check_asymmetric_pads(LONG), ValueError),
        ("algo", lambda: wsarena.conv_forward(x, w, algo=LONG), ValueError),
        ("input_shape", lambda: wsarena.conv_backward_data(y, w, input_shape=LONG), TypeError),
        ("set_arena", lambda: set_arena("cpu", LONG), TypeError),
        ("engine name", lambda: graph.parse_name(LONG), ValueError),
        ("cudnn data type", lambda: descriptors.data_type(LONG), ValueError),
        ("cudnn ints", lambda: descriptors._ints("dims", LONG), TypeError),
        ("lane key", lambda: arena.lease(1, stream=[LONG]).__enter__(), TypeError),
        ("arena provider", lambda: Arena([LONG]), TypeError),
        ("nested lease on a lane", lambda: _nested_lease(LONG), RuntimeError),
        ("cap on a lane", lambda: _above_cap(LONG), WorkspaceCapError),
        ("growth on a lane", lambda: Arena(RecordingProvider(fail=lambda n: True)).reserve(64, stream=LONG),
         ArenaOutOfMemoryError),
    ]


def _nested_lease(lane):
    arena = Arena(HostProvider())
    with arena.lease(64, stream=lane), arena.lease(64, stream=lane):
        pass


def _above_cap(lane):
    with wsarena.config(cap_workspace=0):
        Arena(HostProvider()).reserve(64, stream=lane)


@pytest.mark.parametrize("index", range(len(_misuses())), ids=[m[0] for m in _misuses()])
def test_an_error_quotes_a_value_it_was_given_as_short_repr_cuts_it(index):
    """Some quoted a value whole (a 100 kB string, a 100 kB line), some cut its repr() at 60 or 80 characters, which
    drops its end (and its closing quote), and asks repr() for a number it refuses past 4300 digits: the ValueError
    "Exceeds the limit" in place of the TypeError meant."""
    _, call, error = _misuses()[index]
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert len(message) < 600, message[:300]
    assert "xxxyz'" in message or "integer of 16610 bits" in message, message
