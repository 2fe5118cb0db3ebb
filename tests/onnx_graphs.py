"""Small ONNX models built with onnx.helper, for the tests of the ONNX loader and the command line."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def weight(name, shape):
    return numpy_helper.from_array(np.zeros(shape, dtype=np.float32), name)


def ints(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def save(path, nodes, inputs, initializers=(), outputs=None, opset=17):
    out = outputs if outputs is not None else [vi(nodes[-1].output[0], None)]
    graph = helper.make_graph(nodes, "g", inputs, out, initializer=list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def conv(name, x, w, y, op="Conv", **attrs):
    return helper.make_node(op, [x, w], [y], name=name, **attrs)


def unet(path, *, group=1, decoder="Conv", size=32):
    """A U-Net step whose skip connection goes through ``Pad`` and ``Concat``, as PyTorch exports it: the
    upsampled map is padded to the encoder's size by pads computed from both shapes (``Shape``, ``Sub``, ``Div``),
    which ONNX shape inference cannot evaluate, so the decoder conv's input is ``[1, ?, size, size]``.

    enc1: 3 -> 8 channels; enc2: 8 -> 16, stride 2; up (ConvTranspose): 16 -> 8, stride 2; concat: 8 + 8 = 16
    channels; dec: 16 -> 8 (``group`` groups), or a ConvTranspose 16 -> 4 when ``decoder="ConvTranspose"``.
    """
    if decoder == "Conv":
        dec = conv("dec", "cat", "w4", "y", pads=[1, 1, 1, 1], group=group)
        w4 = weight("w4", (8, 16 // group, 3, 3))
    else:
        dec = conv("dec", "cat", "w4", "y", op="ConvTranspose", strides=[2, 2])
        w4 = weight("w4", (16, 4, 2, 2))
    nodes = [
        conv("enc1", "x", "w1", "e1", pads=[1, 1, 1, 1]),
        conv("enc2", "e1", "w2", "e2", pads=[1, 1, 1, 1], strides=[2, 2]),
        conv("up", "e2", "w3", "u", op="ConvTranspose", strides=[2, 2]),
        helper.make_node("Shape", ["e1"], ["s1"]),
        helper.make_node("Shape", ["u"], ["s2"]),
        helper.make_node("Sub", ["s1", "s2"], ["d"]),
        helper.make_node("Div", ["d", "two"], ["h"]),
        helper.make_node("Slice", ["h", "start", "end"], ["hw"]),
        helper.make_node("Concat", ["zeros", "hw", "zeros", "hw"], ["pads"], axis=0),
        helper.make_node("Pad", ["u", "pads"], ["padded"]),
        helper.make_node("Concat", ["e1", "padded"], ["cat"], axis=1),
        dec,
    ]
    inits = [weight("w1", (8, 3, 3, 3)), weight("w2", (16, 8, 3, 3)), weight("w3", (16, 8, 2, 2)), w4,
             ints("two", [2]), ints("start", [2]), ints("end", [4]), ints("zeros", [0, 0])]
    return save(path, nodes, [vi("x", [1, 3, size, size])], inits)


def inferred_shape(path, tensor):
    """The shape ONNX shape inference gives ``tensor`` (``None`` for an unknown dimension)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), data_prop=True)
    for v in [*model.graph.value_info, *model.graph.output]:
        if v.name == tensor:
            return tuple(d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim)
    raise AssertionError(f"no inferred shape for {tensor!r}")
