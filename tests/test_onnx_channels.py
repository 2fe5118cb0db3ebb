"""ONNX convolutions whose input channel count shape inference loses (a U-Net's skip connection through Pad and
Concat), and how a report made with --skip-unknown says what its figures leave out."""

import csv
import functools
import io
import json

import pytest

import wsarena
from wsarena.models import ConvLayer, ModelError

from .cli_helpers import run_main
from .onnx_graphs import conv, inferred_shape, save, unet, vi, weight

pytestmark = pytest.mark.usefixtures("fresh_arena")  # from conftest: a host arena of the test's own


def by_name(layers):
    return {layer.name: layer for layer in layers}


def test_the_skip_connection_leaves_the_channels_unknown_to_shape_inference(tmp_path):
    # What the rest of this file relies on: ONNX itself does not know the decoder's input channels.
    assert inferred_shape(unet(tmp_path / "unet.onnx"), "cat") == (1, None, 32, 32)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_conv_takes_its_input_channels_from_its_weight(tmp_path, group):
    layers = by_name(wsarena.load_model(unet(tmp_path / "unet.onnx", group=group)))
    dec = layers["dec"]
    assert dec.input_shape == (1, 16, 32, 32) and dec.weight_shape == (8, 16 // group, 3, 3) and dec.groups == group
    assert layers["up"].geometry().output_shape == (1, 16, 16, 16)  # the ConvTranspose's input, enc2's output


def test_a_conv_transpose_takes_its_input_channels_from_its_weight(tmp_path):
    dec = by_name(wsarena.load_model(unet(tmp_path / "unet.onnx", decoder="ConvTranspose")))["dec"]
    # stored as its forward-equivalent convolution: input = its output (4 channels, 64x64), output = its input
    assert dec.transposed and dec.input_shape == (1, 4, 64, 64) and dec.geometry().output_shape == (1, 16, 32, 32)


def test_the_plan_equals_that_of_the_same_layers_written_out(tmp_path):
    from_onnx = wsarena.plan(wsarena.load_model(unet(tmp_path / "unet.onnx")), batch=4, backend="cpu")
    written = [
        ConvLayer("enc1", (1, 3, 32, 32), (8, 3, 3, 3), padding=1),
        ConvLayer("enc2", (1, 8, 32, 32), (16, 8, 3, 3), stride=2, padding=1),
        ConvLayer("up", (1, 8, 32, 32), (16, 8, 2, 2), stride=2, transposed=True),
        ConvLayer("dec", (1, 16, 32, 32), (8, 16, 3, 3), padding=1),
    ]
    by_hand = wsarena.plan(written, batch=4, backend="cpu")
    assert from_onnx.to_dict()["layers"] == by_hand.to_dict()["layers"]
    assert (from_onnx.arena_bytes, from_onnx.unshared_bytes) == (by_hand.arena_bytes, by_hand.unshared_bytes)
    # the decoder, which the channel count used to leave out, is the layer with the largest workspace
    assert max(from_onnx.layers, key=lambda lp: lp.largest_bytes).name == "dec"


def test_the_weight_does_not_give_spatial_sizes(tmp_path):
    path = save(tmp_path / "m.onnx", [conv("c", "x", "w", "y")], [vi("x", [1, None, "H", "W"])],
                [weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError, match=r"'c' \(input shape \[1, 3, \?, \?\] unknown\)"):
        wsarena.load_model(path)
    (layer,) = wsarena.load_model(path, input_shapes=(1, 3, 16, 16))
    assert layer.input_shape == (1, 3, 16, 16)


def test_a_channel_count_the_weight_contradicts_is_still_an_error(tmp_path):
    path = save(tmp_path / "m.onnx", [conv("c", "x", "w", "y")], [vi("x", [1, 5, 8, 8])], [weight("w", (4, 3, 3, 3))])
    with pytest.raises(ModelError, match=r"layer 'c': weight_shape=\(4, 3, 3, 3\) has 3 input channels per group"):
        wsarena.load_model(path)


# ------------------------------------------------------------------------------------- what --skip-unknown says


def lost_model(tmp_path):
    """The U-Net with the decoder's spatial size made unknown too (a Reshape to a runtime shape): skipped."""
    from onnx import TensorProto, helper

    nodes = [conv("enc1", "x", "w1", "e1", pads=[1, 1, 1, 1]), helper.make_node("Reshape", ["e1", "s"], ["r"]),
             conv("dec", "r", "w2", "y", pads=[1, 1, 1, 1])]
    inputs = [vi("x", [1, 3, 32, 32]), helper.make_tensor_value_info("s", TensorProto.INT64, [4])]
    return save(tmp_path / "lost.onnx", nodes, inputs, [weight("w1", (8, 3, 3, 3)), weight("w2", (8, 8, 3, 3))])


WHY = "input shape [1, 8, ?, ?] unknown: shape inference cannot work out the output of Reshape 'r'"


def test_a_plan_of_a_model_with_skipped_layers_says_so(tmp_path):
    with pytest.warns(UserWarning, match="skipped 1 conv node"):
        layers = wsarena.load_model(lost_model(tmp_path), skip_unknown=True)
    assert [layer.name for layer in layers] == ["enc1"] and layers.skipped == (("dec", WHY),)
    p = wsarena.plan(layers, backend="cpu")
    assert p.skipped == (("dec", WHY),)
    assert p.to_dict()["skipped_layers"] == [{"name": "dec", "reason": WHY}]
    assert wsarena.plan(layers, backend="cpu", max_slowdown=0.5).skipped == p.skipped
    assert wsarena.tune(layers, backend="cpu").to_dict()["skipped_layers"] == [{"name": "dec", "reason": WHY}]
    assert wsarena.plan(list(layers), backend="cpu").to_dict()["skipped_layers"] == []  # a plain list: none


def _skipping_unknown(command, capsys, *argv):
    """What ``wsarena COMMAND ARGV --backend cpu --skip-unknown`` writes, run here; it must exit with 0."""
    code, out, err = run_main(capsys, command, *argv, "--backend", "cpu", "--skip-unknown")
    assert code == 0, err
    return out


report = functools.partial(_skipping_unknown, "report")
tune = functools.partial(_skipping_unknown, "tune")


def test_the_report_totals_say_what_they_leave_out(capsys, tmp_path):
    path = str(lost_model(tmp_path))
    table = report(capsys, path).splitlines()
    assert table[-4].startswith("unshared: ") and table[-2].startswith("saved: ")
    assert table[-1] == f"these totals leave out 1 conv layer(s) that could not be planned (--skip-unknown): " \
                        f"'dec' ({WHY})"
    d = json.loads(report(capsys, path, "--format", "json"))
    assert d["skipped_layers"] == [{"name": "dec", "reason": WHY}] and [l["name"] for l in d["layers"]] == ["enc1"]
    rows = list(csv.DictReader(io.StringIO(report(capsys, path, "--format", "csv"))))
    assert [row["name"] for row in rows] == ["enc1", "dec"]
    assert {k: v for k, v in rows[1].items() if v} == {"name": "dec", "fwd_algo": "skipped", "bwd_data_algo": "skipped",
                                                        "bwd_filter_algo": "skipped", "skipped_reason": WHY}
    assert rows[0]["skipped_reason"] == "" and list(rows[0])[-1] == "skipped_reason"  # a column added at the end


def test_tune_says_what_its_curve_leaves_out(capsys, tmp_path):
    path = str(lost_model(tmp_path))
    assert tune(capsys, path).splitlines()[-1] == f"these figures leave out 1 conv layer(s) that could not be " \
                                                  f"planned (--skip-unknown): 'dec' ({WHY})"
    d = json.loads(tune(capsys, path, "--format", "json"))
    assert d["skipped_layers"] == [{"name": "dec", "reason": WHY}]
    rows = list(csv.DictReader(io.StringIO(tune(capsys, path, "--format", "csv"))))
    points, skipped = rows[: len(d["curve"])], rows[len(d["curve"]):]
    assert [(r["cap_workspace_bytes"], r["skipped_layer"]) for r in points] == [
        ("" if p["cap_workspace_bytes"] is None else str(p["cap_workspace_bytes"]), "") for p in d["curve"]]
    assert [{k: v for k, v in r.items() if v} for r in skipped] == [{"skipped_layer": "dec", "skipped_reason": WHY}]
    assert all(r["skipped_reason"] == "" for r in points)


def test_a_report_without_skipped_layers_has_an_empty_list(capsys, tmp_path):
    d = json.loads(report(capsys, str(unet(tmp_path / "unet.onnx")), "--format", "json"))
    assert d["skipped_layers"] == [] and len(d["layers"]) == 4
