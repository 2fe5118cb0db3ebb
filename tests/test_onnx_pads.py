"""ONNX convolutions after a Pad whose pads are computed: from constants alone (PyTorch's reflect and replicate
padding), which the loader evaluates, or at run time, which the error names."""

import re
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import wsarena
from wsarena.models import ModelError

from .onnx_graphs import conv, ints, save, vi, weight

pytestmark = pytest.mark.usefixtures("fresh_arena")  # from conftest: a host arena of the test's own


def key(layer):
    return layer.input_shape, layer.weight_shape, layer.stride, layer.padding, layer.dilation, layer.groups


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # TorchScript's ONNX exporter is deprecated
@pytest.mark.filterwarnings("ignore:Constant folding:UserWarning")  # the exporter's: a reversing Slice stays
@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize(("nd", "opset"), [(1, 17), (2, 11), (2, 17), (2, 18), (3, 17)])
def test_pytorch_padding_modes_give_the_layers_pytorch_runs(tmp_path, mode, nd, opset):
    """The exporter computes such pads with ConstantOfShape, Concat, Reshape, a reversing Slice, Transpose and Cast
    from constants, which ONNX shape inference does not evaluate: every conv from the padded one on was unknown.
    The reference is wsarena.torch.layers, which runs the model in PyTorch."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    wt = pytest.importorskip("wsarena.torch")

    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
    model = nn.Sequential(cls(3, 8, 3, padding=(2, 1, 1)[:nd], padding_mode=mode, stride=2),
                          cls(8, 8, 3, padding="same", padding_mode=mode, dilation=2, groups=2),
                          cls(8, 4, 3, padding=1))
    x = torch.zeros(1, 3, *(13, 10, 6)[:nd])
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=opset)
    assert "Transpose" in {n.op_type for n in onnx.load(str(path)).graph.node}  # the pads are computed
    assert [key(layer) for layer in wsarena.load_model(path)] == [key(layer) for layer in wt.layers(model, x)]


def reversed_pads_model(tmp_path, opset=17):
    """The exporter's computation of reflect padding's pads, written out: F.pad's pairs (begin, end) from the last
    dim, [1, 2] for W and [3, 0] for H, then zeros for N and C (ConstantOfShape), Concat, Reshape to pairs, a reversing
    Slice, Transpose, Reshape, Cast. The Pad's output is a graph output too, for the reference evaluator's run."""
    four = {"value_ints": [4]} if opset >= 12 else {"value": ints("", [4])}  # value_ints: since opset 12
    nodes = [
        helper.make_node("Constant", [], ["zeros_n"], **four),
        helper.make_node("ConstantOfShape", ["zeros_n"], ["zeros"], value=ints("", [0])),
        helper.make_node("Concat", ["spatial", "zeros"], ["flat"], axis=0),
        helper.make_node("Reshape", ["flat", "pairs"], ["paired"]),
        helper.make_node("Slice", ["paired", "start", "end", "axis", "step"], ["reversed"]),
        helper.make_node("Transpose", ["reversed"], ["by_side"], perm=[1, 0]),
        helper.make_node("Reshape", ["by_side", "flat_shape"], ["pads64"]),
        helper.make_node("Cast", ["pads64"], ["pads"], to=TensorProto.INT64),
        helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad", mode="reflect"),
        conv("c", "padded", "w", "y", strides=[2, 2]),
    ]
    inits = [ints("spatial", [1, 2, 3, 0]), ints("pairs", [-1, 2]), ints("start", [-1]), ints("end", [-(2**62)]),
             ints("axis", [0]), ints("step", [-1]), ints("flat_shape", [-1]), weight("w", (4, 3, 3, 3))]
    return save(tmp_path / "pads.onnx", nodes, [vi("x", [1, 3, 10, 12])], inits,
                outputs=[vi("y", None), vi("padded", None)], opset=opset)


@pytest.mark.parametrize("opset", [11, 17, 21])
def test_pads_computed_from_constants_are_evaluated(tmp_path, opset):
    path = reversed_pads_model(tmp_path, opset)
    (layer,) = wsarena.load_model(path)
    x = np.zeros((1, 3, 10, 12), np.float32)
    _, padded = ReferenceEvaluator(str(path)).run(None, {"x": x})  # onnx's own run of the graph
    assert layer.input_shape == padded.shape == (1, 3, 10 + 3 + 0, 12 + 1 + 2)
    assert layer.weight_shape == (4, 3, 3, 3) and layer.stride == (2, 2) and layer.padding == (0, 0)


def test_pads_known_only_at_run_time_are_named(tmp_path):
    # The pads are a graph input: no input shape can fix them, so the error does not suggest one.
    nodes = [helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad", mode="reflect"),
             conv("c", "padded", "w", "y")]
    inputs = [vi("x", [1, 3, 10, 12]), helper.make_tensor_value_info("pads", TensorProto.INT64, [8])]
    path = save(tmp_path / "m.onnx", nodes, inputs, [weight("w", (4, 3, 3, 3))])
    why = "input shape [1, 3, ?, ?] unknown: shape inference cannot work out the output of Pad 'pad'"
    with pytest.raises(ModelError, match=re.escape(f"1 conv node(s) cannot be planned: 'c' ({why}) (skip them with "
                                                   "skip_unknown=True / --skip-unknown)") + "$"):
        wsarena.load_model(path)


def test_where_a_shape_was_lost_is_found_once_for_a_chain_of_convs(tmp_path, monkeypatch):
    # Each unknown conv went back over every node before it to the Pad: a chain of n convs took n * n / 2 steps
    # (4,000 convs: 13 s). Each tensor is now passed once, and every conv still names the Pad.
    n = 200
    nodes = [conv("first", "x", "w", "x1"), helper.make_node("Pad", ["x1", "pads"], ["y0"], name="pad", mode="reflect")]
    nodes += [conv(f"c{i}", f"y{i}", "w", f"y{i + 1}", pads=[1, 1, 1, 1]) for i in range(n)]
    inputs = [vi("x", [1, 3, 10, 12]), helper.make_tensor_value_info("pads", TensorProto.INT64, [8])]
    path = save(tmp_path / "m.onnx", nodes, inputs, [weight("w", (3, 3, 3, 3))])
    asked = []
    lost = wsarena.models._onnx._lost
    monkeypatch.setattr(wsarena.models._onnx, "_lost", lambda dims: asked.append(dims) or lost(dims))
    with pytest.warns(UserWarning, match=f"skipped {n} conv node"):
        layers = wsarena.load_model(path, skip_unknown=True)
    assert [layer.name for layer in layers] == ["first"]
    why = "input shape [1, 3, ?, ?] unknown: shape inference cannot work out the output of Pad 'pad'"
    assert layers.skipped == tuple((f"c{i}", why) for i in range(n))
    assert len(asked) <= 3 * len(nodes)  # each node's two inputs, and the graph inputs


def test_the_node_that_lost_a_shape_is_named_in_one_line_whatever_its_op_type(tmp_path):
    # A damaged file's op type may hold any character: the error, one line as every ModelError, shows it as a repr
    nodes = [helper.make_node("My\nOp", ["x"], ["t"], name="odd"), conv("c", "t", "w", "y")]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [1, 3, 10, 12])], [weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError) as caught:
        wsarena.load_model(path)
    assert "\n" not in str(caught.value)
    assert "cannot work out the output of 'My\\nOp' 'odd'" in str(caught.value)


@pytest.fixture
def evaluated(monkeypatch):
    """The inputs of each node onnx's reference evaluator runs during the test."""
    runs = []
    run = ReferenceEvaluator.run
    monkeypatch.setattr(ReferenceEvaluator, "run", lambda self, *a, **k: runs.append(a) or run(self, *a, **k))
    return runs


def test_only_small_results_are_evaluated(tmp_path, evaluated):
    # A ConstantOfShape of a million elements (the pads its Slice would take) is never made, nor anything from it.
    nodes = [helper.make_node("ConstantOfShape", ["huge"], ["all"], value=ints("", [1])),
             helper.make_node("Slice", ["all", "start", "end"], ["ones"]),
             helper.make_node("Mul", ["ones", "mask"], ["pads"]),
             helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad"), conv("c", "padded", "w", "y")]
    inits = [ints("huge", [10**6]), ints("start", [0]), ints("end", [8]), ints("mask", [0, 0, 1, 1] * 2),
             weight("w", (4, 3, 3, 3))]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [1, 3, 10, 12])], inits)
    with pytest.raises(ModelError, match="the output of Pad 'pad'"):
        wsarena.load_model(path)
    assert evaluated == []
    # with 8 elements it is evaluated, and the Pad's output is known
    small = save(tmp_path / "small.onnx", nodes, [vi("x", [1, 3, 10, 12])], [ints("huge", [8]), *inits[1:]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (layer,) = wsarena.load_model(small)
    assert layer.input_shape == (1, 3, 12, 14) and len(evaluated) == 3


def test_small_constants_that_broadcast_to_a_large_result_are_not_evaluated(tmp_path, evaluated):
    # Four operands of 64 elements each broadcast to 64**4 (16.8 million): never made; the Max of operands that
    # broadcast to 8 elements is.
    shapes = [(64, 1, 1, 1), (1, 64, 1, 1), (1, 1, 64, 1), (1, 1, 1, 64)]
    inits = [helper.make_tensor(f"m{i}", TensorProto.INT64, s, [0] * 64) for i, s in enumerate(shapes)]
    nodes = [helper.make_node("Max", [f"m{i}" for i in range(4)], ["big"]),
             helper.make_node("Reshape", ["big", "flat"], ["pads"]),
             helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad"), conv("c", "padded", "w", "y")]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [1, 3, 10, 12])],
                [*inits, ints("flat", [-1]), weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError, match="the output of Pad 'pad'"):
        wsarena.load_model(path)
    assert evaluated == []
    small = [ints("m0", [0, 0, 1, 1] * 2), helper.make_tensor("m1", TensorProto.INT64, (1,), [0])]
    nodes[0] = helper.make_node("Max", ["m0", "m1"], ["big"])
    (layer,) = wsarena.load_model(save(tmp_path / "small.onnx", nodes, [vi("x", [1, 3, 10, 12])],
                                       [*small, ints("flat", [-1]), weight("w", (4, 3, 3, 3))]))
    assert layer.input_shape == (1, 3, 12, 14) and len(evaluated) == 2


def test_arithmetic_before_opset_7_is_not_evaluated_with_numpys_broadcasting(tmp_path):
    # Add, Sub, Mul and Div of opset 6 and before broadcast by their own rule: with broadcast=1, axis=0, b runs along
    # a's first dimension, where NumPy's broadcasting (the evaluator's) runs it along the last. The shape gathered from
    # their sum, [1, 3, 4, 6], was evaluated as [1, 3, 5, 5]: a layer of the wrong input. Now it is unknown, as
    # before constants were evaluated; from opset 7 on, NumPy's broadcasting is ONNX's and it is evaluated.
    a = helper.make_tensor("a", TensorProto.INT64, (2, 3, 2), [0, 3, 0, 0, 0, 0, 4, 1, 0, 0, 0, 0])

    def model(opset):
        legacy = {"broadcast": 1, "axis": 0} if opset < 7 else {}
        nodes = [helper.make_node("Add", ["a", "b"], ["sum"], **legacy),
                 helper.make_node("Reshape", ["sum", "flat"], ["all"]),
                 helper.make_node("Gather", ["all", "picked"], ["shape"]),
                 helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"), conv("c", "r", "w", "y")]
        inits = [a, ints("b", [1, 2]), ints("flat", [-1]), ints("picked", [0, 7, 1, 6]), weight("w", (4, 3, 3, 3))]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])
        return save(tmp_path / f"m{opset}.onnx", nodes, [x], inits, opset=opset)

    with pytest.raises(ModelError, match=re.escape("'c' (input shape ? unknown)")):
        wsarena.load_model(model(6))
    (layer,) = wsarena.load_model(model(7))
    shape = ReferenceEvaluator(str(model(7))).run(["shape"], {"x": np.zeros((1, 75), np.float32)})[0]
    assert layer.input_shape == tuple(shape) == (1, 3, 5, 5)


def test_a_concat_of_more_than_64_elements_is_not_evaluated(tmp_path, evaluated):
    # 65 one-element constants: each small, their Concat not; 8 of them give the pads, evaluated
    def model(count):
        inits = [ints(f"p{i}", [i % 4 // 2]) for i in range(count)]
        nodes = [helper.make_node("Concat", [f"p{i}" for i in range(count)], ["all"], axis=0),
                 helper.make_node("Slice", ["all", "start", "end"], ["pads"]),
                 helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad"), conv("c", "padded", "w", "y")]
        return save(tmp_path / f"m{count}.onnx", nodes, [vi("x", [1, 3, 10, 12])],
                    [*inits, ints("start", [0]), ints("end", [8]), weight("w", (4, 3, 3, 3))])

    with pytest.raises(ModelError, match="the output of Pad 'pad'"):
        wsarena.load_model(model(65))
    assert evaluated == []
    (layer,) = wsarena.load_model(model(8))
    assert layer.input_shape == (1, 3, 12, 14) and len(evaluated) == 2


def test_an_integer_division_by_zero_among_constants_warns_nothing(tmp_path):
    # NumPy's divide-by-zero warning is the evaluator's business, not the caller's: 1 // 0 is 0 there, as in ONNX's
    # reference, and the pads [0, 0, 1, 1, 0, 0, 1, 1] it gives here are read.
    nodes = [helper.make_node("Div", ["ones", "divisor"], ["quotient"]),
             helper.make_node("Add", ["quotient", "mask"], ["pads"]),
             helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad"), conv("c", "padded", "w", "y")]
    inits = [ints("ones", [1] * 8), ints("divisor", [0] * 8), ints("mask", [0, 0, 1, 1] * 2), weight("w", (4, 3, 3, 3))]
    path = save(tmp_path / "m.onnx", nodes, [vi("x", [1, 3, 10, 12])], inits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (layer,) = wsarena.load_model(path)
    assert layer.input_shape == (1, 3, 12, 14)
