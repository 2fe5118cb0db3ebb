"""Layer tables: the zoo against the reference architectures, ONNX import, the JSON schema, errors."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import select
import stat
import warnings
from itertools import pairwise

import numpy as np
import onnx  # a hard dependency of wsarena: its absence must fail, not skip
import pytest
from onnx import TensorProto, helper, numpy_helper

import wsarena
from wsarena.errors import WsarenaError
from wsarena.models import ConvLayer, ModelError, layers_from_json, layers_to_json, load_model, total_macs, zoo_names
from wsarena.models._onnx import load_onnx

from .pipe_helpers import unblocked, written_pipe

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def by_name(layers):
    return {layer.name: layer for layer in layers}


def out_shape(layer):
    return layer.geometry().output_shape


# --------------------------------------------------------------------------------------------------- the zoo

# (convs, depthwise, transposed, published MACs of the convolutions at batch 1)
ZOO = {
    "resnet50": (53, 0, 0, 4.09e9),  # 4.1 GMACs with the fc layer (2M), torchvision's figure
    "vgg16": (13, 0, 0, 15.35e9),  # 15.47 GMACs with the three fc layers (124M)
    "inception_v3": (94, 0, 0, 5.71e9),  # torchvision's 5.71 G (the fc adds 2M)
    "googlenet": (57, 0, 0, 1.50e9),  # torchvision's 1.50 G
    "mobilenet_v2": (52, 17, 0, 0.30e9),  # the paper's 300M multiply-adds (the fc adds 1.3M)
    "unet": (23, 0, 4, None),
}


def test_zoo_names_and_public_names():
    assert zoo_names() == list(ZOO)
    assert wsarena.load_model is load_model and wsarena.ConvLayer is ConvLayer
    assert issubclass(ModelError, WsarenaError) and issubclass(ModelError, ValueError)


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_counts_geometry_and_macs(name):
    convs, depthwise, transposed, macs = ZOO[name]
    layers = load_model(name)
    assert len(layers) == convs
    assert sum(layer.depthwise for layer in layers) == depthwise
    assert sum(layer.transposed for layer in layers) == transposed
    assert len({layer.name for layer in layers}) == convs  # names are unique
    for layer in layers:
        assert layer.input_shape[0] == 1
        g = layer.geometry()
        assert all(s >= 1 for s in g.output_size), layer
        assert g.input_shape == layer.input_shape and g.weight_shape == layer.weight_shape
    if macs is not None:
        assert total_macs(layers) == pytest.approx(macs, rel=0.02)
    assert load_model(name) is not layers and load_model(name) == layers  # fresh lists, same data


def test_zoo_does_not_import_onnx():
    import subprocess
    import sys

    code = "import sys, wsarena; wsarena.load_model('unet'); print('onnx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_zoo_names_are_forgiving():
    assert load_model("ResNet50") == load_model("resnet50")
    assert load_model("mobilenet-v2") == load_model("mobilenet_v2")


def test_resnet50_reference_shapes():
    layers = load_model("resnet50")
    d = by_name(layers)
    first = layers[0]
    assert (first.name, first.input_shape, first.weight_shape) == ("conv1", (1, 3, 224, 224), (64, 3, 7, 7))
    assert (first.stride, first.padding) == ((2, 2), (3, 3)) and out_shape(first) == (1, 64, 112, 112)
    assert d["layer1.0.conv1"].input_shape == (1, 64, 56, 56)  # after the 3x3/2 max pool
    downsample = [layer for layer in layers if "downsample" in layer.name]
    assert [(l.input_shape, l.weight_shape, l.stride) for l in downsample] == [
        ((1, 64, 56, 56), (256, 64, 1, 1), (1, 1)),
        ((1, 256, 56, 56), (512, 256, 1, 1), (2, 2)),
        ((1, 512, 28, 28), (1024, 512, 1, 1), (2, 2)),
        ((1, 1024, 14, 14), (2048, 1024, 1, 1), (2, 2)),
    ]
    # v1.5: the stride sits on the 3x3, the first 1x1 of a block keeps the resolution
    assert d["layer2.0.conv1"].stride == (1, 1) and d["layer2.0.conv1"].input_shape == (1, 256, 56, 56)
    assert d["layer2.0.conv2"].stride == (2, 2) and out_shape(d["layer2.0.conv2"]) == (1, 128, 28, 28)
    last = layers[-1]
    assert (last.name, last.input_shape, last.weight_shape) == ("layer4.2.conv3", (1, 512, 7, 7), (2048, 512, 1, 1))
    assert d["layer4.2.conv2"].input_shape == (1, 512, 7, 7) and d["layer4.2.conv2"].weight_shape == (512, 512, 3, 3)
    assert [l.name for l in layers[1:5]] == ["layer1.0.conv1", "layer1.0.conv2", "layer1.0.conv3",
                                             "layer1.0.downsample.0"]
    assert total_macs(layers) == 4_087_136_256


def test_resnet50_chains():
    d = by_name(load_model("resnet50"))
    blocks = [(s, b) for s, n in enumerate([3, 4, 6, 3], 1) for b in range(n)]
    for (s, b), nxt in zip(blocks, blocks[1:] + [None]):
        p = f"layer{s}.{b}"
        assert out_shape(d[f"{p}.conv1"]) == d[f"{p}.conv2"].input_shape
        assert out_shape(d[f"{p}.conv2"]) == d[f"{p}.conv3"].input_shape
        if b == 0:  # the shortcut reads the block's input and lands on the block's output
            assert d[f"{p}.downsample.0"].input_shape == d[f"{p}.conv1"].input_shape
            assert out_shape(d[f"{p}.downsample.0"]) == out_shape(d[f"{p}.conv3"])
        if nxt is not None:
            assert out_shape(d[f"{p}.conv3"]) == d[f"layer{nxt[0]}.{nxt[1]}.conv1"].input_shape


def test_vgg16_reference_shapes():
    layers = load_model("vgg16")
    assert [l.name for l in layers] == [f"features.{i}" for i in (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28)]
    assert all(l.weight_shape[2:] == (3, 3) and l.padding == (1, 1) and l.stride == (1, 1) for l in layers)
    assert [l.input_shape[2] for l in layers] == [224] * 2 + [112] * 2 + [56] * 3 + [28] * 3 + [14] * 3
    assert layers[-1].input_shape == (1, 512, 14, 14) and layers[-1].weight_shape == (512, 512, 3, 3)
    for a, b in pairwise(layers):
        assert out_shape(a)[1] == b.input_shape[1]
        assert out_shape(a)[2] in (b.input_shape[2], 2 * b.input_shape[2])  # same size, or a 2x2 max pool


def test_inception_v3_reference_shapes():
    layers = load_model("inception_v3")
    d = by_name(layers)
    assert layers[0].input_shape == (1, 3, 299, 299) and out_shape(layers[0]) == (1, 32, 149, 149)
    assert d["Conv2d_4a_3x3.conv"].input_shape == (1, 80, 73, 73)
    assert d["Mixed_5b.branch1x1.conv"].input_shape == (1, 192, 35, 35)
    assert d["Mixed_5d.branch_pool.conv"].weight_shape == (64, 288, 1, 1)
    assert d["Mixed_6a.branch3x3.conv"].weight_shape == (384, 288, 3, 3)
    assert out_shape(d["Mixed_6a.branch3x3.conv"]) == (1, 384, 17, 17)
    c7 = d["Mixed_6b.branch7x7_2.conv"]
    assert (c7.input_shape, c7.weight_shape, c7.padding) == ((1, 128, 17, 17), (128, 128, 1, 7), (0, 3))
    assert d["Mixed_6e.branch7x7dbl_5.conv"].weight_shape == (192, 192, 1, 7)
    assert d["Mixed_7a.branch3x3_1.conv"].input_shape == (1, 768, 17, 17)
    assert out_shape(d["Mixed_7a.branch7x7x3_4.conv"]) == (1, 192, 8, 8)
    assert d["Mixed_7b.branch1x1.conv"].input_shape == (1, 1280, 8, 8)
    # Mixed_7c: the last InceptionE, on 8x8x2048
    m = {k[len("Mixed_7c."):]: v for k, v in d.items() if k.startswith("Mixed_7c.")}
    assert len(m) == 9
    assert all(l.input_shape[2:] == (8, 8) for l in m.values())
    assert m["branch1x1.conv"].weight_shape == (320, 2048, 1, 1)
    assert m["branch3x3dbl_1.conv"].weight_shape == (448, 2048, 1, 1)
    assert m["branch3x3dbl_3b.conv"].weight_shape == (384, 384, 3, 1) and m["branch3x3dbl_3b.conv"].padding == (1, 0)
    assert layers[-1].name == "Mixed_7c.branch_pool.conv" and layers[-1].weight_shape == (192, 2048, 1, 1)
    per_module = {}
    for layer in layers:
        per_module[layer.name.split(".")[0]] = per_module.get(layer.name.split(".")[0], 0) + 1
    assert [per_module[f"Mixed_{m}"] for m in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c")] == [
        7, 7, 7, 4, 10, 10, 10, 10, 6, 9, 9]
    # the output channels of a module's branches add up to the next module's input channels
    assert sum(out_shape(m[b])[1] for b in ("branch1x1.conv", "branch3x3_2a.conv", "branch3x3_2b.conv",
                                          "branch3x3dbl_3a.conv", "branch3x3dbl_3b.conv",
                                          "branch_pool.conv")) == 2048


def test_googlenet_reference_shapes():
    layers = load_model("googlenet")
    d = by_name(layers)
    assert [l.name for l in layers[:3]] == ["conv1.conv", "conv2.conv", "conv3.conv"]
    assert d["conv2.conv"].input_shape == (1, 64, 56, 56)  # ceil-mode pooling: 112 -> 56
    assert d["inception3a.branch1.conv"].input_shape == (1, 192, 28, 28)
    assert d["inception4a.branch1.conv"].input_shape == (1, 480, 14, 14)
    assert d["inception5a.branch1.conv"].input_shape == (1, 832, 7, 7)
    assert d["inception5b.branch4.1.conv"].weight_shape == (128, 832, 1, 1)
    assert d["inception4e.branch3.1.conv"].weight_shape == (128, 32, 3, 3)  # torchvision's 3x3 "5x5" branch
    ends = ("branch1.conv", "branch2.1.conv", "branch3.1.conv", "branch4.1.conv")
    order = ["3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b"]
    for m, nxt in pairwise(order):
        channels = sum(out_shape(d[f"inception{m}.{e}"])[1] for e in ends)
        assert channels == d[f"inception{nxt}.branch1.conv"].input_shape[1]


def test_mobilenet_v2_reference_shapes():
    layers = load_model("mobilenet_v2")
    d = by_name(layers)
    dw = [l for l in layers if l.depthwise]
    assert len(dw) == 17
    assert all(l.weight_shape[1:] == (1, 3, 3) and l.groups == l.input_shape[1] == l.weight_shape[0] for l in dw)
    assert [l.name for l in dw if l.stride == (2, 2)] == [f"features.{i}.conv.1.0" for i in (2, 4, 7, 14)]
    assert d["features.0.0"].input_shape == (1, 3, 224, 224) and d["features.0.0"].stride == (2, 2)
    assert d["features.1.conv.0.0"].weight_shape == (32, 1, 3, 3)  # t=1: no expansion conv in the first block
    assert d["features.1.conv.1"].weight_shape == (16, 32, 1, 1)
    assert d["features.3.conv.1.0"].input_shape == (1, 144, 56, 56)
    assert d["features.17.conv.2"].weight_shape == (320, 960, 1, 1)
    last = layers[-1]
    assert (last.name, last.input_shape, last.weight_shape) == ("features.18.0", (1, 320, 7, 7), (1280, 320, 1, 1))
    for a, b in pairwise(layers):  # a plain chain: every conv feeds the next
        assert out_shape(a) == b.input_shape, (a.name, b.name)


def test_unet_reference_shapes():
    layers = load_model("unet")
    d = by_name(layers)
    first = layers[0]
    assert (first.input_shape, first.weight_shape, first.padding) == ((1, 1, 572, 572), (64, 1, 3, 3), (0, 0))
    assert out_shape(first) == (1, 64, 570, 570)
    assert out_shape(d["down1.conv2"]) == (1, 64, 568, 568)
    assert out_shape(d["down5.conv2"]) == (1, 1024, 28, 28)
    up = [l for l in layers if l.transposed]
    assert [l.name for l in up] == [f"up{i}.upconv" for i in range(1, 5)]
    u1 = d["up1.upconv"]  # 1024 x 28x28 -> 512 x 56x56, stored as the conv from 56x56x512 back to 28x28x1024
    assert (u1.input_shape, u1.weight_shape, u1.stride) == ((1, 512, 56, 56), (1024, 512, 2, 2), (2, 2))
    assert out_shape(u1) == out_shape(d["down5.conv2"])
    assert d["up1.conv1"].input_shape == (1, 1024, 56, 56)  # up-convolution + cropped skip connection
    assert out_shape(d["up4.conv2"]) == (1, 64, 388, 388)
    last = layers[-1]
    assert (last.name, last.weight_shape) == ("final.conv", (2, 64, 1, 1))
    assert out_shape(last) == (1, 2, 388, 388)
    for a, b in pairwise(layers):  # spatial chaining: same size, 2x2 pool, or through an up-convolution
        if b.transposed:
            assert out_shape(b) == out_shape(a)
        elif a.transposed:
            assert a.input_shape[2:] == b.input_shape[2:] and b.input_shape[1] == 2 * a.input_shape[1]
        else:
            assert out_shape(a)[2] in (b.input_shape[2], 2 * b.input_shape[2])


# ----------------------------------------------------------------------------------------------- ConvLayer

def test_geometry_batch_dtype_layout():
    layer = by_name(load_model("resnet50"))["layer1.0.conv2"]
    g = layer.geometry(batch=32, dtype="float16")
    assert (g.batch, g.dtype, g.layout) == (32, "float16", "NCHW")
    assert g.input_shape == (32, 64, 56, 56) and g.output_shape == (32, 64, 56, 56)
    assert g.macs == 32 * layer.macs
    h = layer.geometry(batch=2, layout="NHWC")
    assert h.input_shape == (2, 56, 56, 64) and h.weight_shape == (64, 3, 3, 64) and h.output_shape == (2, 56, 56, 64)
    for bad in (0, -1, np.int64(0)):
        with pytest.raises(ValueError, match=r"^batch must be a positive int, not "):
            layer.geometry(batch=bad)
    # A batch of another type is a TypeError, as plan() gives it: a float, a bool (no count), a one-element array
    # (it has __index__ too, yet is no integer)
    for bad, shown in ((1.5, "1.5"), (2.0, "2.0"), (True, "True"), (False, "False"), (np.True_, r"np\.True_"),
                       (np.array([32]), "array")):
        with pytest.raises(TypeError, match=rf"batch must be a positive int, not {shown}"):
            layer.geometry(batch=bad)
        with pytest.raises(TypeError, match=rf"batch must be a positive int, not {shown}"):
            wsarena.plan([layer], batch=bad, backend="cpu")
    assert layer.geometry(batch=np.int64(32)) == g.with_dtype("float32")  # as the layer's own shapes take them
    with pytest.raises(ValueError, match="layout"):
        layer.geometry(layout="CHWN")


def test_geometry_takes_the_dtypes_the_planner_takes_and_refuses_the_rest():
    """The geometry's dtype was whatever was given, unchecked: "int8", None (as "None"), np.float32 (as "<class
    'numpy.float32'>"). It is a name of one the backends compute in, given as the planner takes it (a NumPy or
    PyTorch dtype by its name); any other is the planner's ValueError."""
    layer = ConvLayer("c", (1, 3, 8, 8), (4, 3, 3, 3))
    for given, name in (("float16", "float16"), (np.float32, "float32"), (np.dtype("float64"), "float64"),
                        ("bfloat16", "bfloat16")):
        assert layer.geometry(dtype=given).dtype == name
    for bad in ("int8", None, "f4", np.int32, "float"):
        with pytest.raises(ValueError, match=r"^dtype must be one of float32, float16, bfloat16, float64, or their "):
            layer.geometry(dtype=bad)
        with pytest.raises(ValueError, match=r"^dtype must be one of "):
            wsarena.plan([layer], dtype=bad, backend="cpu")


def test_layer_normalizes_and_checks():
    layer = ConvLayer("c", [8, 4, 10], [6, 2, 3], stride=2, padding=1, groups=2)  # 1-D, batch read as 1
    assert layer.input_shape == (1, 4, 10) and layer.stride == (2,) and layer.padding == (1,)
    assert out_shape(layer) == (1, 6, 5)
    with pytest.raises(ModelError, match=r"layer 'big'.*larger than the padded input"):
        ConvLayer("big", (1, 3, 4, 4), (8, 3, 7, 7))
    with pytest.raises(ModelError, match="groups"):
        ConvLayer("g", (1, 6, 8, 8), (6, 2, 3, 3), groups=4)
    with pytest.raises(ModelError, match="one entry per spatial dimension"):
        ConvLayer("s", (1, 3, 8, 8), (4, 3, 3, 3), stride=(1, 1, 1))
    with pytest.raises(ModelError, match="name"):
        ConvLayer("", (1, 3, 8, 8), (4, 3, 3, 3))
    assert ConvLayer("n", (1, np.int64(3), 8, 8), (4, 3, 3, 3), padding=np.int32(1)).padding == (1, 1)
    for bad in (np.array([3]), np.True_, 3.0):  # an __index__ that refuses, none, a float: the model's own error
        with pytest.raises(ModelError, match=r"input_shape\[1\] must be an integer"):
            ConvLayer("n", (1, bad, 8, 8), (4, 3, 3, 3))


# -------------------------------------------------------------------------------------------------- JSON

@pytest.mark.parametrize("name", list(ZOO))
def test_json_round_trip(tmp_path, name):
    layers = load_model(name)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(layers_to_json(layers)))
    assert load_model(path) == layers
    assert load_model(str(path)) == layers
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([layer.to_dict() for layer in layers]))
    assert load_model(bare) == layers
    assert load_model([layer.to_dict() for layer in layers]) == layers
    assert load_model(layers) == layers and load_model(layers) is not layers


def test_json_defaults_and_report_keys(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "x", "batch": 32, "layers": [
        {"name": "a", "input_shape": [32, 3, 32, 32], "weight_shape": [8, 3, 3, 3], "padding": 1,
         "fwd": {"algo": "gemm", "workspace_bytes": 0}, "bwd_data": {}, "bwd_filter": {}},
    ]}))
    (layer,) = load_model(path)
    assert layer == ConvLayer("a", (1, 3, 32, 32), (8, 3, 3, 3), stride=1, padding=1, dilation=1, groups=1)
    assert layer.to_dict() == {"name": "a", "input_shape": [1, 3, 32, 32], "weight_shape": [8, 3, 3, 3],
                               "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1,
                               "transposed": False}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", ["mobilenet_v2", "unet"])  # depthwise and grouped; transposed layers
def test_a_json_report_reads_back_as_its_model(tmp_path, name, layout):
    layers = load_model(name)
    report = wsarena.plan(layers, batch=2, layout=layout, backend="cpu").to_dict()
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert load_model(path) == layers


def test_the_ignored_layer_keys_are_documented():
    from wsarena.models._layer import _REPORT_KEYS

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "models.md"), encoding="utf-8") as f:
        docs = f.read()
    schema = docs[docs.index("## JSON layer list"):docs.index("## Transposed convolutions")]
    assert [key for key in sorted(_REPORT_KEYS) if f"`{key}`" not in schema] == []
    (layer,) = layers_from_json([{**GOOD, "output_shape": "junk", "macs": -1, "stream": "x"}])
    assert layer == ConvLayer.from_dict(GOOD)


@pytest.mark.parametrize(("text", "says"), [
    ('{"layout": null, "layers": []}', 'layout must be "NCHW" or "NHWC", not null'),
    ('{"layout": true, "layers": []}', 'layout must be "NCHW" or "NHWC", not true'),
    ('{"layout": NaN, "layers": []}', 'layout must be "NCHW" or "NHWC", not NaN'),
    ('{"layout": ["NHWC", null], "layers": []}', 'layout must be "NCHW" or "NHWC", not ["NHWC", null]'),
    ('{"layout": {"it\'s": "NHWC"}, "layers": []}', 'layout must be "NCHW" or "NHWC", not {"it\'s": "NHWC"}'),
    ('{"layout": "say \\"NHWC\\"\\n", "layers": []}', 'layout must be "NCHW" or "NHWC", not "say \\"NHWC\\"\\n"'),
    ('{"model": "x", "it\'s": 1, "tab\\t": 2}',
     'a JSON object needs a "layers" list (found keys: ["it\'s", "model", "tab\\t"])'),
], ids=["null", "true", "nan", "array", "object", "quotes", "keys"])
def test_a_json_files_layout_and_keys_are_said_as_the_file_writes_them(tmp_path, text, says):
    """A .json model's layout and, without "layers", its keys were said in Python's words (None, True, nan, ['NHWC',
    None], "it's" in double quotes where the others had single ones), none of which the file shows: they are said as
    JSON writes them, the choices too."""
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ModelError) as refused:
        load_model(path)
    assert str(refused.value) == f"{str(path)!r}: {says}"


def test_a_json_layout_other_than_nchw_or_nhwc_is_refused():
    with pytest.raises(ModelError, match='layout must be "NCHW" or "NHWC", not "CHWN"'):
        layers_from_json({"layout": "CHWN", "layers": [GOOD]})


@pytest.mark.parametrize(("data", "says"), [
    ({"k" * 10_000: 1}, f'a JSON object needs a "layers" list (found keys: ["{"k" * 27}...{"k" * 28}"])'),
    ({f"k{i}": i for i in range(20)},
     'a JSON object needs a "layers" list (found keys: ["k0", "k1", "k10", "k11", "k12", "k13", ... 14 more])'),
    ({1: 2, "a": 3}, "a JSON object needs a \"layers\" list (found keys: [1, 'a'])"),  # keys that do not compare
    ({"layout": "x" * 10_000, "layers": []}, f'layout must be "NCHW" or "NHWC", not "{"x" * 27}...{"x" * 28}"'),
], ids=["long-key", "many-keys", "keys-that-do-not-compare", "long-layout"])
def test_a_json_objects_keys_and_layout_are_quoted_shortened(data, says):
    """A JSON object's keys and its layout were quoted whole, a 10 kB key in a line as long (the layout cut at 40
    characters, its quote left open); keys of a mapping given in Python that do not compare raised a TypeError."""
    with pytest.raises(ModelError) as caught:
        layers_from_json(data)
    assert str(caught.value) == f"JSON: {says}"


@pytest.mark.parametrize(("extra", "says"), [
    ({"k" * 10_000: 1}, f"has unknown key(s) '{'k' * 27}...{'k' * 28}'; known: "),
    ({f"k{i}": i for i in range(20)}, "has unknown key(s) 'k0', 'k1', 'k10', 'k11', 'k12', and 15 more; known: "),
    ({1: 2, "a": 3}, "has unknown key(s) 1, 'a'; known: "),  # keys that do not compare: a TypeError
], ids=["long-key", "many-keys", "keys-that-do-not-compare"])
def test_a_layers_unknown_keys_are_quoted_shortened(extra, says):
    """A layer's unknown keys were each quoted whole, and all of them: a 10 kB key, or a thousand keys, gave a line
    as long; keys of a mapping given in Python that do not compare raised a TypeError."""
    layer = {"name": "a", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3], **extra}
    with pytest.raises(ModelError) as caught:
        layers_from_json([layer])
    assert str(caught.value).startswith(f"JSON: layers[0] {says}name, input_shape"), str(caught.value)[:300]


GOOD = {"name": "a", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}


@pytest.mark.parametrize("content, message", [
    ("{not json", r"is not valid JSON: .* line 1 column 2"),
    ('{"model": "x"}', 'needs a "layers" list'),
    ('"resnet50"', "expected a list of layers"),
    ("[]", "layer list is empty"),
    ("[1]", r"layers\[0\] must be an object"),
    (json.dumps([GOOD, {"name": "b", "input_shape": [1, 3, 8, 8]}]), r"layers\[1\] lacks 'weight_shape'"),
    (json.dumps([{**GOOD, "strides": [2, 2]}]), r"unknown key\(s\) 'strides'"),
    (json.dumps([{**GOOD, "input_shape": [1, 3, 8.0, 8]}]), r"input_shape\[2\] must be an integer, not 8.0$"),
    (json.dumps([{**GOOD, "stride": [2.0, 2]}]), r"layer 'a': stride\[0\] must be an integer, not 2.0$"),
    (json.dumps([{**GOOD, "dilation": [1, [1]]}]), r"layer 'a': dilation\[1\] must be an integer, not \[1\]$"),
    (json.dumps([{**GOOD, "groups": True}]), "must be an integer, not True"),
    (json.dumps([{**GOOD, "input_shape": "1x3x8x8"}]), "must be a list of integers"),
    (json.dumps([{**GOOD, "name": 3}]), "name must be a non-empty string"),
    (json.dumps([{**GOOD, "transposed": "yes"}]), "transposed must be true or false"),
    (json.dumps([{**GOOD, "input_shape": [1, 3, 2, 2]}]), r"layers\[0\]: layer 'a': kernel .* larger"),
    (json.dumps([{**GOOD, "input_shape": [1, 3, 8, 8, 8, 8]}]), "must have 3, 4 or 5 entries"),
    (json.dumps([{**GOOD, "padding": [1, 1, 1]}]), "one entry per spatial dimension"),
    (json.dumps([{**GOOD, "weight_shape": [4, 2, 3, 3]}]), "input channels per group"),
])
def test_malformed_json(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ModelError, match=message) as info:
        load_model(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\n"])
def test_a_json_error_is_placed_on_its_line_whatever_ends_the_lines(tmp_path, newline):
    """The line and column of an error are those of the file read as text, as they were: a file whose lines end in a
    lone \\r (an old Mac's) said line 1, as the decoder counts only \\n, once the file was read as bytes."""
    path = tmp_path / "bad.json"
    path.write_bytes(newline.join(["[", "  {", '    "name": "a",', '    "input_shape": ]', "]"]).encode())
    with open(path, encoding="utf-8-sig") as f:  # text mode: any of the three ends a line
        text = f.read()
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    assert (expected.value.lineno, expected.value.colno) == (4, 20)
    with pytest.raises(ModelError, match=r"is not valid JSON: Expecting value at line 4 column 20$"):
        load_model(path)


def test_json_nested_too_deeply(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000)
    with pytest.raises(ModelError, match="nested too deeply"):
        load_model(path)


def test_json_not_utf8(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ModelError, match="not a JSON text file"):
        load_model(path)


@pytest.mark.parametrize(("text", "says"), [
    ("null", 'expected a list of layers or {"layers": [...]}, not null'),
    ("3", 'expected a list of layers or {"layers": [...]}, not a number (3)'),
    ("-2.5e0", 'expected a list of layers or {"layers": [...]}, not a number (-2.5)'),
    ("true", 'expected a list of layers or {"layers": [...]}, not true'),
    ('"vgg16"', 'expected a list of layers or {"layers": [...]}, not a string ("vgg16")'),
    ('{"layers": null}', 'expected "layers" to be a list of layers, not null'),
    ('{"layers": {"name": "c1"}}', 'expected "layers" to be a list of layers, not an object'),
])
def test_a_json_value_other_than_a_layer_list_is_said_in_jsons_words(tmp_path, text, says):
    """A .json model holding null or a number was refused as "not NoneType", "not int": Python's type names, which
    the file's author never wrote. The value is said as JSON says it, and in {"layers": ...}, as the object's."""
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ModelError) as refused:
        load_model(path)
    assert str(refused.value) == f"{str(path)!r}: {says}"
    with pytest.raises(ModelError, match=r'^JSON: expected a list of layers or \{"layers": \[\.\.\.\]\}, not tuple$'):
        layers_from_json(({"name": "c1"},))  # from Python: a value no JSON text gives is named by its type


@pytest.mark.parametrize(("text", "says"), [
    ("NaN", 'expected a list of layers or {"layers": [...]}, not a number (NaN)'),
    ('{"layers": -Infinity}', 'expected "layers" to be a list of layers, not a number (-Infinity)'),
    ("[null]", "layers[0] must be an object with name, input_shape and weight_shape, not null"),
    ('{"layers": [true]}', "layers[0] must be an object with name, input_shape and weight_shape, not true"),
    ('{"layout": "NHWC", "layers": [[1]]}',
     "layers[0] must be an object with name, input_shape and weight_shape, not an array"),
    ('[{"name": "a", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}, "b"]',
     'layers[1] must be an object with name, input_shape and weight_shape, not a string ("b")'),
    ('[{"name": "a"}, null]', "layers[0] lacks 'input_shape', 'weight_shape'"),  # the first bad entry first
])
def test_a_json_value_in_a_layer_list_or_beyond_json_is_said_in_jsons_words(tmp_path, text, says):
    """A layer list's entry that is no object was said in Python's words ("not None", "not True"), and a number
    Python's decoder takes beyond JSON's as Python writes it ("nan", "-inf"), none of which the file shows: they are
    said as the file writes them, as the value where the list is expected is."""
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ModelError) as refused:
        load_model(path)
    assert str(refused.value) == f"{str(path)!r}: {says}"


def test_layers_from_json_names_its_source():
    with pytest.raises(ModelError, match=r"^mine: layers\[0\]"):
        layers_from_json([{"name": "x"}], source="mine")


def test_a_layer_list_may_mix_layers_and_layer_dicts():
    """A layer made by hand added to those read from dicts was refused: "layers[1] must be an object with name,
    input_shape and weight_shape, not ConvLayer(...)", which a layer is. Each entry is taken as it is or read as the
    schema reads it, in its place; a bad entry is named by its own index among all of them."""
    made = ConvLayer("made", (1, 4, 6, 6), (8, 4, 1, 1))
    layers = load_model([GOOD, made, {**GOOD, "name": "c", "stride": 2}])
    assert [layer.name for layer in layers] == ["a", "made", "c"] and layers[1] is made
    assert layers[0] == ConvLayer.from_dict(GOOD) and layers[2].stride == (2, 2)
    with pytest.raises(ModelError, match=r"^layer list: layers\[2\] must be an object with name"):
        load_model((made, GOOD, None))
    with pytest.raises(ModelError, match=r"^layer list: layers\[1\] lacks 'weight_shape'$"):
        load_model([made, {"name": "b", "input_shape": [1, 3, 8, 8]}])
    assert load_model((made,)) == [made]  # layers alone, and dicts alone, as before
    with pytest.raises(ModelError, match=r"^the layer list is empty$"):
        load_model([])


# -------------------------------------------------------------------------------------------- sources

def test_unknown_zoo_name_lists_the_zoo():
    with pytest.raises(ModelError) as info:
        load_model("resnet5")
    msg = str(info.value)
    assert "unknown model 'resnet5'" in msg and all(n in msg for n in zoo_names()) and "did you mean 'resnet50'" in msg


def test_an_unknown_model_is_said_before_input_shapes_is_refused_for_it(tmp_path):
    """input_shapes= with a name that names no model said only that input_shapes applies to .onnx models: the name's
    own error, with its hint, is the real problem. A zoo model or a .json layer list still refuses input_shapes."""
    (tmp_path / "m.txt").write_text("")
    for source, says in [("resnt50", r"^unknown model 'resnt50': .*; did you mean 'resnet50'\?$"),
                         (pathlib.Path("resnet50"), r"^no model file 'resnet50': .* is named by a str, not a path$"),
                         (tmp_path, r"is a folder: expected a \.onnx or \.json file$"),
                         (tmp_path / "m.txt", r"unknown model file extension '\.txt'; expected \.onnx or \.json$")]:
        with pytest.raises(ModelError, match=says):
            load_model(source, input_shapes=(1, 3, 8, 8))
    for source in ("ResNet50", tmp_path / "m.json"):
        # input_shapes alone, where it said "(--input-shape)" too, which the command refuses in its own words
        with pytest.raises(ValueError, match=r"^input_shapes applies to \.onnx models only, not ") as no:
            load_model(source, input_shapes=(1, 3, 8, 8))
        assert type(no.value) is ValueError


@pytest.mark.parametrize("name", [".json", ".onnx", "..JSON"])
@pytest.mark.parametrize("there", [True, False])
def test_a_file_named_as_an_extension_is_said_to_have_none(tmp_path, monkeypatch, name, there):
    """".json" has no extension, as ".bashrc" has none: it was "unknown model file extension (none); expected .onnx
    or .json", or, missing, "not ... a .onnx or .json file", of a name that reads as one; said why, as a str or a
    path."""
    monkeypatch.chdir(tmp_path)
    if there:
        (tmp_path / name).write_text("[]")
    for source in (name, tmp_path / name):
        with pytest.raises(ModelError) as raised:
            load_model(source)
        assert str(raised.value) == (
            f"{str(source)!r}: unknown model file extension (none: a name's leading dots begin no extension, as in "
            ".bashrc); expected .onnx or .json after a name, as in model.json")


def test_a_path_that_names_no_file_is_not_called_an_unknown_zoo_model(tmp_path):
    # it read "not a zoo model (resnet50, ...); did you mean 'resnet50'?" of Path("resnet50")
    with pytest.raises(ModelError, match=r"^no model file 'resnet50': expected a \.onnx or \.json file; the zoo model "
                       r"'resnet50' is named by a str, not a path$"):
        load_model(pathlib.Path("resnet50"))
    with pytest.raises(ModelError, match=r"^no model file '.*resnet5': expected a \.onnx or \.json file$"):
        load_model(tmp_path / "resnet5")
    assert len(load_model("resnet50")) == 53


@pytest.mark.parametrize("given", [str, pathlib.Path], ids=["str", "path"])
def test_a_model_path_is_read_as_written_and_an_unexpanded_home_is_suggested(tmp_path, monkeypatch, given):
    """A path is read as open() reads it, ``~`` unexpanded (a shell expands it first, unless it is quoted; the
    cache_dir setting, which an environment variable may hold, expands it): "~/m.json" is a file in a folder named "~"
    where there is one. Where there is none and the home folder holds the file, the error suggests it, where it said
    only "No such file or directory"; the device properties file alike."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    (work / "~").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    layer = {"name": "c", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}
    (home / "m.json").write_text(json.dumps([layer]))
    (work / "~" / "m.json").write_text(json.dumps([{**layer, "name": "not home's"}]))
    assert [lp.name for lp in load_model(given("~/m.json"))] == ["not home's"]  # the folder named "~" here
    os.remove(work / "~" / "m.json")
    hint = f" (~ is not expanded, as open() expands none: did you mean {str(home / 'm.json')!r}?)"
    with pytest.raises(ModelError) as info:
        load_model(given("~/m.json"))
    assert str(info.value) == "cannot read '~/m.json': No such file or directory" + hint
    with pytest.raises(ValueError) as info:
        wsarena.plan(load_model([layer]), device_properties=given("~/m.json"))
    assert str(info.value) == "cannot read the device properties '~/m.json': No such file or directory" + hint
    with pytest.raises(ModelError) as info:  # none in the home folder either: nothing to suggest
        load_model(given("~/other.json"))
    assert str(info.value) == "cannot read '~/other.json': No such file or directory"
    (home / "models.json").mkdir()  # nor a folder, which is no model or properties file to read
    with pytest.raises(ModelError) as info:
        load_model(given("~/models.json"))
    assert str(info.value) == "cannot read '~/models.json': No such file or directory"
    with pytest.raises(ValueError) as info:
        wsarena.plan(load_model([layer]), device_properties=given("~/models.json"))
    assert str(info.value) == "cannot read the device properties '~/models.json': No such file or directory"


def test_unknown_extension_unreadable_and_not_onnx(tmp_path):
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"\x00")
    with pytest.raises(ModelError, match=r"unknown model file extension '\.pt'; expected \.onnx or \.json"):
        load_model(weights)
    with pytest.raises(ModelError, match="cannot read .*missing.onnx"):
        load_model(tmp_path / "missing.onnx")
    with pytest.raises(ModelError, match="cannot read .*missing.json"):
        load_model(tmp_path / "missing.json")
    text = tmp_path / "text.onnx"
    text.write_text("this is not a protobuf, just some text\n" * 3)
    with pytest.raises(ModelError, match="is not an ONNX model"):
        load_model(text)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelError, match=r"is not an ONNX model \(no graph nodes\)"):
        load_model(empty)
    directory = tmp_path / "dir.onnx"
    directory.mkdir()
    with pytest.raises(ModelError, match=r"'.*dir\.onnx' is a folder, not a regular file or a pipe"):
        load_model(directory)
    # a NUL in the path was a bare ValueError
    with pytest.raises(ModelError, match=r"^cannot read 'nul\\x00\.onnx': embedded null byte$"):
        load_model("nul\x00.onnx")
    with pytest.raises(TypeError, match="source must be"):
        load_model(42)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ext", [".onnx", ".json"])
def test_a_model_path_that_is_no_regular_file_nor_a_pipe_is_refused_unopened(tmp_path, ext):
    """A FIFO named as a model that no writer has open was waited on until one came, for good where none comes: it
    reads as empty, at once, and is said to have given nothing (the timeout fails the wait). A link to a character
    device read /dev/zero without end: it is refused naming the path and what it is."""
    fifo = tmp_path / f"pipe{ext}"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=rf"^'.*pipe\{ext}' is a pipe that gave nothing: no writer had it open, or "
                                         "its writer wrote nothing$"):
        load_model(fifo)
    device = tmp_path / f"null{ext}"
    device.symlink_to(os.devnull)
    with pytest.raises(ModelError, match=rf"^'.*null\{ext}' is a character device, not a regular file or a pipe: a "
                                         r"model is read from a \.onnx or \.json file$"):
        load_model(device)


@pytest.mark.timeout(60)
def test_a_model_is_read_from_a_pipe(tmp_path):
    """A model named by a link to a pipe (or a FIFO that a writer has open) is read to its end, as cat reads it: its
    layers are those of the same file read as one. The ONNX model is larger than a pipe gives a read (64 KiB)."""
    from .onnx_graphs import conv, save, vi, weight

    json_path = tmp_path / "regular.json"
    json_path.write_text(json.dumps([{"name": "c", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}]))
    onnx_path = save(tmp_path / "regular.onnx", [conv("c", "x", "w", "y", pads=[1, 1, 1, 1])], [vi("x", [1, 64, 8, 8])],
                     [weight("w", (64, 64, 3, 3))])  # 144 KiB of weights
    assert onnx_path.stat().st_size > 1 << 16
    for name, regular in (("model.json", json_path), ("model.onnx", onnx_path)):
        expected = load_model(regular)
        assert expected
        with written_pipe(regular.read_bytes()) as pipe:
            (tmp_path / name).symlink_to(pipe)
            assert load_model(tmp_path / name) == expected


def test_an_onnx_model_larger_than_protobuf_reads_is_refused_unread(tmp_path, monkeypatch):
    """Protobuf parses no message over 2 GiB less a byte: an ONNX file larger (a sparse one here, which takes no disk)
    was read whole, then refused as "not an ONNX model (DecodeError: ... Wire format was corrupt)". It is refused
    before it is read, naming its size, the limit and where weights that large belong."""
    from wsarena import _files

    path = tmp_path / "large.onnx"
    with path.open("wb") as f:
        f.truncate(1 << 31)
    read = []
    monkeypatch.setattr(_files, "_read_to_end", lambda *args: read.append(args) or b"")
    with pytest.raises(ModelError) as caught:
        load_model(path)
    assert str(caught.value) == (
        f"{str(path)!r} holds 2 GiB (2147483648 bytes), more than 2147483647 bytes, the most protobuf reads as one "
        "ONNX model (2 GiB less a byte): weights that large belong in ONNX external data, files beside the model "
        "(onnx.save_model(model, path, save_as_external_data=True)), whose weights wsarena does not read")
    assert read == []


def test_a_model_file_past_a_limit_given_without_a_reason_ends_its_error_at_the_limit(tmp_path):
    """read_model_file's ``beyond``, the reason for the limit, is said after it where given; its default, none,
    left the error ending in ", " after the limit."""
    from wsarena.models._file import read_model_file

    path = tmp_path / "model.json"
    path.write_bytes(b"[]   ")
    with pytest.raises(ModelError) as caught:
        read_model_file(str(path), limit=4)
    assert str(caught.value) == f"{str(path)!r} holds 5 B (5 bytes), more than 4 bytes"
    with written_pipe(b"[]   ") as pipe, pytest.raises(ModelError) as caught:
        read_model_file(pipe, limit=4)
    assert str(caught.value) == f"{pipe!r} gave more than 4 bytes"
    with pytest.raises(ModelError) as caught:
        read_model_file(str(path), limit=4, beyond="the most this kind reads")
    assert str(caught.value) == f"{str(path)!r} holds 5 B (5 bytes), more than 4 bytes, the most this kind reads"


@pytest.mark.timeout(60)
def test_an_onnx_model_from_a_pipe_without_end_is_refused_past_the_limit(tmp_path, monkeypatch):
    """A pipe (``<(cat big.onnx)``, or a writer that never ends) was read until memory ran out: it is refused once it
    gives a byte past the limit (here 1 MiB for protobuf's 2 GiB), read no further, and its writer then finds no
    reader. A JSON layer list has no such limit (json reads any size): 2 MiB of one are read."""
    import threading

    from wsarena.models import _onnx

    monkeypatch.setattr(_onnx, "_PROTOBUF_MAX", 1 << 20)
    r, w = os.pipe()
    written = []

    def write():  # 64 MiB, far past the limit, unless its reader goes away first
        with contextlib.suppress(BrokenPipeError), open(w, "wb") as f:
            for _ in range(1024):
                f.write(bytes(1 << 16))
                written.append(1 << 16)

    writer = threading.Thread(target=write)
    writer.start()
    link = tmp_path / "model.onnx"
    link.symlink_to(f"/dev/fd/{r}")
    try:
        with pytest.raises(ModelError, match=rf"^'{re.escape(str(link))}' gave more than 1048576 bytes, the most "
                                             r"protobuf reads .*: weights that large belong in ONNX external data"):
            load_model(link)
    finally:
        os.close(r)
        writer.join()
    assert sum(written) < 16 << 20
    layers = json.dumps([{"name": "c", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}]) + " " * (2 << 20)
    with written_pipe(layers.encode()) as pipe:
        (tmp_path / "model.json").symlink_to(pipe)
        assert [layer.name for layer in load_model(tmp_path / "model.json")] == ["c"]


@pytest.mark.skipif(not hasattr(select, "epoll") or not os.path.isdir("/proc/self/fd"), reason="Linux's epoll")
def test_a_model_path_to_a_file_of_no_type_says_what_it_is_once(tmp_path):
    """A link to an epoll's descriptor, whose inode has no file type (none of a folder, a FIFO, a device, a socket),
    was said to be "not a regular file, not a regular file"."""
    with select.epoll() as epoll:
        link = tmp_path / "epoll.onnx"
        link.symlink_to(f"/proc/self/fd/{epoll.fileno()}")
        assert stat.S_IFMT(os.stat(link).st_mode) == 0
        with pytest.raises(ModelError) as caught:
            load_model(link)
    assert str(caught.value) == f"{str(link)!r} is a file of another kind, not a regular file or a pipe: a model is " \
                                "read from a .onnx or .json file"


@pytest.mark.parametrize("again", ["a socket", "a regular file"])
def test_a_socket_put_in_a_model_files_place_after_it_was_looked_at_is_said_to_be_one(tmp_path, monkeypatch, again):
    """open() refuses a socket with ENXIO, which read "cannot read ...: No such device or address": the path is looked
    at again, and said to be what it is then, or what open() refuses where that is a regular file again. The look
    before the open is made to see a regular file, as it would before the socket took its place."""
    import socket

    monkeypatch.chdir(tmp_path)  # a socket's path is short: at most 107 bytes
    regular = tmp_path / "regular.json"
    regular.write_text("[]")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind("sock.json")
    real, looks = os.stat, []

    def swapped(path, *args, **kwargs):
        if os.fspath(path) == "sock.json" and (again == "a regular file" or not looks):
            looks.append(path)
            return real(regular)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", swapped)
    kind = "a socket" if again == "a socket" else "a socket or a device with no driver"
    with pytest.raises(ModelError) as caught:
        load_model("sock.json")
    assert str(caught.value) == f"'sock.json' is {kind}, not a regular file or a pipe: a model is read from a " \
                                ".onnx or .json file"
    assert looks


# ------------------------------------------------------------------------------- ONNX: the light models

def light(name):
    """A model of onnx's backend tests. Every onnx wheel wsarena accepts (>= 1.16) ships all of them: a missing one
    is a broken install or a moved directory, and fails."""
    path = os.path.join(LIGHT, f"light_{name}.onnx")
    assert os.path.isfile(path), f"{path} is missing from onnx {onnx.__version__}"
    return path


@pytest.mark.parametrize("name, convs, grouped, depthwise", [
    ("resnet50", 53, 0, 0), ("inception_v1", 57, 0, 0), ("inception_v2", 69, 0, 0), ("vgg19", 16, 0, 0),
    ("densenet121", 121, 0, 0), ("squeezenet", 26, 0, 0), ("shufflenet", 49, 48, 16), ("bvlc_alexnet", 5, 3, 0),
    ("zfnet512", 5, 0, 0),
])
def test_light_models_import(name, convs, grouped, depthwise):
    layers = load_model(light(name))
    assert len(layers) == convs
    assert sum(layer.groups > 1 for layer in layers) == grouped
    assert sum(layer.depthwise for layer in layers) == depthwise
    assert layers[0].input_shape == (1, 3, 224, 224)
    assert not any(layer.transposed for layer in layers)


def test_light_resnet50_matches_the_zoo():
    # Caffe2's ResNet-50 puts the stride on the 3x3 and runs the shortcut after the main branch, like
    # torchvision's v1.5: all 53 convolutions agree in order, shapes, strides and padding.
    onnx_layers, zoo = load_model(light("resnet50")), load_model("resnet50")
    key = lambda l: (l.input_shape, l.weight_shape, l.stride, l.padding, l.dilation, l.groups)
    assert [key(l) for l in onnx_layers] == [key(l) for l in zoo]
    assert total_macs(onnx_layers) == total_macs(zoo)


def test_light_inception_v1_matches_googlenet_weights():
    # BVLC GoogLeNet: the paper's 5x5 in the third branch (torchvision has 3x3), and the ONNX export pools
    # with floor rounding (55x55 after the first pool where torchvision's ceil mode gives 56x56).
    onnx_layers, zoo = load_model(light("inception_v1")), load_model("googlenet")
    for o, z in zip(onnx_layers, zoo, strict=True):
        assert o.input_shape[1] == z.input_shape[1] and o.weight_shape[:2] == z.weight_shape[:2], z.name
        if z.name.endswith("branch3.1.conv"):
            assert (o.weight_shape[2:], o.padding, z.weight_shape[2:], z.padding) == ((5, 5), (2, 2), (3, 3), (1, 1))
        else:
            assert (o.weight_shape, o.stride, o.padding) == (z.weight_shape, z.stride, z.padding), z.name
    assert onnx_layers[1].input_shape == (1, 64, 55, 55) and zoo[1].input_shape == (1, 64, 56, 56)


def test_light_vgg19_has_vgg16s_shapes():
    shapes = lambda ls: {(l.input_shape, l.weight_shape, l.padding) for l in ls}
    assert shapes(load_model(light("vgg19"))) == shapes(load_model("vgg16"))


# ---------------------------------------------------------------------------------- ONNX: built graphs

def vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def weight(name, shape):
    return numpy_helper.from_array(np.zeros(shape, dtype=np.float32), name)


def save(tmp_path, nodes, inputs, initializers=(), name="m.onnx", outputs=None, opset=17):
    out = outputs if outputs is not None else [vi(nodes[-1].output[0], None)]
    graph = helper.make_graph(nodes, "g", inputs, out, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def conv(name, x, w, y, op="Conv", **attrs):
    return helper.make_node(op, [x, w], [y], name=name, **attrs)


def inferred_output(path, tensor):
    m = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    for v in [*m.graph.value_info, *m.graph.output]:
        if v.name == tensor:
            return tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
    raise AssertionError(tensor)


def test_onnx_attributes(tmp_path):
    nodes = [
        conv("plain", "x", "w0", "y0"),
        conv("strided", "y0", "w1", "y1", strides=[2, 2], pads=[1, 1, 1, 1]),
        conv("dilated", "y1", "w2", "y2", dilations=[2, 2], pads=[2, 2, 2, 2], kernel_shape=[3, 3]),
        conv("grouped", "y2", "w3", "y3", group=4, pads=[1, 1, 1, 1]),
        conv("rect", "y3", "w4", "y4", pads=[0, 3, 0, 3]),
        conv("", "y4", "w5", "y5", auto_pad="VALID"),  # unnamed: named after its output
    ]
    inits = [weight("w0", (8, 3, 3, 3)), weight("w1", (16, 8, 3, 3)), weight("w2", (16, 16, 3, 3)),
             weight("w3", (32, 4, 3, 3)), weight("w4", (32, 32, 1, 7)), weight("w5", (8, 32, 3, 3))]
    path = save(tmp_path, nodes, [vi("x", ["N", 3, 34, 34])], inits)  # symbolic batch
    layers = load_model(path)
    assert [l.name for l in layers] == ["plain", "strided", "dilated", "grouped", "rect", "y5"]
    plain, strided, dilated, grouped, rect, valid = layers
    assert plain.input_shape == (1, 3, 34, 34) and plain.padding == (0, 0)
    assert strided.input_shape == (1, 8, 32, 32) and strided.stride == (2, 2) and strided.padding == (1, 1)
    assert dilated.dilation == (2, 2) and dilated.input_shape == (1, 16, 16, 16)
    assert grouped.groups == 4 and grouped.weight_shape == (32, 4, 3, 3)
    assert rect.padding == (0, 3) and rect.weight_shape == (32, 32, 1, 7)
    assert valid.padding == (0, 0)
    for layer, tensor in zip(layers, ["y0", "y1", "y2", "y3", "y4", "y5"]):
        assert out_shape(layer)[1:] == inferred_output(path, tensor)[1:]


def test_onnx_fixed_batch_becomes_one_and_1d_3d(tmp_path):
    nodes = [conv("c1", "x", "w", "y", pads=[1, 1])]
    path = save(tmp_path, nodes, [vi("x", [8, 4, 20])], [weight("w", (6, 4, 3))], name="c1.onnx")
    (layer,) = load_model(path)
    assert layer.input_shape == (1, 4, 20) and layer.padding == (1,)
    nodes = [conv("c3", "x", "w", "y", strides=[1, 2, 2])]
    path = save(tmp_path, nodes, [vi("x", [2, 2, 5, 9, 9])], [weight("w", (4, 2, 3, 3, 3))], name="c3.onnx")
    (layer,) = load_model(path)
    assert layer.input_shape == (1, 2, 5, 9, 9) and out_shape(layer) == (1, 4, 3, 4, 4)


def test_onnx_weight_from_graph_input(tmp_path):
    path = save(tmp_path, [conv("c", "x", "w", "y")], [vi("x", [1, 3, 8, 8]), vi("w", [5, 3, 3, 3])])
    (layer,) = load_model(path)
    assert layer.weight_shape == (5, 3, 3, 3)


@pytest.mark.parametrize("auto_pad, size, stride, begin, end", [
    ("SAME_UPPER", 16, 1, 1, 1),  # 3x3 stride 1: one on each side
    ("SAME_LOWER", 15, 1, 1, 1),
    ("SAME_UPPER", 16, 2, 0, 1),  # 3x3 stride 2 on an even size: total 1, SAME_UPPER puts it at the end
    ("SAME_LOWER", 16, 2, 1, 0),  # and SAME_LOWER at the beginning
    ("SAME_UPPER", 15, 2, 1, 1),  # odd size: total 2
    ("VALID", 16, 2, 0, 0),
])
def test_onnx_auto_pad(tmp_path, auto_pad, size, stride, begin, end):
    from onnx.reference import ReferenceEvaluator

    inputs = [vi("x", [1, 4, size, size]), vi("w", [4, 4, 3, 3])]
    path = save(tmp_path, [conv("c", "x", "w", "y", auto_pad=auto_pad, strides=[stride, stride])], inputs)
    # The pads the spec gives auto_pad here, checked apart from wsarena: onnx's reference evaluator computes the
    # same output with them written out (and a different one with begin and end swapped).
    explicit = save(tmp_path, [conv("c", "x", "w", "y", pads=[begin, begin, end, end], strides=[stride, stride])],
                    inputs, name="explicit.onnx")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 4, size, size), dtype=np.float32),
             "w": rng.standard_normal((4, 4, 3, 3), dtype=np.float32)}
    (got,), (want,) = (ReferenceEvaluator(str(p)).run(None, feeds) for p in (path, explicit))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    (layer,) = load_model(path)
    assert layer.padding == (max(begin, end),) * 2  # asymmetric pads are widened: the larger one on both sides
    inferred = inferred_output(path, "y")[2:]
    modelled = out_shape(layer)[2:]
    if begin == end:
        assert modelled == inferred
        assert load_model(path, asymmetric_pads="error") == [layer]
    else:  # widened like onnxruntime's CUDA provider: at most one extra output, sliced off
        assert all(m - i in (0, 1) for m, i in zip(modelled, inferred))
        asymmetric = f"'c' (asymmetric pads (begin [{begin}, {begin}], end [{end}, {end}]))"
        with pytest.raises(ModelError, match=re.escape(asymmetric)):
            load_model(path, asymmetric_pads="error")


def test_onnx_asymmetric_pads(tmp_path):
    nodes = [conv("sym", "x", "w", "y0", pads=[1, 1, 1, 1]), conv("asym", "y0", "w", "y1", pads=[0, 1, 2, 1])]
    path = save(tmp_path, nodes, [vi("x", [1, 4, 10, 10])], [weight("w", (4, 4, 3, 3))])
    sym, asym = load_model(path)
    assert asym.padding == (2, 1) and asym.input_shape == (1, 4, 10, 10)
    with pytest.raises(ModelError, match=r"1 conv node\(s\) cannot be planned: 'asym' \(asymmetric pads "
                                         r"\(begin \[0, 1\], end \[2, 1\]\)\)") as info:
        load_model(path, asymmetric_pads="error")
    assert "skip_unknown" in str(info.value)
    with pytest.warns(UserWarning, match=r"skipped 1 conv node\(s\): 'asym'"):
        assert load_model(path, skip_unknown=True, asymmetric_pads="error") == [sym]
    with pytest.raises(ValueError, match="asymmetric_pads"):
        load_model(path, asymmetric_pads="crop")
    for other in ("resnet50", [ConvLayer("c", (1, 3, 8, 8), (4, 3, 3, 3))]):  # a zoo model, a layer list
        with pytest.raises(ValueError, match="asymmetric_pads must be 'widen' or 'error', not 'crop'"):
            load_model(other, asymmetric_pads="crop")  # was taken silently: a misspelt option went unseen
    # skip_unknown="no" (from a config file) was true, and skipped 'asym' with a warning; checked for any model too
    for source in (path, "resnet50"):
        for given in ("no", "false", 0, None, np.False_):
            with pytest.raises(TypeError, match=rf"^skip_unknown must be True or False, not {re.escape(repr(given))}$"):
                load_model(source, skip_unknown=given, asymmetric_pads="error")
    # load_onnx() took them unchecked, as load_model() did: "no" skipped 'asym' with a warning
    for given in ("no", "false", 0, None, np.False_):
        with pytest.raises(TypeError, match=rf"^skip_unknown must be True or False, not {re.escape(repr(given))}$"):
            load_onnx(path, skip_unknown=given, asymmetric_pads="error")


def test_onnx_unknown_input_shape(tmp_path):
    # "r" is reshaped to a runtime shape: nothing downstream of it has a known shape
    nodes = [
        conv("known", "x", "w", "y0", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["y0", "s"], ["r"], name="reshape"),
        conv("lost1", "r", "w", "y1"),
        conv("lost2", "y1", "w", "y2"),
    ]
    path = save(tmp_path, nodes, [vi("x", [1, 4, 8, 8]), helper.make_tensor_value_info("s", TensorProto.INT64, [4])],
                [weight("w", (4, 4, 3, 3))])
    lost = r"input shape \[1, 4, \?, \?\] unknown: shape inference cannot work out the output of Reshape 'reshape'"
    with pytest.raises(ModelError, match=rf"2 conv node\(s\) cannot be planned: 'lost1' \({lost}\); 'lost2' "
                                         rf"\({lost}\) \(skip them with skip_unknown=True / --skip-unknown\)$") as info:
        load_model(path)
    assert "\n" not in str(info.value)
    with pytest.warns(UserWarning, match=r"skipped 2 conv node\(s\): 'lost1'"):
        layers = load_model(path, skip_unknown=True)
    assert [l.name for l in layers] == ["known"]


def test_onnx_symbolic_spatial_size_is_unknown(tmp_path):
    path = save(tmp_path, [conv("c", "x", "w", "y")], [vi("x", ["N", 3, "H", "W"])], [weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError, match=r"'c' \(input shape \[1, 3, \?, \?\] unknown\)"):
        load_model(path)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(ModelError, match="none of the model's 1 conv node"):
            load_model(path, skip_unknown=True)


def test_onnx_negative_dim_is_unknown(tmp_path):
    # Some writers put -1 for a dynamic dim (helper.make_tensor_value_info("x", FLOAT, [-1, 3, -1, 16])); onnx's
    # inference carries it on as -3, -5, ... It is a dim of unknown size, which input_shapes can fix.
    nodes = [conv("a", "x", "w1", "y"), conv("b", "y", "w2", "z", pads=[1, 1, 1, 1])]
    weights = [weight("w1", (4, 3, 3, 3)), weight("w2", (8, 4, 3, 3))]
    path = save(tmp_path, nodes, [vi("x", [-1, 3, -1, 16])], weights)
    with pytest.raises(ModelError, match=r"'a' \(input shape \[1, 3, \?, 16\] unknown\); 'b' \(input shape "
                                         r"\[1, 4, \?, 14\] unknown\) \(fix the model's input shapes"):
        load_model(path)
    assert [l.input_shape for l in load_model(path, input_shapes=(2, 3, 12, 16))] == [(1, 3, 12, 16), (1, 4, 10, 14)]
    channels = save(tmp_path, nodes, [vi("x", [1, -1, 12, 16])], weights, name="channels.onnx")
    assert [l.input_shape for l in load_model(channels)] == [(1, 3, 12, 16), (1, 4, 10, 14)]  # from the weight
    # a declared 0 is a size, not a dynamic dim: the conv is an empty one, refused as such
    empty = save(tmp_path, [conv("a", "x", "w1", "y", pads=[1, 1, 1, 1])], [vi("x", [1, 3, 0, 16])], weights[:1],
                 name="empty.onnx")
    with pytest.raises(ModelError, match=re.escape("'a' (input shape [1, 3, 0, 16] has a zero dimension")):
        load_model(empty)


def test_onnx_shapes_of_many_dims_are_quoted_cut(tmp_path):
    """A shape of thousands of dims was quoted whole, an error of thousands of characters."""
    w = [weight("w", (4, 3, 3, 3))]
    unknown = save(tmp_path, [conv("c", "x", "w", "y")], [vi("x", ["N", *[None] * 3000])], w)
    with pytest.raises(ModelError, match=re.escape("'c' (input shape [1, ?, ?, ?, ?, ?, ... 2995 more] unknown)")):
        load_model(unknown)
    with pytest.raises(ModelError, match=re.escape("input 'x' has 3001 dims [?, ?, ?, ?, ?, ?, ... 2995 more], not 4")):
        load_model(unknown, input_shapes=(1, 3, 8, 8))
    known = save(tmp_path, [conv("c", "x", "w", "y")], [vi("x", [1, 3, *[7] * 3000])], w, name="known.onnx")
    says = "'c' (input [1, 3, 7, 7, 7, 7, ... 2996 more] and weight [4, 3, 3, 3] are not a 1-, 2- or 3-D convolution)"
    with pytest.raises(ModelError, match=re.escape(says)):
        load_model(known)


@pytest.mark.parametrize("attrs, w_shape, message", [
    ({"strides": [2, 2], "output_padding": [1]}, (4, 6, 3, 3), r"'up': output_padding=\[1\] needs 2 entries"),
    ({"strides": [2, 2], "output_shape": [10]}, (4, 6, 3, 3), r"'up': output_shape=\[10\] needs 2 entries"),
    ({"strides": [2, 2], "output_shape": [6, 10, 10]}, (4, 6, 3, 3), r"'up': output_shape=\[6, 10, 10\] needs 2 en"),
    ({"strides": [2, 2], "group": 3}, (4, 3, 3, 3), r"'up': .*groups=3 .* input channels \(4\)"),
])
def test_onnx_broken_conv_transpose_is_a_model_error_naming_it(tmp_path, attrs, w_shape, message):
    # onnx's own shape inference refuses each of these; a broken node is a ModelError naming it, never a bare
    # ValueError of the geometry nor a layer made from part of an attribute
    nodes = [conv("up", "x", "w", "y", op="ConvTranspose", **attrs)]
    path = save(tmp_path, nodes, [vi("x", [1, 4, 5, 5])], [weight("w", w_shape)])
    with pytest.raises(ModelError, match=message):
        load_model(path)


def test_onnx_input_shapes_beyond_what_onnx_holds_are_a_model_error(tmp_path):
    path = save(tmp_path, [conv("c", "x", "w", "y")], [vi("x", [1, 3, "H", "W"])], [weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError, match=r"the shape of input 'x' must be positive ints below 2\*\*63"):
        load_model(path, input_shapes={"x": (1, 3, 2**63, 8)})
    for binary in (b"\x01\x03\x08\x08", bytearray(b"\x01\x03\x08\x08")):  # was taken as the dims (1, 3, 8, 8)
        for given in (binary, {"x": binary}):
            with pytest.raises(ModelError, match=r"the shape of input 'x' must be positive ints below 2\*\*63, not b"):
                load_model(path, input_shapes=given)


def test_onnx_input_shapes_fix_symbolic_sizes_before_inference(tmp_path):
    nodes = [conv("c1", "x", "w1", "y1", pads=[1, 1, 1, 1]), conv("c2", "y1", "w2", "y2", strides=[2, 2])]
    weights = [weight("w1", (8, 3, 3, 3)), weight("w2", (4, 8, 3, 3))]
    path = save(tmp_path, nodes, [vi("x", ["N", 3, "H", "W"])], weights)
    by_name = load_model(path, input_shapes={"x": (16, 3, 32, 40)})
    only_one = load_model(path, input_shapes=[1, 3, np.int64(32), 40])
    assert [l.input_shape for l in by_name] == [(1, 3, 32, 40), (1, 8, 32, 40)]  # batch 1, as every layer list
    assert [l.input_shape for l in only_one] == [l.input_shape for l in by_name]
    with pytest.raises(ModelError, match=r"no graph input 'image'; the inputs are 'x'"):
        load_model(path, input_shapes={"image": (1, 3, 32, 32)})
    with pytest.raises(ModelError, match=r"input 'x' has 4 dims \[\?, 3, \?, \?\], not 3"):
        load_model(path, input_shapes=(3, 32, 32))
    with pytest.raises(ModelError, match="positive ints"):
        load_model(path, input_shapes={"x": (1, 3, 0, 32)})
    with pytest.raises(ValueError, match="onnx models only"):
        load_model("resnet50", input_shapes=(1, 3, 224, 224))


def test_onnx_one_input_shape_needs_a_model_with_one_input(tmp_path):
    nodes = [conv("a", "x", "w", "ya"), conv("b", "z", "w", "yb")]
    path = save(tmp_path, nodes, [vi("x", [1, 3, "H", "W"]), vi("z", [1, 3, "H", "W"])], [weight("w", (4, 3, 3, 3))],
                outputs=[vi("ya", None), vi("yb", None)])
    with pytest.raises(ModelError, match=r"model has 2 inputs \('x', 'z'\); name each"):
        load_model(path, input_shapes=(1, 3, 16, 16))
    layers = load_model(path, input_shapes={"x": (1, 3, 16, 16), "z": (1, 3, 9, 9)})
    assert [l.input_shape for l in layers] == [(1, 3, 16, 16), (1, 3, 9, 9)]
    # five inputs are all named; a sixth is counted
    for n, listed in ((5, "'x0', 'x1', 'x2', 'x3', 'x4'"), (6, "'x0', 'x1', 'x2', 'x3', 'x4', and 1 more")):
        nodes = [conv(f"c{i}", f"x{i}", "w", f"y{i}") for i in range(n)]
        path = save(tmp_path, nodes, [vi(f"x{i}", [1, 3, "H", "W"]) for i in range(n)], [weight("w", (4, 3, 3, 3))],
                    outputs=[vi(f"y{i}", None) for i in range(n)], name=f"{n}.onnx")
        with pytest.raises(ModelError, match=re.escape(f"model has {n} inputs ({listed}); name each")):
            load_model(path, input_shapes=(1, 3, 16, 16))
        with pytest.raises(ModelError, match=re.escape(f"no graph input 'z'; the inputs are {listed}")):
            load_model(path, input_shapes={"z": (1, 3, 16, 16)})


def test_onnx_external_data_gives_the_shapes_inference_reads(tmp_path):
    # A model saved with every tensor in an external file (size_threshold=0): the weights' dims are in the model,
    # but the Reshape's target shape is data, which onnx.load reads and inference needs.
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]), conv("c", "image", "w", "y", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 3 * 16 * 12])], [vi("y", None)],
                              [weight("w", (8, 3, 3, 3)), numpy_helper.from_array(np.array([1, 3, 16, 12]), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "external.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="external.data", size_threshold=0)
    (layer,) = load_model(path)
    assert layer.input_shape == (1, 3, 16, 12) and layer.weight_shape == (8, 3, 3, 3)
    assert inferred_output(path, "image") == (1, 3, 16, 12)  # onnx.load reads the external data too
    (tmp_path / "external.data").unlink()  # without the data, the weights' dims are still known, the shape is not
    with pytest.raises(ModelError, match=r"'c' \(input shape \? unknown: shape inference cannot work out the output "
                                         r"of Reshape 'image'\)"):
        load_model(path)


def external_tensor(name, dims, location, **fields):
    """An INT64 tensor of ``dims`` whose data is in ``location`` (``offset``, ``length``: further fields)."""
    tensor = TensorProto(name=name, data_type=TensorProto.INT64, dims=dims, data_location=TensorProto.EXTERNAL)
    for key, value in {"location": location, **fields}.items():
        tensor.external_data.add(key=key, value=str(value))
    return tensor


@pytest.mark.parametrize(("dims", "location", "fields", "read"), [
    ([4], "data.bin", {}, 32),  # no length: the tensor's 32 bytes, not the whole file
    ([4], "data.bin", {"offset": 0, "length": 32}, 32),
    ([4], "data.bin", {"offset": 0, "length": 1 << 20}, None),  # a length that is not the tensor's
    ([4], "data.bin", {"offset": 8}, 32),
    ([4], "data.bin", {"offset": (1 << 20) + 1}, None),  # fewer bytes than the tensor's from there
    ([4], "data.bin", {"offset": -8}, None),
    ([4], "data.bin", {"offset": "eight"}, None),
    ([4], "ABSOLUTE", {}, None),  # an absolute location, even inside the folder (onnx refuses it)
    ([-1], "data.bin", {}, None),  # a negative dim: no size to read
    ([0], "data.bin", {}, 0),  # nothing to read: the file is not opened
    ([], "data.bin", {}, 8),  # a scalar
    ([4], "../outside.bin", {}, None),  # outside the model's folder
    ([4], "inner/../data.bin", {}, 32),  # inside it, once written plainly (onnx reads it)
    ([4], "a..b.bin", {}, None),  # ".." in a name: onnx refuses it too
    ([4], "link.bin", {}, None),  # a link out of it (which onnx before 1.17 follows)
    ([4], "inner.bin", {}, None),  # a link to a file inside it: onnx refuses it too
    ([4], "hard.bin", {}, None),  # a hard link (to a file inside it here): onnx refuses it too
    ([4], "inner/data.bin", {}, 32),  # in a folder inside it
    ([4], "folder-link/data.bin", {}, None),  # through a link to that folder: onnx refuses it too
    ([4], "fifo.bin", {}, None),  # not a file: reading it would wait for a writer
])
@pytest.mark.parametrize("beneath", [True, False], ids=["beneath", "onnx-loader"])
def test_onnx_external_data_read_is_the_tensors_bytes_in_the_models_folder(tmp_path, monkeypatch, dims, location,
                                                                           fields, read, beneath):
    # The small external tensors read for shape inference: a field that does not fit the tensor, a file outside
    # the model's folder or one that is not a regular file is not read; each read takes the tensor's bytes only.
    # What onnx's own loader refuses (a link even inside the folder, a hard link) is refused, where a file is opened
    # beneath its folder through no link and where (as on Windows) onnx's loader reads it
    from wsarena.models import _onnx

    monkeypatch.setattr(_onnx, "OPENS_BENEATH", beneath)
    folder = tmp_path / "model"
    folder.mkdir()
    data = np.array([1, 3, 16, 12], np.int64).tobytes() + bytes(1 << 20)
    (folder / "data.bin").write_bytes(data)
    (folder / "a..b.bin").write_bytes(data)
    (folder / "inner").mkdir()
    (folder / "inner" / "data.bin").write_bytes(data)
    (folder / "folder-link").symlink_to(folder / "inner")
    (folder / "inner.bin").symlink_to(folder / "inner" / "data.bin")
    (tmp_path / "outside.bin").write_bytes(data)
    (folder / "link.bin").symlink_to(tmp_path / "outside.bin")
    (folder / "twice.bin").write_bytes(data)
    os.link(folder / "twice.bin", folder / "hard.bin")
    os.mkfifo(folder / "fifo.bin")
    location = str(folder / "data.bin") if location == "ABSOLUTE" else location
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]), conv("c", "image", "w", "y", pads=[1, 1, 1, 1])]
    extra = external_tensor("extra", dims, location, **fields)  # read or not, it takes no part in the shapes
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 3 * 16 * 12])], [vi("y", None)],
                              [weight("w", (8, 3, 3, 3)), external_tensor("shape", [4], "data.bin"), extra])
    path = folder / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    seen = []
    infer = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda model, **kw: seen.append(model) or infer(model,
                                                                                                            **kw))
    (layer,) = load_model(path)
    assert layer.input_shape == (1, 3, 16, 12)
    tensors = {t.name: t for t in seen[0].graph.initializer}
    for name, nbytes in (("shape", 32), ("extra", read)):
        tensor = tensors[name]
        if nbytes is None:
            assert tensor.data_location == TensorProto.EXTERNAL and not tensor.raw_data
        else:  # as onnx.load leaves it (onnx before 1.17 leaves that to its caller): in the model, not external
            assert len(tensor.raw_data) == nbytes
            assert tensor.data_location == TensorProto.DEFAULT and not tensor.external_data


def test_onnx_external_data_of_each_small_type_is_read_as_its_elements_bytes(tmp_path, monkeypatch):
    """A small external tensor of each element type a shape or a scale comes in is read as its elements take
    (NumPy's item size of the type as onnx maps it: 2 bytes for a bfloat16), not a byte more or less."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "data.bin").write_bytes(np.array([1, 3, 16, 12], np.int64).tobytes() + bytes(64))
    types = ["BOOL", "INT8", "UINT8", "INT16", "UINT16", "FLOAT16", "BFLOAT16", "INT32", "UINT32", "FLOAT", "INT64",
             "UINT64", "DOUBLE"]
    extras = []
    for name in types:
        extra = external_tensor(name, [3], "data.bin")
        extra.data_type = getattr(TensorProto, name)
        extras.append(extra)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]), conv("c", "image", "w", "y", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 3 * 16 * 12])], [vi("y", None)],
                              [weight("w", (8, 3, 3, 3)), external_tensor("shape", [4], "data.bin"), *extras])
    path = folder / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    seen = []
    infer = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda model, **kw: seen.append(model) or infer(model,
                                                                                                            **kw))
    (layer,) = load_model(path)
    assert layer.input_shape == (1, 3, 16, 12)
    tensors = {t.name: t for t in seen[0].graph.initializer}
    for name in types:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(getattr(TensorProto, name))).itemsize
        assert len(tensors[name].raw_data) == 3 * itemsize, name
        assert tensors[name].data_location == TensorProto.DEFAULT, name


@pytest.mark.timeout(60)
def test_onnx_external_data_that_became_a_fifo_is_not_waited_on(tmp_path, monkeypatch):
    """The external data file was looked at (isfile()), then opened by onnx as open() opens a file: a FIFO put in
    its place meanwhile was waited on until a writer came, for good where none came. It is opened without blocking
    and refused as what it is. The race is played out: the looks (os.stat, which isfile() asks, and onnx's own, whose
    open, openat2 without O_NONBLOCK in onnx 1.23, follows it) are made to see a regular file where the FIFO is; a
    load still blocked after 20 s is let go and fails."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "data.bin").write_bytes(np.array([1, 3, 16, 12], np.int64).tobytes())
    fifo = folder / "fifo.bin"
    os.mkfifo(fifo)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]), conv("c", "image", "w", "y", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 3 * 16 * 12])], [vi("y", None)],
                              [weight("w", (8, 3, 3, 3)), external_tensor("shape", [4], "fifo.bin")])
    path = folder / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    real_stat, regular = os.stat, os.stat(folder / "data.bin")
    # the FIFO by its path (isfile()'s look), or by its name in its folder's descriptor (read_regular_part's)
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: regular if os.fspath(p) in (str(fifo), fifo.name) else
                        real_stat(p, *a, **k))
    assert os.path.isfile(fifo)  # as the look sees it
    from onnx import external_data_helper

    # onnx's look (a stat in C++) then its open: the open as it is, of what is there by then
    monkeypatch.setattr(external_data_helper, "_open_external_data_fd",
                        lambda base_dir, location, *_: os.open(os.path.join(base_dir, location), os.O_RDONLY),
                        raising=False)
    with pytest.raises(ModelError, match=r"'c' \(input shape \? unknown: shape inference cannot work out the output "
                                         r"of Reshape 'image'\)"):
        unblocked(lambda: load_model(path), fifo)


def sparse_model(tmp_path, sparse, where, nodes, inputs, initializers=()):
    """A model of ``nodes`` whose tensor ``sparse.values.name`` is the sparse tensor ``sparse``: a sparse initializer
    (``graph.sparse_initializer``), or a Constant node's ``sparse_value``."""
    name = sparse.values.name
    if where == "Constant":
        nodes = [helper.make_node("Constant", [], [name], sparse_value=sparse), *nodes]
    graph = helper.make_graph(nodes, "g", inputs, [vi(nodes[-1].output[0], None)], list(initializers),
                              sparse_initializer=[sparse] if where == "initializer" else [])
    path = tmp_path / f"sparse_{where}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("where", ["initializer", "Constant"])
def test_onnx_sparse_weight(tmp_path, where):
    # A pruned weight stored as a sparse tensor: its dims are the weight's shape, for the conv and, through
    # inference, for the one after it.
    values = numpy_helper.from_array(np.ones(2, np.float32), "w1")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0, 5]), ""), [8, 3, 3, 3])
    nodes = [conv("a", "x", "w1", "y", strides=[2, 2]), conv("b", "y", "w2", "z", pads=[1, 1, 1, 1])]
    a, b = load_model(sparse_model(tmp_path, sparse, where, nodes, [vi("x", [1, 3, 17, 17])],
                                   [weight("w2", (4, 8, 3, 3))]))
    assert (a.input_shape, a.weight_shape, b.input_shape) == ((1, 3, 17, 17), (8, 3, 3, 3), (1, 8, 8, 8))


@pytest.mark.parametrize("where", ["initializer", "Constant"])
@pytest.mark.parametrize("indices", [[2, 3, 6, 7], [[0, 2], [0, 3], [1, 2], [1, 3]]])  # linear, or coordinates
def test_onnx_sparse_values_inference_reads(tmp_path, where, indices):
    # A small sparse tensor is made dense with its values, which shape inference reads (a Pad's pads); a weight's
    # sparse tensor is made dense without them, as only its dims count.
    values = numpy_helper.from_array(np.array([1, 2, 3, 4]), "pads")
    shape = [8] if np.ndim(indices) == 1 else [2, 4]
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array(indices), ""), shape)
    nodes = [helper.make_node("Reshape", ["pads", "flat"], ["pads8"]),
             helper.make_node("Pad", ["x", "pads8"], ["p"], mode="reflect"), conv("c", "p", "w", "y")]
    path = sparse_model(tmp_path, sparse, where, nodes, [vi("x", [1, 3, 10, 10])],
                        [weight("w", (4, 3, 3, 3)), numpy_helper.from_array(np.array([8]), "flat")])
    (layer,) = load_model(path)
    assert layer.input_shape == (1, 3, 10 + 1 + 3, 10 + 2 + 4)  # pads [0, 0, 1, 2, 0, 0, 3, 4]


def test_onnx_without_conv(tmp_path):
    path = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [vi("x", [1, 3, 8, 8])])
    with pytest.raises(ModelError, match="has no Conv or ConvTranspose node"):
        load_model(path)


def test_onnx_impossible_geometry(tmp_path):
    path = save(tmp_path, [conv("huge", "x", "w", "y")], [vi("x", [1, 3, 4, 4])], [weight("w", (4, 3, 7, 7))])
    with pytest.raises(ModelError, match=r"layer 'huge': kernel .* larger than the padded input"):
        load_model(path)


@pytest.mark.parametrize("mode", ["widen", "error"])
def test_onnx_asymmetric_pads_that_leave_no_output_are_refused_as_symmetric_ones_are(tmp_path, mode):
    """Only the widened pad (a Conv's) or the smaller one (a ConvTranspose's) was compared with the kernel: a conv
    whose ONNX output is empty became a 1x1 layer under asymmetric_pads="widen", and under "error" it was refused for
    its pads, suggesting "widen". What the pads as written leave is what counts, in either mode."""
    def model(name, op, x_shape, w_shape, pads):
        nodes = [conv("c", "x", "w", "y", op=op, pads=pads)]
        return save(tmp_path, nodes, [vi("x", x_shape)], [weight("w", w_shape)], name=name)

    convs = {pads: model(f"conv{pads[0]}{pads[2]}.onnx", "Conv", [1, 3, 1, 1], (4, 3, 3, 3), list(pads))
             for pads in ((0, 0, 1, 1), (0, 0, 2, 2))}
    ups = {pads: model(f"up{pads[0]}{pads[2]}.onnx", "ConvTranspose", [1, 6, 1, 1], (6, 4, 3, 3), list(pads))
           for pads in ((1, 1, 2, 2), (0, 0, 2, 2))}
    # onnx's inference: a 1x1 input and a 3x3 kernel leave no output position under the first pads, one under the second
    for empty, one in (convs.values(), ups.values()):
        assert (inferred_output(empty, "y"), inferred_output(one, "y")) == ((1, 4, 0, 0), (1, 4, 1, 1))
    # a Conv: as under symmetric pads (test_onnx_impossible_geometry), the layer's error, which skip_unknown keeps
    for skip in (False, True):
        with pytest.raises(ModelError, match=re.escape("layer 'c': kernel (3, 3) (dilation (1, 1)) is larger than the "
                                                       "padded input (2, 2) in dimension 0")):
            load_model(convs[0, 0, 1, 1], asymmetric_pads=mode, skip_unknown=skip)
    # a ConvTranspose: as under symmetric pads, a node that cannot be planned, which skip_unknown leaves out
    with pytest.raises(ModelError, match=re.escape("1 conv node(s) cannot be planned: 'c' (padding [1, 1]/[2, 2] "
                                                   "leaves no output) (skip them with skip_unknown=True")):
        load_model(ups[1, 1, 2, 2], asymmetric_pads=mode)
    # one output position left is a layer (widened, the extra sliced off) or, under "error", asymmetric pads
    if mode == "widen":
        assert [(l.input_shape, l.padding) for l in load_model(convs[0, 0, 2, 2])] == [((1, 3, 1, 1), (2, 2))]
        assert [(l.input_shape, l.padding) for l in load_model(ups[0, 0, 2, 2])] == [((1, 4, 3, 3), (0, 0))]
    else:
        for path in (convs[0, 0, 2, 2], ups[0, 0, 2, 2]):
            with pytest.raises(ModelError, match=re.escape("'c' (asymmetric pads (begin [0, 0], end [2, 2]))")):
                load_model(path, asymmetric_pads=mode)


def test_onnx_a_conv_whose_output_is_impossible_is_named_not_the_next_one(tmp_path):
    """A conv on an empty input ([1, 3, 0, 16]) with a 3x3 kernel and no pads has an output of negative size, which
    onnx's inference carries on: the next conv's input got a negative dim, and the error named that conv. The first
    one is a broken node, as one of a kernel past a non-empty input is, not an empty conv that skip_unknown leaves
    out."""
    nodes = [conv("a", "x", "w1", "y"), conv("b", "y", "w2", "z")]
    path = save(tmp_path, nodes, [vi("x", [1, 3, 0, 16])], [weight("w1", (4, 3, 3, 3)), weight("w2", (8, 4, 3, 3))])
    assert inferred_output(path, "y") == (1, 4, -2, 14)
    for skip in (False, True):
        with pytest.raises(ModelError, match=re.escape("layer 'a': kernel (3, 3) (dilation (1, 1)) is larger than the "
                                                       "padded input (0, 16) in dimension 0")):
            load_model(path, skip_unknown=skip)
    # padded, the outputs are empty, not impossible: empty convs
    nodes = [conv("a", "x", "w1", "y", pads=[1, 1, 1, 1]), conv("b", "y", "w2", "z", pads=[1, 1, 1, 1])]
    padded = save(tmp_path, nodes, [vi("x", [1, 3, 0, 16])], [weight("w1", (4, 3, 3, 3)), weight("w2", (8, 4, 3, 3))],
                  name="padded.onnx")
    with pytest.raises(ModelError, match=re.escape("2 conv node(s) cannot be planned: 'a' (input shape [1, 3, 0, 16] "
                                                   "has a zero dimension, which wsarena's ops refuse); 'b' (input "
                                                   "shape [1, 4, 0, 16] has a zero dimension")):
        load_model(padded)


def test_onnx_a_conv_fed_a_negative_size_cannot_be_planned_and_names_where_it_came_from(tmp_path):
    """A ConvTranspose whose pads crop more than its output, or a pool whose kernel is past its input, has an output
    of negative size, which onnx's inference carries on: the next conv was refused alone, for its input_shape, under
    skip_unknown too, where the ConvTranspose is left out. Its input cannot be planned, and the node that gave the
    negative size is named, through the nodes between."""
    nodes = [conv("up", "x", "wt", "y", op="ConvTranspose", pads=[2, 2, 2, 2]), conv("b", "y", "w", "z", pads=[1] * 4),
             conv("ok", "x", "wt", "y2", op="ConvTranspose", pads=[1] * 4)]
    path = save(tmp_path, nodes, [vi("x", [1, 6, 1, 1])], [weight("wt", (6, 4, 3, 3)), weight("w", (8, 4, 3, 3))],
                outputs=[vi("z", None), vi("y2", None)])
    assert inferred_output(path, "y") == (1, 4, -1, -1)
    why = {"up": "padding [2, 2]/[2, 2] leaves no output",
           "b": "input shape [1, 4, -1, -1] impossible: shape inference gives the output of ConvTranspose 'up' a "
                "negative size"}
    listed = "; ".join(f"'{name}' ({reason})" for name, reason in why.items())
    with pytest.raises(ModelError, match=re.escape(f"2 conv node(s) cannot be planned: {listed} (skip them with")):
        load_model(path)
    with pytest.warns(UserWarning, match=re.escape(f"skipped 2 conv node(s): {listed}")):
        layers = load_model(path, skip_unknown=True)
    assert [l.name for l in layers] == ["ok"] and layers.skipped == tuple(why.items())
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[4, 4]), helper.make_node("Relu", ["p"], ["r"]),
             conv("b", "r", "w", "z", pads=[1] * 4)]
    pooled = save(tmp_path, nodes, [vi("x", [1, 4, 2, 8])], [weight("w", (8, 4, 3, 3))], name="pooled.onnx")
    assert inferred_output(pooled, "r") == (1, 4, -1, 5)
    with pytest.raises(ModelError, match=re.escape("'b' (input shape [1, 4, -1, 5] impossible: shape inference gives "
                                                   "the output of MaxPool 'p' a negative size)")):
        load_model(pooled)


@pytest.mark.usefixtures("fresh_arena")  # from conftest: a host arena of the test's own
def test_onnx_empty_convs_are_unsupported_as_the_ops_refuse_them(tmp_path):
    # ONNX allows a conv of no output channels (an empty tensor, and an empty input for the conv after it); wsarena's
    # ops and PyTorch's refuse a zero in a weight's or input's dims (the batch aside), so these cannot be planned.
    nodes = [conv("ok", "x", "w1", "y1", pads=[1, 1, 1, 1]), conv("empty", "y1", "w0", "y0", pads=[1, 1, 1, 1]),
             conv("after", "y0", "w2", "y2"), conv("up", "y1", "wt", "y3", op="ConvTranspose", strides=[2, 2])]
    inits = [weight("w1", (4, 3, 3, 3)), weight("w0", (0, 4, 3, 3)), weight("w2", (5, 0, 3, 3)),
             weight("wt", (4, 0, 2, 2))]
    path = save(tmp_path, nodes, [vi("x", [1, 3, 8, 8])], inits, outputs=[vi("y2", None), vi("y3", None)])
    for w_shape in [(0, 4, 3, 3), (4, 0, 3, 3), (4, 4, 0, 3)]:
        with pytest.raises(ValueError, match="has a zero dimension"):
            wsarena.conv_forward(np.zeros((1, 4, 8, 8), np.float32), np.zeros(w_shape, np.float32), padding=1)
    with pytest.raises(ValueError, match="needs at least one channel"):
        wsarena.conv_forward(np.zeros((1, 0, 8, 8), np.float32), np.zeros((5, 0, 3, 3), np.float32))
    why = {"empty": "weight shape [0, 4, 3, 3] has a zero dimension, which wsarena's ops refuse",
           "after": "input shape [1, 0, 8, 8] has a zero dimension, which wsarena's ops refuse",
           "up": "weight shape [4, 0, 2, 2] has a zero dimension, which wsarena's ops refuse"}
    listed = "; ".join(f"'{name}' ({reason})" for name, reason in why.items())
    with pytest.raises(ModelError, match=re.escape(f"3 conv node(s) cannot be planned: {listed} (skip them with "
                                                   "skip_unknown=True / --skip-unknown)")):
        load_model(path)
    with pytest.warns(UserWarning, match=re.escape(f"skipped 3 conv node(s): {listed}")):
        layers = load_model(path, skip_unknown=True)
    assert [l.name for l in layers] == ["ok"] and layers.skipped == tuple(why.items())


@pytest.mark.parametrize("attrs, message", [
    ({"pads": [1, 1]}, r"'broken': pads=\[1, 1\] must have 4 entries"),
    ({"kernel_shape": [5, 5]}, r"'broken': kernel_shape=\[5, 5\] does not match weight shape"),
    ({"auto_pad": "SAME"}, r"'broken': unknown auto_pad 'SAME'"),
    ({"strides": [2]}, r"'broken': strides=\[2\] and dilations=\[1, 1\] need 2 entries"),
])
def test_onnx_broken_node(tmp_path, attrs, message):
    path = save(tmp_path, [conv("broken", "x", "w", "y", **attrs)], [vi("x", [1, 3, 8, 8])],
                [weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError, match=message):
        load_model(path)


def test_onnx_convs_in_subgraphs_are_left_out_with_a_warning(tmp_path):
    branch = helper.make_graph([conv("inner", "x", "w", "yi")], "then", [], [vi("yi", None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["yo"])], "else", [], [vi("yo", None)])
    nodes = [conv("outer", "x", "w", "y0"),
             helper.make_node("If", ["cond"], ["z"], name="if", then_branch=branch, else_branch=other)]
    path = save(tmp_path, nodes, [vi("x", [1, 3, 8, 8]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                [weight("w", (3, 3, 3, 3))], outputs=[vi("y0", None), vi("z", None)])
    with pytest.warns(UserWarning, match=r"1 conv node\(s\) inside subgraphs"):
        layers = load_model(path)
    assert [l.name for l in layers] == ["outer"]


def test_onnx_quantized_convs_are_said_to_be_left_out(tmp_path):
    """QLinearConv and ConvInteger (integer operands) are no floating-point convolution: a model that has only those
    is refused saying so, and one beside float convs warns that they are not in the figures."""
    quantized = helper.make_node("ConvInteger", ["xq", "wq"], ["yq"], name="q")
    inputs = [vi("x", [1, 3, 8, 8]), helper.make_tensor_value_info("xq", TensorProto.UINT8, [1, 3, 8, 8]),
              helper.make_tensor_value_info("wq", TensorProto.UINT8, [4, 3, 3, 3])]
    only = save(tmp_path, [quantized], inputs[1:], outputs=[vi("yq", None)], name="only.onnx")
    with pytest.raises(ModelError, match=r"no Conv or ConvTranspose node in its main graph \(its 1 QLinearConv or "
                                         r"ConvInteger node\(s\) are quantized convolutions, which wsarena does not "
                                         r"plan\)"):
        load_model(only)
    mixed = save(tmp_path, [conv("c", "x", "w", "y"), quantized], inputs, [weight("w", (4, 3, 3, 3))],
                 outputs=[vi("y", None), vi("yq", None)], name="mixed.onnx")
    with pytest.warns(UserWarning, match=r"its 1 QLinearConv or ConvInteger node\(s\) are quantized convolutions"):
        layers = load_model(mixed)
    assert [layer.name for layer in layers] == ["c"]


def test_onnx_convs_of_an_element_type_no_conv_takes_cannot_be_planned(tmp_path):
    """ONNX's Conv and ConvTranspose take float16, float and double operands (bfloat16 too from opset 22, below);
    onnxruntime refuses to load a model whose conv has an integer, boolean or string input or weight, and cuDNN has
    no such convolution. The loader planned them as float convolutions. Floats of any width, and a weight
    dequantized first (a QDQ model's), are planned, and so is a conv whose input a value_info says is an integer."""
    def typed(name, shape, elem_type):
        return helper.make_tensor(name, elem_type, shape, np.zeros(shape).astype(
            helper.tensor_dtype_to_np_dtype(elem_type)).reshape(-1).tolist(), raw=False)

    ints_x = helper.make_tensor_value_info("xi", TensorProto.INT64, [1, 3, 8, 8])
    nodes = [conv("float", "x", "w", "y0", pads=[1, 1, 1, 1]), conv("int_weight", "x", "wi", "y1"),
             conv("bool_weight", "x", "wb", "y2"), conv("int_input", "xi", "w", "y3"),
             conv("double", "xd", "wd", "y4"), conv("up", "x", "wu", "y5", op="ConvTranspose"),
             helper.make_node("DequantizeLinear", ["wq", "scale"], ["wdq"]), conv("dequantized", "x", "wdq", "y6")]
    inits = [weight("w", (4, 3, 3, 3)), typed("wi", (4, 3, 3, 3), TensorProto.INT64),
             typed("wb", (4, 3, 3, 3), TensorProto.BOOL), typed("wd", (4, 3, 3, 3), TensorProto.DOUBLE),
             typed("wu", (3, 4, 2, 2), TensorProto.INT32), typed("wq", (4, 3, 3, 3), TensorProto.INT8),
             numpy_helper.from_array(np.array(0.5, np.float32), "scale")]
    inputs = [vi("x", [1, 3, 8, 8]), ints_x, helper.make_tensor_value_info("xd", TensorProto.DOUBLE, [1, 3, 8, 8])]
    # a value_info is an annotation, a writer's mistake at worst: its type is not the tensor's
    nodes += [helper.make_node("Relu", ["x"], ["r"]), conv("annotated", "r", "w", "y7")]
    # the bias is of the same type T: an integer one was not looked at
    nodes.append(helper.make_node("Conv", ["x", "w", "bi"], ["y8"], name="int_bias"))
    inits.append(typed("bi", (4,), TensorProto.INT64))
    path = save(tmp_path, nodes, inputs, inits, outputs=[vi(f"y{i}", None) for i in range(9)])
    model = onnx.load(str(path))
    model.graph.value_info.append(helper.make_tensor_value_info("r", TensorProto.INT64, [1, 3, 8, 8]))
    onnx.save(model, str(path))
    why = {"int_weight": "weight 'wi' is int64", "bool_weight": "weight 'wb' is bool",
           "int_input": "input 'xi' is int64", "up": "weight 'wu' is int32", "int_bias": "bias 'bi' is int64"}
    listed = "; ".join(f"'{name}' ({reason}: a {'ConvTranspose' if name == 'up' else 'Conv'} of opset 17 takes "
                       "float16, float or double)" for name, reason in why.items())
    with pytest.raises(ModelError, match=re.escape(f"5 conv node(s) cannot be planned: {listed} (skip them")):
        load_model(path)
    with pytest.warns(UserWarning, match=re.escape(f"skipped 5 conv node(s): {listed}")):
        layers = load_model(path, skip_unknown=True)
    assert [layer.name for layer in layers] == ["float", "double", "dequantized", "annotated"]
    assert [layer.weight_shape for layer in layers] == [(4, 3, 3, 3)] * 4


def test_onnx_convs_fed_a_computed_tensor_of_an_element_type_no_conv_takes_cannot_be_planned(tmp_path):
    """A conv whose input or weight a node computes as an integer (a Constant's, a Cast's, a QuantizeLinear's with no
    DequantizeLinear after it) was planned as a float convolution, as one on an integer initializer was: the types
    checked were the graph inputs' and the initializers' alone. A node's output has the type inference gives it from
    those, whatever a value_info says (an annotation: a Relu of a float is a float, a Cast to int32 an int32)."""
    big = np.zeros((64, 3, 3, 3), np.int64)  # more than the constants folded into initializers
    nodes = [helper.make_node("Constant", [], ["wc"], value=numpy_helper.from_array(big, "v")),
             conv("constant", "x", "wc", "y0"),
             helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32), conv("cast", "xi", "w", "y1"),
             helper.make_node("QuantizeLinear", ["x", "scale"], ["xq"]), conv("quantized", "xq", "w", "y2"),
             helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16), conv("half", "xh", "wh", "y3"),
             helper.make_node("Relu", ["x"], ["r"]), conv("annotated", "r", "w", "y4")]
    inits = [weight("w", (64, 3, 3, 3)), numpy_helper.from_array(np.zeros((64, 3, 3, 3), np.float16), "wh"),
             numpy_helper.from_array(np.array(0.5, np.float32), "scale")]
    outputs = [vi(f"y{i}", None) for i in range(5)]
    path = save(tmp_path, nodes, [vi("x", [1, 3, 8, 8])], inits, outputs=outputs, opset=19)
    model = onnx.load(str(path))
    model.graph.value_info.extend([helper.make_tensor_value_info("xi", TensorProto.FLOAT, [1, 3, 8, 8]),
                                   helper.make_tensor_value_info("r", TensorProto.INT64, [1, 3, 8, 8])])
    onnx.save(model, str(path))
    why = {"constant": "weight 'wc' is int64", "cast": "input 'xi' is int32", "quantized": "input 'xq' is uint8"}
    listed = "; ".join(f"'{name}' ({reason}: a Conv of opset 19 takes float16, float or double)"
                       for name, reason in why.items())
    with pytest.raises(ModelError, match=re.escape(f"3 conv node(s) cannot be planned: {listed} (skip them")):
        load_model(path)
    with pytest.warns(UserWarning, match=re.escape(f"skipped 3 conv node(s): {listed}")):
        layers = load_model(path, skip_unknown=True)
    assert [layer.name for layer in layers] == ["half", "annotated"]


def test_onnx_a_conv_fed_a_node_of_an_initializer_has_that_initializers_type(tmp_path):
    """A weight passed through a node (an ``Identity``, a ``Transpose``) has the type of the initializer it comes
    from, whether or not the graph lists that initializer among its inputs too (older exporters list every weight):
    a float16 one beside a float input is two types, which one conv cannot take."""
    half = numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float16), "wh")  # 108 elements: not folded
    nodes = [helper.make_node("Identity", ["wh"], ["wi"]), conv("mixed", "x", "wi", "y")]
    why = "input 'x' is float and weight 'wi' is float16: a Conv's input, weight and bias are of one type"
    for listed, inputs in (("bare", [vi("x", [1, 3, 8, 8])]),
                           ("listed", [vi("x", [1, 3, 8, 8]),
                                       helper.make_tensor_value_info("wh", TensorProto.FLOAT16, [4, 3, 3, 3])])):
        path = save(tmp_path, nodes, inputs, [half], name=f"{listed}.onnx")
        with pytest.raises(ModelError, match=re.escape(f"1 conv node(s) cannot be planned: 'mixed' ({why})")):
            load_model(path)


def test_onnx_an_unknown_weight_shape_is_named_with_where_it_was_lost(tmp_path):
    """A conv whose weight shape stays unknown is named, as one whose input shape is: a symbolic graph input's dims,
    or the node whose output inference cannot work out (a Reshape to a runtime shape). Going back through a node of
    several unknown inputs, the first is followed."""
    def shape_input(name):
        return helper.make_tensor_value_info(name, TensorProto.INT64, [4])

    nodes = [conv("from_input", "x", "wk", "y0"),
             helper.make_node("Reshape", ["wf", "s1"], ["wr"], name="rw"), conv("reshaped", "x", "wr", "y1"),
             helper.make_node("Reshape", ["x", "s1"], ["r1"], name="first"),
             helper.make_node("Reshape", ["x", "s2"], ["r2"], name="second"),
             helper.make_node("Add", ["r1", "r2"], ["sum"]), conv("added", "sum", "w", "y2")]
    inputs = [vi("x", [1, 3, 8, 8]), vi("wk", [4, 3, "K", "K"]), shape_input("s1"), shape_input("s2")]
    path = save(tmp_path, nodes, inputs, [weight("wf", (108,)), weight("w", (4, 3, 3, 3))],
                outputs=[vi(f"y{i}", None) for i in range(3)])
    says = ("3 conv node(s) cannot be planned: 'from_input' (weight shape [4, 3, ?, ?] unknown); 'reshaped' (weight "
            "shape [?, ?, ?, ?] unknown: shape inference cannot work out the output of Reshape 'rw'); 'added' (input "
            "shape [1, 3, ?, ?] unknown: shape inference cannot work out the output of Reshape 'first') (fix the "
            "model's input shapes")
    with pytest.raises(ModelError, match=re.escape(says)):
        load_model(path)
    # a conv of no weight input (a damaged file), which inference leaves as it is, has a weight shape unknown too
    nodes = [helper.make_node("Conv", ["x"], ["y0"], name="lone"), conv("c", "x", "w", "y1")]
    path = save(tmp_path, nodes, [vi("x", [1, 3, 8, 8])], [weight("w", (4, 3, 3, 3))],
                outputs=[vi("y0", None), vi("y1", None)], name="lone.onnx")
    with pytest.warns(UserWarning, match=re.escape("skipped 1 conv node(s): 'lone' (weight shape ? unknown)")):
        assert [layer.name for layer in load_model(path, skip_unknown=True)] == ["c"]


def test_onnx_a_model_of_an_opset_below_1_is_checked_against_the_newest_types(tmp_path):
    """An opset below 1, which onnx has none of, is checked as a model naming no opset is: against the newest
    schema's types, and said without the opset."""
    from onnx import defs

    newest = defs.get_schema("Conv").type_constraints[0].allowed_type_strs
    takes = sorted(text[len("tensor("):-1] for text in newest)
    for opset in (0, -1):
        ints_w = helper.make_tensor("w", TensorProto.INT64, (4, 3, 3, 3), [0] * 108)
        path = save(tmp_path, [conv("c", "x", "w", "y")], [vi("x", [1, 3, 8, 8])], [ints_w], opset=opset)
        with pytest.raises(ModelError, match=re.escape("'c' (weight 'w' is int64: a Conv takes ")) as caught:
            load_model(path)
        said = str(caught.value).split("a Conv takes ")[1].split(")")[0]
        assert sorted(said.replace(" or ", ", ").split(", ")) == takes


# Operand types of one conv: (input, weight, bias or None), all floats
_TYPED_CONVS = {
    "bfloat16": (TensorProto.BFLOAT16, TensorProto.BFLOAT16, None),
    "float16": (TensorProto.FLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT16),
    "double": (TensorProto.DOUBLE, TensorProto.DOUBLE, TensorProto.DOUBLE),
    "float_weight_float16": (TensorProto.FLOAT, TensorProto.FLOAT16, None),
    "float_bias_float16": (TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.FLOAT16),
    "bfloat16_weight_float": (TensorProto.BFLOAT16, TensorProto.FLOAT, None),
}


@pytest.mark.parametrize("opset", [1, 11, 17, 21, 22, 24])
@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_onnx_conv_operand_types_are_those_its_opset_takes_and_one(tmp_path, op, opset):
    """A bfloat16 conv was planned whatever the model's opset, though Conv and ConvTranspose take bfloat16 only from
    opset 22 (float16 and double from the first), and so was one whose input, weight and bias differ in type (float
    and float16), which the operators' one type T forbids; onnxruntime refuses to load either. Each is refused where
    onnx's own type-checking shape inference refuses it, and planned where it does not."""
    kernel = (4, 3, 3, 3) if op == "Conv" else (3, 4, 3, 3)
    for case, (x_type, w_type, b_type) in _TYPED_CONVS.items():
        inits = [helper.make_tensor("w", w_type, kernel, [0.0] * 108)]
        if b_type is not None:
            inits.append(helper.make_tensor("b", b_type, [4], [0.0] * 4))
        node = helper.make_node(op, ["x", "w", "b"][:len(inits) + 1], ["y"], name=case)
        path = save(tmp_path, [node], [helper.make_tensor_value_info("x", x_type, [1, 3, 8, 8])], inits,
                    name=f"{case}.onnx", outputs=[helper.make_tensor_value_info("y", x_type, None)], opset=opset)
        try:
            onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True)
        except onnx.shape_inference.InferenceError:
            valid = False
        else:
            valid = True
        assert valid == (case in ("float16", "double") or case == "bfloat16" and opset >= 22), case
        if valid:
            assert [layer.name for layer in load_model(path)] == [case]
            continue
        if case.startswith("bfloat16") and opset < 22:
            why = f"input 'x' is bfloat16: a {op} of opset {opset} takes float16, float or double; bfloat16 from " \
                  "opset 22"
        else:
            types = [("input", "x", x_type), ("weight", "w", w_type), ("bias", "b", b_type)][:len(inits) + 1]
            listed = [f"{what} '{name}' is {TensorProto.DataType.Name(t).lower()}" for what, name, t in types]
            listed = ", ".join(listed[:-1]) + " and " + listed[-1]
            why = f"{listed}: a {op}'s input, weight and bias are of one type"
        with pytest.raises(ModelError, match=re.escape(f"1 conv node(s) cannot be planned: '{case}' ({why}) (skip")):
            load_model(path)
        with pytest.warns(UserWarning, match=re.escape(f"skipped 1 conv node(s): '{case}' ({why})")), \
                pytest.raises(ModelError, match="none of the model's 1 conv node"):
            load_model(path, skip_unknown=True)


def save_with_function(tmp_path, calls, body, name="f.onnx"):
    """A model whose main graph is ``calls`` (nodes of the "local" domain call ``Block``) and whose model-local
    function ``Block(inp, w) -> out`` is ``body``."""
    block = helper.make_function("local", "Block", ["inp", "w"], ["out"], body, [helper.make_opsetid("", 17)])
    graph = helper.make_graph(calls, "g", [vi("x", ["N", 3, 16, 16])], [vi(calls[-1].output[0], None)],
                              initializer=[weight("w0", (8, 3, 3, 3)), weight("w1", (8, 8, 3, 3))])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[block])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_onnx_convs_inside_local_functions_are_inlined(tmp_path):
    body = [helper.make_node("Conv", ["inp", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["out"])]
    calls = [conv("stem", "x", "w0", "m", strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Block", ["m", "w1"], ["b1"], domain="local", name="block1"),
             helper.make_node("MaxPool", ["b1"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Block", ["p", "w1"], ["b2"], domain="local", name="block2")]
    path = save_with_function(tmp_path, calls, body)
    layers = load_model(path)
    assert [l.input_shape for l in layers] == [(1, 3, 16, 16), (1, 8, 8, 8), (1, 8, 4, 4)]  # shapes flow through
    assert layers[0].name == "stem" and all(l.weight_shape == (8, 8, 3, 3) for l in layers[1:])
    assert len({l.name for l in layers}) == 3
    call = helper.make_node("Block", ["x", "w0"], ["y"], domain="local", name="block")
    (layer,) = load_model(save_with_function(tmp_path, [call], body, name="only.onnx"))  # no conv in the main graph
    assert layer.input_shape == (1, 3, 16, 16) and layer.weight_shape == (8, 3, 3, 3)


def test_onnx_local_function_that_cannot_be_inlined(tmp_path):
    body = [helper.make_node("Conv", ["inp", "w"], ["out"], name="conv")]
    calls = [helper.make_node("Block", ["x", "w0", "x"], ["y"], domain="local", name="block")]  # 3 args for 2
    with pytest.raises(ModelError, match="cannot inline the model's local functions"):
        load_model(save_with_function(tmp_path, calls, body))


# ConvTranspose: (attributes, input spatial size); the equivalent conv must map the (uncropped) output to the input
CONV_T = [
    ({"strides": [2, 2]}, 7),  # U-Net's 2x2 up-convolution
    ({"strides": [2, 2], "pads": [1, 1, 1, 1]}, 7),
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, 7),
    ({"strides": [3, 3], "dilations": [2, 2]}, 5),
    ({"strides": [2, 2], "output_shape": [14, 14]}, 7),
    ({"strides": [2, 2], "output_shape": [13, 13]}, 7),  # total padding 2: one each side
    ({"strides": [2, 2], "auto_pad": "SAME_UPPER"}, 7),
    ({"strides": [2, 2], "auto_pad": "SAME_LOWER"}, 6),
    ({"strides": [2, 2], "pads": [0, 0, 1, 1]}, 7),  # asymmetric: widened
    ({"strides": [1, 1], "pads": [1, 1, 1, 1], "group": 2}, 9),
]


@pytest.mark.parametrize("attrs, size", CONV_T)
def test_onnx_conv_transpose(tmp_path, attrs, size):
    c_in, c_out, group = 6, 4, attrs.get("group", 1)
    w_shape = (c_in, c_out // group, 3, 3)
    nodes = [conv("up", "x", "w", "y", op="ConvTranspose", **attrs)]
    path = save(tmp_path, nodes, [vi("x", [1, c_in, size, size])], [weight("w", w_shape)])
    (layer,) = load_model(path)
    assert layer.transposed and layer.weight_shape == w_shape and layer.groups == group
    g = layer.geometry()
    assert g.output_shape == (1, c_in, size, size)  # the equivalent conv lands on the ConvTranspose's input
    expected = inferred_output(path, "y")
    pads = attrs.get("pads", [0] * 4)
    extra = abs(pads[0] - pads[2]) if "output_shape" not in attrs and "auto_pad" not in attrs else None
    if extra is not None:
        assert layer.input_shape == (1, c_out, expected[2] + extra, expected[3] + extra)
    else:
        assert layer.input_shape[:2] == (1, c_out) and all(0 <= a - b <= 1 for a, b in
                                                           zip(layer.input_shape[2:], expected[2:]))


def test_onnx_conv_transpose_output_shape_may_name_the_batch_and_channels_too(tmp_path):
    """``output_shape`` of N + 2 entries (N and C before the spatial sizes) gives the layer that its spatial sizes
    alone give."""
    layers = []
    for shape in ([13, 13], [1, 4, 13, 13]):
        nodes = [conv("up", "x", "w", "y", op="ConvTranspose", strides=[2, 2], output_shape=shape)]
        path = save(tmp_path, nodes, [vi("x", [1, 6, 7, 7])], [weight("w", (6, 4, 3, 3))], name=f"{len(shape)}.onnx")
        layers.append(load_model(path)[0])
    assert layers[0] == layers[1]
    assert (layers[1].input_shape, layers[1].padding) == ((1, 4, 13, 13), (1, 1))


def test_onnx_conv_transpose_output_padding_of_a_stride_is_said_where_output_shape_is_the_full_one(tmp_path):
    # output_shape equal to the full output pads nothing and grows nothing: the fault is the output padding's
    for extra in ({}, {"output_shape": [17, 17]}):
        nodes = [conv("up", "x", "w", "y", op="ConvTranspose", strides=[2, 2], output_padding=[2, 2], **extra)]
        path = save(tmp_path, nodes, [vi("x", [1, 6, 7, 7])], [weight("w", (6, 4, 3, 3))])
        with pytest.raises(ModelError, match=re.escape("'up' (output_padding [2, 2] with strides [2, 2] has no "
                                                       "equivalent convolution)")):
            load_model(path)


def test_onnx_conv_transpose_padding_may_leave_one_output_position_but_not_none(tmp_path):
    # a 1x1 input under a 3x3 kernel: 3 positions before cropping, of which pads of 1 leave one and pads of 2 none
    nodes = [conv("up", "x", "w", "y", op="ConvTranspose", pads=[1, 1, 1, 1])]
    path = save(tmp_path, nodes, [vi("x", [1, 6, 1, 1])], [weight("w", (6, 4, 3, 3))], name="one.onnx")
    (layer,) = load_model(path)
    assert (layer.input_shape, layer.padding) == ((1, 4, 1, 1), (1, 1))
    assert layer.geometry().output_shape == (1, 6, 1, 1)
    nodes = [conv("up", "x", "w", "y", op="ConvTranspose", pads=[2, 2, 2, 2])]
    path = save(tmp_path, nodes, [vi("x", [1, 6, 1, 1])], [weight("w", (6, 4, 3, 3))], name="none.onnx")
    with pytest.raises(ModelError, match=re.escape("'up' (padding [2, 2]/[2, 2] leaves no output)")):
        load_model(path)


def test_onnx_conv_transpose_reference_output_shape(tmp_path):
    # an independent check through onnx's reference evaluator: ConvTranspose's output size is the input size
    # of the equivalent convolution, and running that convolution's shapes back gives the ConvTranspose's input
    from onnx.reference import ReferenceEvaluator

    nodes = [conv("up", "x", "w", "y", op="ConvTranspose", strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])]
    path = save(tmp_path, nodes, [vi("x", [1, 2, 5, 5])], [weight("w", (2, 3, 3, 3))])
    (y,) = ReferenceEvaluator(str(path)).run(None, {"x": np.ones((1, 2, 5, 5), np.float32)})
    (layer,) = load_model(path)
    assert layer.input_shape == (1, *y.shape[1:]) == (1, 3, 10, 10)


@pytest.mark.parametrize("attrs", [
    {"strides": [3, 3], "auto_pad": "SAME_UPPER"},  # a kernel narrower than the stride: 4 * 3 = 12 from a full 11
    {"strides": [3, 3], "auto_pad": "SAME_LOWER", "output_padding": [1, 0]},
    {"strides": [2, 2], "output_shape": [8, 9]},  # kernel 2, stride 2: full 8, one more column
])
def test_onnx_conv_transpose_output_within_a_stride_past_the_full_one(tmp_path, attrs):
    # onnx's reference (and onnxruntime) pads nothing and leaves the extra positions without contribution: output
    # padding, which the equivalent convolution's larger input models
    from onnx.reference import ReferenceEvaluator

    kernel = 2
    nodes = [conv("up", "x", "w", "y", op="ConvTranspose", **attrs)]
    path = save(tmp_path, nodes, [vi("x", [1, 2, 4, 4])], [weight("w", (2, 3, kernel, kernel))])
    (y,) = ReferenceEvaluator(str(path)).run(None, {"x": np.ones((1, 2, 4, 4), np.float32)})
    (layer,) = load_model(path, asymmetric_pads="error")
    assert layer.input_shape == (1, *y.shape[1:]) and layer.padding == (0, 0)
    assert layer.geometry().output_shape == (1, 2, 4, 4)


def test_onnx_conv_transpose_with_impossible_output_padding(tmp_path):
    nodes = [conv("bad", "x", "w", "y", op="ConvTranspose", strides=[2, 2], output_padding=[3, 3])]
    path = save(tmp_path, nodes, [vi("x", [1, 2, 5, 5])], [weight("w", (2, 3, 3, 3))])
    with pytest.raises(ModelError, match=r"'bad' \(output_padding \[3, 3\] with strides \[2, 2\]"):
        load_model(path)
