"""`wsarena report` and `wsarena info`: output formats, exit codes, one-line errors."""

import argparse
import contextlib
import csv
import fcntl
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wsarena import format_size
from wsarena._cli_args import parser as _parser
from wsarena._gpu import gpu_unusable_reason

from .cli_helpers import run_cli, run_main


def test_json_report_is_one_object_with_the_contract_keys(capsys):
    code, out, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--format", "json", "--batch", "8")
    assert code == 0, err
    d = json.loads(out)
    assert d["model"] == "resnet50" and d["batch"] == 8 and d["backend"] == "cpu" and d["device"] == "cpu"
    assert d["cap_workspace_bytes"] is None and d["streams"] == 1 and d["dtype"] == "float32" and d["layout"] == "NCHW"
    assert len(d["layers"]) == 53
    chosen = [l[p]["workspace_bytes"] for l in d["layers"] for p in ("fwd", "bwd_data", "bwd_filter")]
    assert d["unshared_bytes"] == sum(chosen)
    assert d["arena_bytes"] >= max(chosen) and d["saved_bytes"] == d["unshared_bytes"] - d["arena_bytes"]


def test_cap_passes_and_streams_flags(capsys):
    code, out, err = run_main(
        capsys, "report", "vgg16", "--backend", "cpu", "--format", "json", "--cap-workspace", "4MiB",
        "--passes", "fwd,bwd_data", "--streams", "2",
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["cap_workspace_bytes"] == 4 << 20 and d["streams"] == 2
    for layer in d["layers"]:
        assert "bwd_filter" not in layer
        assert layer["fwd"]["workspace_bytes"] <= 4 << 20 and layer["bwd_data"]["workspace_bytes"] <= 4 << 20


def test_environment_cap_applies_and_flag_overrides_it(capsys, monkeypatch):
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "1MiB")
    import wsarena._config

    wsarena._config._reset()
    _, out, _ = run_main(capsys, "report", "mobilenet_v2", "--backend", "cpu", "--format", "json")
    assert json.loads(out)["cap_workspace_bytes"] == 1 << 20
    _, out, _ = run_main(
        capsys, "report", "mobilenet_v2", "--backend", "cpu", "--format", "json", "--cap-workspace", "none"
    )
    assert json.loads(out)["cap_workspace_bytes"] is None


def test_flags_replace_invalid_environment_variables():
    env = {"WSARENA_CAP_WORKSPACE": "garbage", "WSARENA_BACKEND": "gpu", "WSARENA_ALGO_SEARCH": "fast"}
    r = run_cli("report", "vgg16", "--format", "json", "--cap-workspace", "1MiB", "--backend", "cpu",
                "--search", "heuristic", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["cap_workspace_bytes"], d["backend"], d["search"]) == (1 << 20, "cpu", "heuristic")
    r = run_cli("report", "vgg16", "--backend", "cpu", "--search", "heuristic", env=env)
    assert r.returncode == 2 and "WSARENA_CAP_WORKSPACE='garbage'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_table_report_reads_well(capsys):
    code, out, _ = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--batch", "32")
    assert code == 0
    assert "backend cpu" in out and "batch 32" in out and "cap none" in out
    assert "conv1" in out and "fwd algo" in out
    assert "unshared" in out and "wsarena arena" in out and "saved" in out


def test_table_says_when_the_arena_holds_more_than_unshared(capsys):
    # 13 streams of the largest workspace (61.25 MiB) hold more than the 13 layers' workspaces together.
    code, out, _ = run_main(capsys, "report", "vgg16", "--backend", "cpu", "--streams", "13")
    assert code == 0
    last = out.splitlines()[-1]
    assert last.startswith("the arena holds more than unshared:") and "-" not in last
    assert last.endswith("MiB (1.2x as much)")
    code, out, _ = run_main(capsys, "report", "vgg16", "--backend", "cpu", "--streams", "2")
    assert out.splitlines()[-1].startswith("saved:") and out.splitlines()[-1].endswith("x less)")


def test_table_says_plainly_when_the_arena_saves_nothing(capsys, tmp_path):
    """One layer, one pass with workspace: the arena is the one workspace unshared holds, where the line read
    "saved: 0 B (1.0x less)"."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"layers": [{"name": "c", "input_shape": [1, 16, 32, 32], "weight_shape": [16, 16, 3, 3],
                                            "padding": [1, 1]}]}))
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--passes", "fwd", "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["arena_bytes"] == d["unshared_bytes"] > 0, err
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--passes", "fwd")
    assert code == 0, err
    assert re.fullmatch(r"saved: +0 B \(the arena is as large as unshared\)", out.splitlines()[-1]), out


def _big_and(shape):
    """A layer list: a 3x3 conv of 16 channels on 64x64 (some 2 MiB of workspace) and one on ``shape``."""
    return {"layers": [
        {"name": "big", "input_shape": [1, 16, 64, 64], "weight_shape": [16, 16, 3, 3], "padding": [1, 1]},
        {"name": "other", "input_shape": shape, "weight_shape": [16, shape[1], 3, 3], "padding": [1, 1]},
    ]}


@pytest.mark.parametrize(("shape", "streams", "says"), [
    ([1, 1, 4, 4], 1, "<1.001x less"),  # a tiny second workspace: 576 B saved of 2.25 MiB
    ([1, 4, 8, 8], 1, "1.004x less"),
    ([1, 8, 16, 16], 1, "1.03x less"),
    ([1, 16, 64, 63], 2, "1.01x as much"),  # two streams each hold the big one: a little more than both
])
def test_table_gives_a_ratio_near_1_with_the_digits_that_tell_it_from_1(capsys, tmp_path, shape, streams, says):
    """A saving (or an excess) of a few KiB in MiB read "(1.0x less)", as if there were none."""
    path = tmp_path / "model.json"
    path.write_text(json.dumps(_big_and(shape)))
    flags = ["report", str(path), "--backend", "cpu", "--passes", "fwd", "--streams", str(streams)]
    code, out, err = run_main(capsys, *flags, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    larger, smaller = sorted((d["unshared_bytes"], d["arena_bytes"]), reverse=True)
    code, out, err = run_main(capsys, *flags)
    assert code == 0, err
    shown = re.fullmatch(r".*\((<?)([\d.]+)x (less|as much)\)", out.splitlines()[-1])
    assert shown is not None and f"{shown[1]}{shown[2]}x {shown[3]}" == says, out.splitlines()[-1]
    ratio, figure = larger / smaller, float(shown[2])
    if shown[1]:  # below what three decimals tell from 1
        assert 1 < ratio < figure
    else:  # within half a unit of its last digit of the ratio, and not 1
        assert abs(figure - ratio) <= 0.5 * 10 ** -len(shown[2].partition(".")[2]) and figure != 1


@pytest.mark.parametrize("streams", [1, 2, 3, 53])
def test_table_totals_stay_one_short_line_each_at_any_stream_count(capsys, streams):
    code, out, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--streams", str(streams))
    assert code == 0, err
    lines = out.splitlines()
    totals = lines[lines.index("", 5) + 1:]
    assert len(totals) == 3 and max(len(line) for line in totals) <= 100, totals
    amounts = [re.match(r".+:\s+[\d.]+ [KMGT]?i?B", line) for line in totals]
    assert len({m.end() for m in amounts}) == 1, totals  # the amounts right-aligned in one column
    arena = totals[1]
    assert ("streams of" in arena) == (streams > 1), arena


def test_table_gives_the_range_of_streams_that_hold_different_sizes():
    import wsarena
    from wsarena._report_cli import render_table

    p = wsarena.plan(wsarena.load_model("resnet50")[:6], backend="cpu", streams=[0, 1, 1, 0, 2, 2])
    assert len(set(p.stream_bytes)) > 1
    arena = render_table(p).splitlines()[-2]
    least, most = format_size(min(p.stream_bytes)), format_size(max(p.stream_bytes))
    assert arena.endswith(f"{format_size(p.arena_bytes)} (3 streams of {least} to {most})"), arena


# A layer list with what the zoo lacks: rectangular strides, padding and dilation, 1-D and 3-D, a transposed conv.
VARIED = [
    {"name": "rect", "input_shape": [1, 8, 20, 24], "weight_shape": [8, 4, 3, 5], "stride": [1, 2], "padding": [0, 2],
     "dilation": [2, 1], "groups": 2},
    {"name": "line", "input_shape": [1, 4, 30], "weight_shape": [6, 4, 5], "stride": [3], "padding": [2]},
    {"name": "cube", "input_shape": [1, 2, 6, 8, 8], "weight_shape": [4, 2, 3, 3, 3], "padding": [1, 1, 1],
     "dilation": [1, 2, 2]},
    {"name": "up", "input_shape": [1, 4, 16, 16], "weight_shape": [8, 4, 2, 2], "stride": [2, 2], "transposed": True},
]

# (model, flags): grouped and depthwise convs under a cap on two streams; transposed convs and two passes; the
# varied layers in both layouts; an arena larger than unshared; no workspace at all; the choices an exhaustive
# search made (the second report of a test finds them in the cache)
REPORTS = [
    ("mobilenet_v2", ("--batch", "4", "--cap-workspace", "1MiB", "--streams", "2")),
    ("unet", ("--passes", "fwd,bwd_filter")),
    ("varied", ("--batch", "3")),
    ("varied", ("--batch", "2", "--layout", "NHWC", "--passes", "bwd_data")),
    ("vgg16", ("--streams", "10")),
    ("resnet50", ("--cap-workspace", "0")),
    ("varied", ("--search", "exhaustive", "--cap-workspace", "64KiB")),
]


def report_model(name, tmp_path):
    if name != "varied":
        return name
    path = tmp_path / "varied.json"
    path.write_text(json.dumps({"layers": VARIED}))
    return str(path)


def json_report(capsys, model, *flags):
    code, out, err = run_main(capsys, "report", model, "--backend", "cpu", *flags, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def dims(text):
    return [int(v) for v in text.split("x")]


def parse_table(text):
    """The table report as (title, settings, head, rows, totals, notes): the dashed rule under the head gives the
    columns; the three totals are (label, amount, what is in brackets)."""
    lines = text.splitlines()
    title, settings, blank, head, rule = lines[:5]
    assert blank == ""
    spans = [m.span() for m in re.finditer(r"-+", rule)]

    def cells(line):
        return [line[a:b].strip() for a, b in spans]

    end = lines.index("", 5)
    rows = [cells(line) for line in lines[5:end]]
    totals = [re.fullmatch(r"(.+):\s+([\d.]+ [KMGT]?i?B)(?: \((.+)\))?", line) for line in lines[end + 1:end + 4]]
    assert all(totals), lines[end + 1:end + 4]
    fields = dict(f.split(" ", 1) for f in settings.split("  "))
    return title, fields, cells(head), rows, [m.groups() for m in totals], lines[end + 4:]


def parse_params(text, nd):
    """``s1x2 p0x2 d2x1 g2`` -> stride, padding, dilation and groups as the JSON report lists them."""
    values = {"d": [1] * nd, "g": 1}
    for token in text.split():
        key, value = token[0], token[1:]
        values[key] = int(value) if key == "g" else dims(value) if "x" in value else [int(value)] * nd
    return {"stride": values["s"], "padding": values["p"], "dilation": values["d"], "groups": values["g"]}


@pytest.mark.parametrize(("model", "flags"), REPORTS)
def test_table_shows_what_the_json_report_holds(capsys, tmp_path, model, flags):
    path = report_model(model, tmp_path)
    d = json_report(capsys, path, *flags)
    code, out, err = run_main(capsys, "report", path, "--backend", "cpu", *flags)
    assert code == 0, err
    title, settings, head, rows, totals, notes = parse_table(out)
    assert title == f"wsarena {d['wsarena_version']} workspace report: {d['model']}"
    cap = d["cap_workspace_bytes"]
    assert settings == {
        "backend": f"{d['backend']} ({d['device']})", "dtype": d["dtype"], "layout": d["layout"],
        "batch": str(d["batch"]), "cap": "none" if cap is None else format_size(cap), "streams": str(d["streams"]),
        "search": d["search"],
    }
    passes = [p for p in ("fwd", "bwd_data", "bwd_filter") if p in d["layers"][0]]
    assert head == ["layer", "input", "weight", "params", *(h for p in passes for h in (f"{p} algo", "workspace"))]
    assert len(rows) == len(d["layers"])
    for row, layer in zip(rows, d["layers"]):
        name, shape, weight, params, *choices = row
        assert name == layer["name"] + (" (T)" if layer.get("transposed") else "")
        assert (dims(shape), dims(weight)) == (layer["input_shape"], layer["weight_shape"])
        keys = ("stride", "padding", "dilation", "groups")
        assert parse_params(params, len(layer["stride"])) == {k: layer[k] for k in keys}, name
        shown = [(layer[p]["algo"], format_size(layer[p]["workspace_bytes"])) for p in passes]
        assert list(zip(choices[::2], choices[1::2])) == shown, name

    unshared, arena, last = totals
    assert unshared == (f"unshared: one workspace per layer and pass ({len(rows) * len(passes)})",
                        format_size(d["unshared_bytes"]), None)
    per_stream = None
    if d["streams"] > 1:  # the CLI's streams may each run any layer: each holds the largest workspace
        assert len(set(d["stream_bytes"])) == 1
        per_stream = f"{d['streams']} streams of {format_size(d['stream_bytes'][0])} each"
    assert arena == ("wsarena arena: the largest workspace per stream", format_size(d["arena_bytes"]), per_stream)
    saved, arena_bytes, unshared_bytes = d["saved_bytes"], d["arena_bytes"], d["unshared_bytes"]
    if saved < 0:
        assert last[:2] == ("the arena holds more than unshared", format_size(-saved))
        ratio, unit = last[2].split("x ", 1)
        assert unit == "as much" and float(ratio) == pytest.approx(arena_bytes / unshared_bytes, abs=0.05)
    elif saved:
        assert last[:2] == ("saved", format_size(saved))
        ratio, unit = last[2].split("x ", 1)
        assert unit == "less" and float(ratio) == pytest.approx(unshared_bytes / arena_bytes, abs=0.05)
    elif arena_bytes:
        assert last == ("saved", "0 B", "the arena is as large as unshared")
    else:
        assert last == ("saved", "0 B", "no workspace at all")
    if any(layer.get("transposed") for layer in d["layers"]):
        assert notes == ["(T) a transposed convolution, reported as the convolution whose backward-data it runs"]
    else:
        assert notes == []


@pytest.mark.parametrize(("model", "flags"), REPORTS)
def test_csv_holds_what_the_json_report_holds(capsys, tmp_path, model, flags):
    path = report_model(model, tmp_path)
    d = json_report(capsys, path, *flags)
    code, out, err = run_main(capsys, "report", path, "--backend", "cpu", *flags, "--format", "csv")
    assert code == 0, err
    reader = csv.DictReader(io.StringIO(out))
    passes = [p for p in ("fwd", "bwd_data", "bwd_filter") if p in d["layers"][0]]
    shapes = ["input_shape", "weight_shape", "stride", "padding", "dilation"]
    assert reader.fieldnames == ["name", *shapes, "groups", "transposed",
                                 *(f"{p}_{k}" for p in passes for k in ("algo", "workspace_bytes")), "skipped_reason"]
    rows = list(reader)
    assert len(rows) == len(d["layers"])
    for row, layer in zip(rows, d["layers"]):
        assert row["name"] == layer["name"]
        assert {k: dims(row[k]) for k in shapes} == {k: layer[k] for k in shapes}, layer["name"]
        assert int(row["groups"]) == layer["groups"]
        assert row["transposed"] == ("true" if layer.get("transposed") else "false")
        assert row["skipped_reason"] == ""  # planned; a skipped layer's row gives its reason (test_onnx_channels.py)
        for p in passes:
            assert (row[f"{p}_algo"], int(row[f"{p}_workspace_bytes"])) == (layer[p]["algo"],
                                                                           layer[p]["workspace_bytes"])


def test_layout_nhwc_reports_channels_last_shapes(capsys):
    nchw = json_report(capsys, "mobilenet_v2", "--batch", "2")
    nhwc = json_report(capsys, "mobilenet_v2", "--batch", "2", "--layout", "NHWC")
    assert (nchw["layout"], nhwc["layout"]) == ("NCHW", "NHWC")
    for a, b in zip(nchw["layers"], nhwc["layers"], strict=True):
        for key in ("input_shape", "weight_shape"):  # the weight too: (K, C/groups, R, S) -> (K, R, S, C/groups)
            n, c, *spatial = a[key]
            assert b[key] == [n, *spatial, c], (b["name"], key)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_exhaustive_search_is_reported_and_shows_progress_on_a_terminal(capsys, tmp_path):
    path = report_model("varied", tmp_path)
    terminal = FakeTerminal()
    with contextlib.redirect_stderr(terminal):
        code, out, err = run_main(capsys, "report", path, "--backend", "cpu", "--search", "exhaustive",
                                  "--format", "json")
    assert code == 0, err
    assert json.loads(out)["search"] == "exhaustive"
    shown = terminal.getvalue()
    frames = re.findall(r"\r\[[#.]+\] (\d+)/(\d+) (\S+)", shown)
    assert frames == [(str(i), str(len(VARIED)), layer["name"]) for i, layer in enumerate(VARIED, 1)]
    assert shown.endswith("\r") and shown.split("\r")[-2].strip() == ""  # the bar is wiped once every layer is done
    terminal = FakeTerminal()
    with contextlib.redirect_stderr(terminal):
        code, out, err = run_main(capsys, "report", path, "--backend", "cpu", "--format", "json")
    assert code == 0 and json.loads(out)["search"] == "heuristic" and terminal.getvalue() == ""


def test_csv_report(capsys):
    code, out, _ = run_main(capsys, "report", "googlenet", "--backend", "cpu", "--format", "csv", "--passes", "fwd")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 57 and set(rows[0]) >= {"name", "input_shape", "fwd_algo", "fwd_workspace_bytes"}
    assert "bwd_data_algo" not in rows[0]


def test_csv_report_quotes_names_that_hold_separators_quotes_or_line_breaks(capsys, tmp_path):
    # a bare "\r" too, which csv.writer before Python 3.11.9 and 3.12.3 left unquoted with "\n" rows: a reader
    # then ends the row there, and the layer's figures land in a row of their own
    names = ["a,b", 'say "hi"', "line\nbreak", "cr\rx", "crlf\r\ny", "tab\tz"]
    path = tmp_path / "names.json"
    path.write_text(json.dumps([{"name": n, "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3]}
                                for n in names]))
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--format", "csv")
    assert code == 0, err
    assert out.endswith("\n") and "\r\n" not in out.replace("crlf\r\ny", "")  # rows end in "\n"
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert [row[0] for row in rows[1:]] == names
    assert {len(row) for row in rows} == {len(rows[0])}


def test_csv_report_marks_transposed_layers(capsys):
    code, out, _ = run_main(capsys, "report", "unet", "--backend", "cpu", "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    transposed = [row["name"] for row in rows if row["transposed"] == "true"]
    assert transposed == [f"up{i}.upconv" for i in range(1, 5)]
    assert {row["transposed"] for row in rows} == {"true", "false"}


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    target = tmp_path / "ws.png"
    code, _, err = run_main(capsys, "report", "unet", "--backend", "cpu", "--plot", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", ["report", "tune"])
def test_plot_shows_tabs_and_newlines_in_names_escaped(capsys, tmp_path, command):
    # as the table shows them: drawn as they are, each warned of a glyph the font lacks
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    folder = tmp_path / "tab\there"
    folder.mkdir()
    path = folder / "m.json"
    path.write_text(json.dumps([{"name": n, "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3]}
                                for n in ("tab\there", "new\nline", "cr\rx")]))
    target = tmp_path / "ws.png"
    code, _, err = run_main(capsys, command, str(path), "--backend", "cpu", "--passes", "fwd", "--plot", str(target))
    assert (code, err) == (0, "")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["report", "resnet51"], "resnet50"),  # the message lists the zoo
        (["report", "resnet50", "--cap-workspace", "lots"], "lots"),
        (["report", "resnet50", "--batch", "0"], "--batch"),
        (["report", "resnet50", "--batch", "1_0"], "1_0"),  # int() takes these; sizes refuse them
        (["report", "resnet50", "--batch", "\uff13"], "--batch"),  # a fullwidth digit
        (["report", "resnet50", "--input-shape", "1,3,2_24,224"], "2_24"),
        (["report", "resnet50", "--dtype", "int8"], "int8"),
        (["report", "resnet50", "--passes", "fwd,sideways"], "passes"),
        (["report", "missing.onnx"], "missing.onnx"),
        (["report"], "model"),
        (["frobnicate"], "frobnicate"),
        (["report", "resnet50", "--input-shape", "1,3,a,b"], "1,3,a,b"),
        (["report", "resnet50", "--input-shape", " =1,3,8,8"], "no input name before '='"),
        (["report", "resnet50", "--input-shape", "1,3,224,224"], "onnx models only"),
        (["report", "resnet50", "--plot", ""], "--plot"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle):
    r = run_cli(*argv)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(("value", "says"), [
    ("", "expected a size or none, not ''"),  # --cap-workspace "$CAP" with CAP unset: no silent "none"
    ("  ", "expected a size or none, not '  '"),
    ("18446744073709551616", "more than 2**64 - 1 bytes"),
])
def test_a_cap_flag_that_gives_no_usable_size_is_refused_naming_the_flag(capsys, monkeypatch, value, says):
    """Not read as no cap, which would silently drop the cap WSARENA_CAP_WORKSPACE sets: an empty variable means
    the default, an empty flag means nothing. A size too large is the flag's error, as any other bad size is."""
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "1MiB")
    import wsarena._config

    wsarena._config._reset()
    code, out, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--cap-workspace", value)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"wsarena: error: argument --cap-workspace: {says}"), err


def test_float16_on_the_cpu_backend_is_bad_usage_when_asked_for_and_exit_3_when_auto():
    r = run_cli("report", "resnet50", "--backend", "cpu", "--dtype", "float16")
    assert r.returncode == 2 and "float16" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    if gpu_unusable_reason() is not None:
        r = run_cli("report", "resnet50", "--dtype", "float16")
        assert r.returncode == 3 and "float16" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_internal_failure_is_one_line_without_traceback(capsys, monkeypatch):
    import wsarena.planner

    def broken(*args, **kwargs):
        raise RuntimeError("cuDNN said no")

    monkeypatch.setattr(wsarena.planner, "plan", broken)
    code, out, err = run_main(capsys, "report", "resnet50")
    assert code == 3 and err.strip().count("\n") == 0 and "cuDNN said no" in err and out == ""


def test_cudnn_backend_without_gpu_exits_3():
    if gpu_unusable_reason() is None:
        pytest.skip("a GPU is usable here, so the cudnn backend is available")
    r = run_cli("report", "resnet50", "--backend", "cudnn")
    assert r.returncode == 3
    assert "GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_info_works_without_a_gpu():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "wsarena" in r.stdout and "cuDNN" in r.stdout and "backend 'auto' picks" in r.stdout
    assert "CUDA runtime (cuda-bindings):" in r.stdout  # which runtime: CuPy and cuDNN may each have another
    text = r.stdout
    r = run_cli("info", "--format", "json")
    d = json.loads(r.stdout)
    assert d["auto_backend"] in ("cpu", "cudnn") and "cudnn" in d and "gpu" in d
    if d["cudnn"]["found"]:
        assert f"\ncuDNN: {d['cudnn']['version_string']} at {d['cudnn']['path']} (found via " in text
    cudart = d["cudnn"].get("cudart_version")
    if cudart:
        assert f"built for CUDA {cudart // 1000}.{cudart % 1000 // 10}" in run_cli("info").stdout


def test_info_text_names_cudnn_its_version_path_and_runtime():
    from wsarena.info import collect_info, render_info

    data = collect_info()
    data["cudnn"] = {"found": True, "version": 91002, "version_string": "9.10.2", "cudart_version": 12080,
                     "path": "/opt/cudnn/lib/libcudnn.so.9", "found_via": "LD_LIBRARY_PATH", "error": None}
    lines = render_info(data).splitlines()
    assert "cuDNN: 9.10.2 at /opt/cudnn/lib/libcudnn.so.9 (found via LD_LIBRARY_PATH, built for CUDA 12.8)" in lines
    del data["cudnn"]["version_string"], data["cudnn"]["cudart_version"]
    assert "cuDNN: 91002 at /opt/cudnn/lib/libcudnn.so.9 (found via LD_LIBRARY_PATH)" in render_info(data).splitlines()
    data["cudnn"] = {"found": False, "error": "libcudnn.so.9: cannot open shared object file"}
    assert "cuDNN: not usable: libcudnn.so.9: cannot open shared object file" in render_info(data).splitlines()


def test_version_is_the_packages_version():
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    r = run_cli("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"wsarena {version}\n", "")


def test_readme_usage_names_every_option_of_each_command():
    """Each command's lines of the README's usage block name its every flag and, for a flag with choices, each value
    in the parser's order; tune's model flags are report's first four lines, as its line says. Looked for in the
    command's own lines, a flag another command shares (--format, --plot, --max-slowdown) cannot hide a gap."""
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    start = readme.index("```\nwsarena report MODEL") + 4  # the usage block (the first such line is elsewhere)
    sections: dict[str, str] = {}
    for line in readme[start:readme.index("```", start)].splitlines():
        if line.startswith("wsarena "):
            name = line.split()[1]
            sections[name] = line
        else:  # a continuation line of the command above
            sections[name] += "\n" + line
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert sorted(sections) == sorted(commands)
    model_flags = "\n".join(sections["report"].splitlines()[:4])
    assert "the first four lines above" in sections["tune"]

    def named(option, text):
        return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None

    for name, parser in commands.items():
        options = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
        if name == "tune":  # report's first four lines are tune's flags: each of them one of tune's
            assert set(re.findall(r"--[a-z][a-z-]*", model_flags)) <= options
        for action in parser._actions:
            if not action.option_strings:  # a positional: its choices as a|b
                assert not action.choices or "|".join(action.choices) in sections[name], (name, action.dest)
                continue
            for option in set(action.option_strings) - {"-h", "--help"}:
                where = sections[name]
                if name == "tune" and not named(option, where):
                    where = model_flags
                assert named(option, where), (name, option)
                if action.choices:  # each value it takes, in the parser's order
                    assert f"{option} {'|'.join(action.choices)}" in where, (name, option)
    assert "[--input-shape [NAME=]DIMS]..." in model_flags  # the flag repeated, one NAME=DIMS each


def test_console_script_entry_point_exists():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "wsarena"]
    assert ep.value == "wsarena.cli:main"


def test_input_shape_fixes_a_symbolic_onnx_input(capsys, tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(np.zeros((8, 3, 3, 3), np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="stem", pads=[1, 1, 1, 1])
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], initializer=[w]))
    path = tmp_path / "symbolic.onnx"
    onnx.save(model, str(path))

    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--format", "json")
    assert code == 2 and "unknown" in err
    for flag in ("1,3,64,48", "x=1x3x64x48"):
        code, out, err = run_main(
            capsys, "report", str(path), "--backend", "cpu", "--format", "json", "--input-shape", flag
        )
        assert code == 0, err
        assert json.loads(out)["layers"][0]["input_shape"] == [1, 3, 64, 48]
    code, out, err = run_main(
        capsys, "report", str(path), "--backend", "cpu", "--input-shape", "1,3,8,8", "--input-shape", "x=1,3,8,8"
    )
    assert code == 2 and "name each input" in err
    code, out, err = run_main(
        capsys, "report", str(path), "--backend", "cpu", "--input-shape", "x=1,3,8,8", "--input-shape", "x=1,3,9,9"
    )
    assert code == 2 and "--input-shape given twice for input 'x': 1x3x8x8 and 1x3x9x9" in err and out == ""


@pytest.mark.parametrize("command", ["report", "tune"])
def test_an_input_shape_whose_batch_is_not_the_one_planned_gives_a_warning(capsys, tmp_path, command):
    """The batch comes from --batch (default 1), never from --input-shape: a shape of batch 8 alone plans batch 1,
    which is said rather than left unseen. A shape of batch 1 (as the examples write it) or of --batch's says
    nothing."""
    from .onnx_graphs import conv, save, vi, weight

    path = save(tmp_path / "m.onnx", [conv("stem", "x", "w", "y", pads=[1, 1, 1, 1])], [vi("x", ["N", 3, "H", "W"])],
                [weight("w", (8, 3, 3, 3))])
    for flag, batch, warned in [("8,3,16,16", [], "8x3x16x16 has batch 8: the plan is for --batch 1"),
                                ("x=8x3x16x16", ["--batch", "4"], "x=8x3x16x16 has batch 8: the plan is for --batch 4"),
                                ("1,3,16,16", ["--batch", "4"], None), ("4,3,16,16", ["--batch", "4"], None)]:
        code, out, err = run_main(capsys, command, str(path), "--backend", "cpu", "--input-shape", flag, *batch)
        assert code == 0 and out, err
        assert err == ("" if warned is None else f"wsarena: warning: --input-shape {warned} (the batch comes from "
                       "--batch)\n")


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux's F_SETPIPE_SZ to size the pipe")
def test_a_reader_that_stops_early_ends_the_report_quietly(capsys):
    # The report must not fit in the pipe, or the child could write it all and exit 0 before the reader closes
    # (a default pipe holds 64 KiB, more than this report): a one-page pipe makes the child block on a write
    # that the close then breaks, every time.
    page = 4096
    code, out, _ = run_main(capsys, "report", "resnet50", "--format", "json")
    assert code == 0 and len(out.encode()) > 4 * page
    read_end, write_end = os.pipe()
    fcntl.fcntl(read_end, fcntl.F_SETPIPE_SZ, page)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "wsarena", "report", "resnet50", "--format", "json"],
        stdout=write_end, stderr=subprocess.PIPE, env=env,
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read(5) == b'{\n  "'  # like `| head -c 5`: read a little, then close the pipe
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and stderr == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose writes fail")
@pytest.mark.parametrize("argv", [("report", "vgg16"), ("report", "vgg16", "--format", "json"),
                                  ("report", "vgg16", "--format", "csv"), ("info",)])
def test_output_that_cannot_be_written_exits_3_with_one_line(argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "wsarena", *argv], stdout=full, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=300, check=False)
    assert r.returncode == 3
    assert r.stderr == "wsarena: error: cannot write the output: No space left on device\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose writes fail")
@pytest.mark.parametrize("argv", [("--help",), ("report", "--help"), ("cache", "--help"), ("--version",)])
def test_help_and_version_that_cannot_be_written_exit_as_the_commands_output_does(argv):
    """--help and --version wrote as argparse writes, its failure dropped: on a full disk, or to a reader gone, they
    exited 0 with nothing said, where every command's output exits 3 with one line, or 141 silently."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "wsarena", *argv], stdout=full, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=300, check=False)
    assert (r.returncode, r.stderr) == (3, "wsarena: error: cannot write the output: No space left on device\n")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "wsarena", *argv], stdout=write_end, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=300, check=False)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, "")
    r = subprocess.run([sys.executable, "-m", "wsarena", *argv], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.startswith("usage: wsarena" if "--help" in argv else "wsarena ")


@pytest.mark.parametrize("argv", [("report", "vgg16"), ("report", "vgg16", "--format", "json"),
                                  ("report", "vgg16", "--format", "csv"), ("info",), ("--help",),
                                  ("report", "--help"), ("--version",)])
def test_a_closed_stdout_exits_3_with_one_line(argv):
    # started with stdout closed (`wsarena report ... >&-`), Python's sys.stdout is None; --help and --version
    # wrote their text to stderr then, as argparse writes to a stream that is None, and exited 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    r = subprocess.run(["sh", "-c", 'exec "$0" -m wsarena "$@" >&-', sys.executable, *argv], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
    assert (r.returncode, r.stderr) == (3, "wsarena: error: cannot write the output: stdout is closed\n")


def test_a_closed_stderr_keeps_warnings_and_errors_out_of_the_output(tmp_path):
    """Started with stderr closed (`2>&-`, Python's sys.stderr None), print(file=sys.stderr) writes to stdout: a
    warning went into the JSON object and --apply's line (`export $(wsarena tune ... --apply 2>&-)`), and an
    error onto stdout."""
    from .onnx_graphs import conv, save, vi, weight

    path = save(tmp_path / "m.onnx", [conv("stem", "x", "w", "y", pads=[1, 1, 1, 1])], [vi("x", ["N", 3, "H", "W"])],
                [weight("w", (8, 3, 3, 3))])
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}

    def run(*argv):
        return subprocess.run(["sh", "-c", 'exec "$0" -m wsarena "$@" 2>&-', sys.executable, *argv],
                              capture_output=True, text=True, env={**env, "WSARENA_CACHE_DIR": "off"}, timeout=300,
                              check=False)

    warned = ("--backend", "cpu", "--input-shape", "8,3,16,16")  # a warning: the batch planned is --batch's
    r = run("report", str(path), *warned, "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["layers"][0]["input_shape"] == [1, 3, 16, 16]
    r = run("tune", str(path), *warned, "--apply")
    assert r.returncode == 0 and re.fullmatch(r"WSARENA_CAP_WORKSPACE=\d+ WSARENA_ALGO_SEARCH=exhaustive\n", r.stdout)
    r = run("report", "resnet50", "--cap-workspace", "-1")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", "")


def test_a_caller_that_closed_sys_stderr_or_sys_stdout_gets_the_exit_code(monkeypatch, tmp_path):
    """A Python caller of main() that closed sys.stderr (a file object whose writes raise ValueError, where a
    command started with `2>&-` has None): an error, a warning and the progress bar's check of the terminal raised
    that ValueError out of main(). A closed sys.stdout is the output that cannot be written (exit 3), as `>&-` is,
    --help's and --version's too, which wrote nothing and exited 0."""
    from wsarena.cli import main

    from .onnx_graphs import conv, save, vi, weight

    path = save(tmp_path / "m.onnx", [conv("stem", "x", "w", "y", pads=[1, 1, 1, 1])], [vi("x", ["N", 3, "H", "W"])],
                [weight("w", (8, 3, 3, 3))])
    monkeypatch.setenv("WSARENA_CACHE_DIR", "off")
    closed, out = io.StringIO(), io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", closed)
    warned = ("--backend", "cpu", "--input-shape", "8,3,16,16")  # a warning: the batch planned is --batch's
    assert main(["report", str(path), *warned, "--format", "json"]) == 0
    assert json.loads(out.getvalue())["layers"][0]["input_shape"] == [1, 3, 16, 16]
    assert main(["tune", str(path), *warned, "--apply"]) == 0
    assert main(["report", "resnet50", "--cap-workspace", "-1"]) == 2
    assert main(["report", "resnet50", "--bogus"]) == 2
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", closed)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["report", "vgg16", "--backend", "cpu"]) == 3
    assert err.getvalue() == "wsarena: error: cannot write the output: stdout is closed\n"
    for argv in (["--help"], ["tune", "--help"], ["--version"]):
        err.truncate(0)
        err.seek(0)
        assert main(argv) == 3
        assert err.getvalue() == "wsarena: error: cannot write the output: stdout is closed\n"


def test_a_caller_stream_whose_encoding_lacks_a_character_gets_the_text_escaped(monkeypatch, tmp_path):
    """A caller of main() whose sys.stderr is ASCII (``encoding="ascii"``, its errors strict): an error naming a
    file whose name is not ASCII raised UnicodeEncodeError, a ValueError, which was taken for a closed stream and
    the line dropped. It shows with the character escaped, as Python's own stderr shows it; the parser's --help and
    --version writer escapes so too."""
    from wsarena.cli import main

    err = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, encoding="ascii", write_through=True))
    missing = tmp_path / "mod\u00e8le.onnx"
    assert main(["report", str(missing)]) == 2
    line = err.getvalue().decode("ascii")
    assert line.count("\n") == 1 and line.startswith("wsarena: error: ")
    assert str(missing).replace("\u00e8", "\\xe8") in line and "No such file" in line
    # escaped only where the encoding has no character: latin-1 has the accents
    for encoding, written in [("ascii", b"d\\xe9j\\xe0 \\u2713\n"), ("latin-1", b"d\xe9j\xe0 \\u2713\n")]:
        out = io.BytesIO()
        stream = io.TextIOWrapper(out, encoding=encoding, write_through=True)
        _parser()._print_message("d\u00e9j\u00e0 \u2713\n", stream)
        assert out.getvalue() == written


@pytest.mark.parametrize(("encoding", "name"), [("cp437", "S\u00e3o \u2713"),
                                              ("cp1251", "\u0444\u0430\u0439\u043b caf\u00e9"),
                                              ("cp1252", "\u20ac \u2713"), ("mac-roman", "\u00a4 \u2713")])
def test_a_caller_stream_of_a_code_page_gets_the_text_escaped_as_its_own_encoding_escapes_it(monkeypatch, tmp_path,
                                                                                            encoding, name):
    """A code page's codec (cp437, cp1251, cp1252, mac-roman) names itself "charmap" in its UnicodeEncodeError,
    which as an encoding is latin-1's: escaped for latin-1, a character the page lacks but latin-1 has (cp437's ã,
    cp1251's é, mac-roman's ¤) failed the second write too and the line was lost, and one the page has but latin-1
    lacks (cp1252's €, cp1251's Cyrillic) was escaped for nothing. The line is what the stream writes with
    errors="backslashreplace", as Python's own stderr in that encoding writes it."""
    from wsarena.cli import main

    def expected(text: str) -> bytes:
        out = io.BytesIO()
        stream = io.TextIOWrapper(out, encoding=encoding, errors="backslashreplace", write_through=True)
        stream.write(text)
        return out.getvalue()

    err = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, encoding=encoding, write_through=True))
    missing = tmp_path / f"{name}.onnx"
    assert main(["report", str(missing)]) == 2
    line = err.getvalue()
    assert line.count(b"\n") == 1 and line.startswith(b"wsarena: error: ")
    assert expected(str(missing)) in line and b"No such file" in line
    out = io.BytesIO()
    stream = io.TextIOWrapper(out, encoding=encoding, write_through=True)
    _parser()._print_message(f"{name}\n", stream)
    assert out.getvalue() == expected(f"{name}\n")


def test_a_caller_stream_of_a_code_page_that_names_no_encoding_gets_the_text_escaped(monkeypatch, tmp_path):
    """A caller's sys.stderr with no encoding attribute, whose writes encode in cp437: the line was escaped in the
    encoding its refusal names, "charmap", which as an encoding is latin-1's, whose escapes kept the ã cp437 lacks;
    the second write failed too, and the line was lost. It is escaped as ASCII there."""
    from wsarena.cli import main

    class Cp437:
        def __init__(self):
            self.written = b""

        def write(self, text):
            self.written += text.encode("cp437")  # UnicodeEncodeError naming "charmap", as a cp437 stream raises it

        def flush(self):
            pass

    err = Cp437()
    monkeypatch.setattr(sys, "stderr", err)
    missing = tmp_path / "S\u00e3o \u2713.onnx"
    assert main(["report", str(missing)]) == 2
    line = err.written.decode("ascii")
    assert line.count("\n") == 1 and line.startswith("wsarena: error: ")
    assert str(missing).replace("\u00e3", "\\xe3").replace("\u2713", "\\u2713") in line and "No such file" in line


@pytest.mark.parametrize(("argv", "code"), [(("report", "resnet50", "--cap-workspace", "-1"), 2),
                                            (("report", "resnet50", "--backend", "cudnn"), 3)])
def test_an_error_whose_stderr_reader_went_away_keeps_its_exit_code(argv, code):
    """The error's line cannot be written (`2>&1 | head -0`): the exit code still says what went wrong, where the
    BrokenPipeError of printing it ended the command with 1."""
    if code == 3 and gpu_unusable_reason() is None:
        pytest.skip("needs a machine without a usable GPU")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "wsarena", *argv], stdout=subprocess.PIPE, stderr=write_end,
                           env=env, timeout=300, check=False)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stdout) == (code, b"")


def test_asymmetric_pads_are_widened_or_refused(capsys, tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="asym", pads=[0, 0, 1, 1])
    path = tmp_path / "asym.onnx"
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y], initializer=[w])), str(path))

    for flags in ((), ("--asymmetric-pads", "widen")):
        code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--format", "json", *flags)
        assert code == 0, err
        assert json.loads(out)["layers"][0]["padding"] == [1, 1]
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--asymmetric-pads", "error")
    assert code == 2 and "asymmetric pads" in err and out == ""
    code, out, err = run_main(
        capsys, "report", str(path), "--backend", "cpu", "--asymmetric-pads", "error", "--skip-unknown"
    )
    warning, error = err.splitlines()
    assert warning.startswith("wsarena: warning: ") and "skipped 1 conv node" in warning
    assert code == 2 and "none of the model's 1 conv node(s) could be planned" in error


def test_skip_unknowns_help_names_each_kind_of_conv_it_leaves_out(capsys, tmp_path):
    """--skip-unknown's help names what it leaves out: a shape unknown, an empty conv, operands of a type the
    operator refuses (an int64 weight, a float16 weight beside a float input: which it did not name) and asymmetric
    pads under --asymmetric-pads error; each such conv of one model is left out, and the float one beside them
    planned."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from .onnx_graphs import conv, save, vi, weight

    r = run_cli("report", "--help")
    assert r.returncode == 0, r.stderr
    help_text = " ".join(r.stdout.split())
    start = help_text.index("--skip-unknown leave out")
    said = help_text[start:help_text.index("--asymmetric-pads {", start)]
    for kind in ("a shape unknown", "an empty conv", "a type the operator refuses", "asymmetric pads"):
        assert kind in said, said
    nodes = [conv("float", "x", "w", "y0"), conv("empty", "x", "w0", "y1"), conv("int_weight", "x", "wi", "y2"),
             conv("half_weight", "x", "wh", "y5"), conv("asym", "x", "w", "y3", pads=[0, 0, 1, 1]),
             helper.make_node("Reshape", ["x", "s"], ["r"]), conv("lost", "r", "w", "y4")]
    inits = [weight("w", (4, 3, 3, 3)), weight("w0", (0, 3, 3, 3)),
             numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.int64), "wi"),
             numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float16), "wh")]
    path = save(tmp_path / "kinds.onnx", nodes, [vi("x", [1, 3, 8, 8]),
                                                 helper.make_tensor_value_info("s", TensorProto.INT64, [4])], inits,
                outputs=[vi(f"y{i}", None) for i in range(6)])
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--format", "json",
                              "--asymmetric-pads", "error", "--skip-unknown")
    assert code == 0, err
    report = json.loads(out)
    assert [layer["name"] for layer in report["layers"]] == ["float"]
    skipped = [entry["name"] for entry in report["skipped_layers"]]
    assert skipped == ["empty", "int_weight", "half_weight", "asym", "lost"]


@pytest.mark.parametrize("variable", ["WSARENA_BACKEND", "WSARENA_ALGO_SEARCH", "WSARENA_CUDNN_API"])
def test_report_device_properties_decides_the_backend_search_and_api(capsys, monkeypatch, tmp_path, variable):
    """--device-properties plans cuDNN's heuristic choices through the graph API, as plan(device_properties=...)
    does: an invalid variable of those settings does not stop it (the command's own settings left them to the
    environment); the cap's does, unless --cap-workspace gives it."""
    from wsarena import _config, planner
    from wsarena.backends import get_backend

    monkeypatch.setattr(planner, "device_properties_backend", lambda text, source: get_backend("cpu"))  # no cuDNN
    props = tmp_path / "props.json"
    props.write_text("{}")
    monkeypatch.setenv(variable, "bogus")
    _config._reset()
    code, out, err = run_main(capsys, "report", "resnet50", "--device-properties", str(props), "--format", "json")
    assert (code, err) == (0, "") and (json.loads(out)["backend"], json.loads(out)["search"]) == ("cudnn", "heuristic")
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "bogus")
    _config._reset()
    code, out, err = run_main(capsys, "report", "resnet50", "--device-properties", str(props))
    assert (code, out) == (2, "") and "WSARENA_CAP_WORKSPACE='bogus'" in err
    assert run_main(capsys, "report", "resnet50", "--device-properties", str(props), "--cap-workspace", "1MiB")[0] == 0


def test_device_properties_without_the_driver_library_is_one_line_of_wsarenas():
    """Where libcuda.so.1 is missing (cuDNN 9.27 on), cuDNN printed its own "Unable to load any of {...}" line to
    stderr at its first finalize, before wsarena's: the engine library that needs the driver library is loaded first,
    and its failure said in wsarena's line alone."""
    props = Path(__file__).with_name("data") / "h100-handwritten.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    r = subprocess.run([sys.executable, "-m", "wsarena", "report", "resnet50", "--device-properties", str(props)],
                       capture_output=True, text=True, env={**env, "WSARENA_CACHE_DIR": "off"}, timeout=300,
                       check=False)
    if r.returncode == 0:
        pytest.skip("cuDNN plans here: libcuda.so.1 loads, or this cuDNN (before 9.27) does without it")
    assert (r.returncode, r.stdout) == (3, ""), r.stderr
    assert re.fullmatch(r"wsarena: error: planning against device properties needs cuDNN's engine libraries, .*: "
                        r"libcuda\.so\.1: cannot open shared object file: .*\n", r.stderr), r.stderr


def test_every_flag_with_a_default_value_says_it_in_its_help():
    """``wsarena CMD --help`` states each default: a flag whose default is a value (not None, not off) names it in
    its help, ``default`` and the value as the flag takes it (the cap and the slowdown say it their own way)."""
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    for name, parser in commands.items():
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            text = action.help or ""
            assert "default" in text, (name, action.option_strings)
            if isinstance(action.default, (int, str)) and not isinstance(action.default, bool):
                assert str(action.default) in text, (name, action.option_strings, action.default)


@pytest.mark.parametrize("command", ["report", "tune"])
def test_the_passes_flag_names_the_passes_in_its_help(capsys, command):
    """``--passes`` takes names argparse does not list (it has no choices): its help names each, which it did not
    ("comma-separated (default: all three)")."""
    from wsarena.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone
    assert exited.value.code == 0
    assert "--passes PASSES comma-separated, of fwd,bwd_data,bwd_filter" in help_text


def test_every_subcommands_help_says_what_it_does():
    """``wsarena CMD --help`` opens with what the command does, as ``report`` and ``tune`` did and ``cache`` and
    ``info`` did not (usage and options alone); ``info``'s names the variables it reports that nothing reads, as the
    README says it does."""
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert set(commands) >= {"report", "tune", "cache", "info"}
    for name, parser in commands.items():
        assert parser.description and len(parser.description) > 60, name
    assert "WSARENA_*" in commands["info"].description and "not read" in commands["info"].description
    assert "unreadable" in commands["cache"].description


def test_cache_clear_says_in_its_help_that_it_removes_the_unreadable_files_too(capsys):
    from wsarena.cli import main

    with pytest.raises(SystemExit):
        main(["cache", "--help"])
    assert "clear: remove the entries and the unreadable files" in " ".join(capsys.readouterr().out.split())
