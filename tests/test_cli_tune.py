"""`wsarena tune`, `wsarena report --max-slowdown` and `wsarena cache`: formats, exit codes, one-line errors."""

import csv
import io
import json
import os
import re
import stat
import subprocess
import sys

import pytest

import wsarena._config
from wsarena._gpu import gpu_unusable_reason

from .cli_helpers import run_cli, run_main

# A small model: three distinct convolutions, one repeated, so that a real CPU tuning takes a moment.
MODEL = {
    "layers": [
        {"name": "stem", "input_shape": [1, 3, 32, 32], "weight_shape": [16, 3, 3, 3], "padding": [1, 1]},
        {"name": "body", "input_shape": [1, 16, 32, 32], "weight_shape": [16, 16, 3, 3], "padding": [1, 1]},
        {"name": "body2", "input_shape": [1, 16, 32, 32], "weight_shape": [16, 16, 3, 3], "padding": [1, 1]},
        {"name": "head", "input_shape": [1, 16, 32, 32], "weight_shape": [32, 16, 1, 1]},
    ]
}


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(MODEL))
    return str(path)


def tune_json(capsys, model, *flags):
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--batch", "2", "--format", "json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_json_has_the_contract_keys_and_a_sorted_curve(capsys, model):
    d = tune_json(capsys, model)
    assert (d["model"], d["backend"], d["device"], d["batch"], d["dtype"], d["layout"]) == (
        model, "cpu", "cpu", 2, "float32", "NCHW")
    assert d["wsarena_version"] and d["max_slowdown"] == 0.02 and d["distinct_calls"] == 9
    curve = d["curve"]
    assert curve[-1]["cap_workspace_bytes"] is None
    caps = [p["cap_workspace_bytes"] for p in curve[:-1]]
    assert caps == sorted(set(caps)) and caps[0] == 0  # every CPU pass has a zero-workspace algorithm
    for p in curve:
        assert set(p) == {"cap_workspace_bytes", "arena_bytes", "step_seconds", "slowdown"}
        assert p["step_seconds"] > 0 and p["slowdown"] >= 0
        # a float, as the contract says, wherever it is not null (against an uncapped step timed at 0): 0.0, not 0
        assert type(p["slowdown"]) is float and type(p["step_seconds"]) is float, p
    steps = [p["step_seconds"] for p in curve]
    assert steps == sorted(steps, reverse=True)
    assert d["recommended_cap_bytes"] in caps
    best = curve[caps.index(d["recommended_cap_bytes"])]
    assert best["slowdown"] <= 0.02 + 1e-12
    assert all(p["slowdown"] > 0.02 for p in curve[: caps.index(d["recommended_cap_bytes"])])


def test_max_slowdown_as_a_percentage_or_a_fraction(capsys, model):
    assert tune_json(capsys, model, "--max-slowdown", "50%")["max_slowdown"] == 0.5
    assert tune_json(capsys, model, "--max-slowdown", "0.5")["max_slowdown"] == 0.5
    assert tune_json(capsys, model, "--max-slowdown", "500%")["max_slowdown"] == 5  # as a percentage, it is plain
    code, _, err = run_main(capsys, "tune", model, "--backend", "cpu", "--max-slowdown", "5")
    assert code == 2 and "write 5% for 5 percent, or 500% if you mean it" in err
    assert tune_json(capsys, model, "--max-slowdown", "0")["max_slowdown"] == 0
    huge = tune_json(capsys, model, "--max-slowdown", "1e9%")
    assert huge["recommended_cap_bytes"] == 0


@pytest.mark.parametrize("command", ["tune", "report"])
def test_a_fraction_is_checked_against_1_as_written_not_as_its_float(capsys, model, command):
    """0.99999999999999999 is a fraction below 1, whose nearest float is 1.0: it was refused with "write 1% for 1
    percent, or 100% if you mean it", quoting a value not typed; so was 99999999999999999999999 ("write 1e+23%")."""
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--format", "json", "--max-slowdown",
                              "0.99999999999999999")
    assert code == 0 and json.loads(out)["max_slowdown"] == 1.0, err
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", "1.00000000000000001")
    assert (code, out) == (2, "") and err.startswith(
        "wsarena: error: argument --max-slowdown: '1.00000000000000001' is read as a fraction, a slowdown of "
        "100.000000000000001%: write 1.00000000000000001% for 1.00000000000000001 percent, or 100.000000000000001% "
        "if you mean it"), err
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", "9" * 23)
    assert code == 2 and f"a slowdown of {'9' * 23}00%: write {'9' * 23}% for {'9' * 23} percent, or {'9' * 23}00%" \
        in err, err
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", "0.1e1")
    assert code == 2 and "a slowdown of 100%: write 0.1e1% for 0.1e1 percent, or 100% if you mean it" in err, err


@pytest.mark.parametrize(("text", "written"), [("5.", "5"), ("5.e0", "5e0"), ("5.0", "5.0"), ("1.E1", "1E1")])
def test_a_number_that_ends_its_digits_with_a_point_is_suggested_without_it(capsys, model, text, written):
    """--max-slowdown 5. said "write 5.% for 5. percent"."""
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--max-slowdown", text)
    assert (code, out) == (2, "") and f": write {written}% for {written} percent, or " in err, err


@pytest.mark.parametrize("text", ["1e-99999999999999999999", "0e99999999999999999999"])
def test_a_fraction_of_an_exponent_past_decimals_range_is_read_as_its_float(capsys, model, text):
    """A fraction whose float is 0 though its exponent has 20 digits: Decimal() refuses such an exponent, and the
    check against 1 ended the command with "InvalidOperation: [<class 'decimal.InvalidOperation'>]"."""
    assert tune_json(capsys, model, "--max-slowdown", text)["max_slowdown"] == 0


def test_csv_and_table(capsys, model):
    d = tune_json(capsys, model)
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--batch", "2", "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == ["cap_workspace_bytes", "arena_bytes", "step_seconds", "slowdown", "recommended",
                             "skipped_layer", "skipped_reason"]
    assert all(r["skipped_layer"] == r["skipped_reason"] == "" for r in rows)  # every conv layer is in these figures
    assert [r["cap_workspace_bytes"] for r in rows] == [
        "" if p["cap_workspace_bytes"] is None else str(p["cap_workspace_bytes"]) for p in d["curve"]]
    assert rows[-1]["cap_workspace_bytes"] == "" and float(rows[-1]["slowdown"]) == 0
    assert [r["cap_workspace_bytes"] for r in rows if r["recommended"] == "true"] == [str(d["recommended_cap_bytes"])]
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--batch", "2")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(f"tune: {model}") and "batch 2" in lines[1]
    assert sum("<- recommended" in line for line in lines) == 1
    assert any(line.split()[:1] == ["none"] for line in lines)
    assert lines[-1] == (f"use it with: WSARENA_CAP_WORKSPACE={d['recommended_cap_bytes']} "
                         "WSARENA_ALGO_SEARCH=exhaustive")


def test_csv_quotes_a_skipped_layer_whose_name_holds_a_carriage_return(capsys, tmp_path):
    # csv.writer before Python 3.11.9 and 3.12.3 left a bare "\r" unquoted in "\n" rows: a reader ends the row there
    from .onnx_graphs import conv, save, vi, weight

    path = save(tmp_path / "m.onnx", [conv("c1", "x", "w", "y"), conv("odd\rname", "y", "w", "z", pads=[0, 0, 1, 1])],
                [vi("x", [1, 4, 8, 8])], [weight("w", (4, 4, 3, 3))])
    code, out, err = run_main(capsys, "tune", str(path), "--backend", "cpu", "--passes", "fwd", "--skip-unknown",
                              "--asymmetric-pads", "error", "--format", "csv")
    assert code == 0, err
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert {len(row) for row in rows} == {7}
    assert [row[5] for row in rows[1:] if row[5]] == ["odd\rname"]


def test_apply_prints_the_one_line(capsys, model, monkeypatch, tmp_path):
    d = tune_json(capsys, model)
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "cache"))  # the job reads the times from it
    wsarena._config._reset()
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--batch", "2", "--apply")
    line = f"WSARENA_CAP_WORKSPACE={d['recommended_cap_bytes']} WSARENA_ALGO_SEARCH=exhaustive\n"
    assert (code, out, err) == (0, line, "")
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--apply", "--format", "json")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--apply" in err


@pytest.mark.parametrize("off", ["off", "none"])
def test_apply_with_the_search_cache_off_warns_that_the_job_times_again(capsys, model, monkeypatch, off):
    """The line's exhaustive search takes tune's times from the search cache: with it off, the job times every call
    again (its choices may differ from the curve's), where --apply printed the line as ever and said nothing."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", off)
    wsarena._config._reset()
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--apply")
    assert code == 0 and re.fullmatch(r"WSARENA_CAP_WORKSPACE=\d+ WSARENA_ALGO_SEARCH=exhaustive\n", out), err
    assert err == (f"wsarena: warning: the search cache is off (WSARENA_CACHE_DIR={off}): nothing tune timed is "
                   "kept, so a job run with WSARENA_ALGO_SEARCH=exhaustive times every call again, and may choose "
                   "other algorithms than those the curve timed\n")


def test_plot_writes_a_png(capsys, model, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "curve.png"
    code, _, err = run_main(capsys, "tune", model, "--backend", "cpu", "--plot", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["tune", "no-such-model"],
        ["tune", "MODEL", "--max-slowdown", "fast"],
        ["tune", "MODEL", "--max-slowdown", "-1%"],
        ["tune", "MODEL", "--max-slowdown", "inf"],
        ["tune", "MODEL", "--max-slowdown", "5"],  # 500 %, where 5 % was surely meant: refused, not guessed
        ["tune", "MODEL", "--max-slowdown", "1"],
        ["tune", "MODEL", "--max-slowdown", "1_0"],
        ["tune", "MODEL", "--max-slowdown", "-0.5"],
        ["report", "MODEL", "--max-slowdown", "2"],
        ["tune", "MODEL", "--batch", "0"],
        ["tune", "MODEL", "--cap-workspace", "1MiB"],
        ["tune", "MODEL", "--search", "heuristic"],
        ["report", "MODEL", "--max-slowdown", "2%", "--cap-workspace", "1MiB"],
        ["report", "MODEL", "--max-slowdown", "2%", "--search", "heuristic"],
        ["cache"],
        ["cache", "list"],
    ],
)
def test_bad_usage_exits_2_with_one_line(capsys, model, argv):
    code, out, err = run_main(capsys, *[model if a == "MODEL" else a for a in argv], "--backend", "cpu") \
        if argv[0] != "cache" else run_main(capsys, *argv)
    assert code == 2 and out == "" and err.startswith("wsarena: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["tune", "report"])
@pytest.mark.parametrize("value", ["-2%", "-2e-2", "-.5%", "-0.02"])
@pytest.mark.parametrize("joined", [False, True], ids=["spaced", "joined"])
def test_a_negative_slowdown_is_refused_as_such_however_written(capsys, model, command, value, joined):
    """``--max-slowdown -2%`` is the value -2%, as ``--max-slowdown=-2%`` is, not a missing value before an unknown
    option: both spellings get the message that says what is wrong with it."""
    flag = [f"--max-slowdown={value}"] if joined else ["--max-slowdown", value]
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", *flag)
    assert code == 2 and out == ""
    assert err == (f"wsarena: error: argument --max-slowdown: a slowdown cannot be negative: {value!r} "
                   f"(see 'wsarena {command} --help')\n")


@pytest.mark.parametrize("command", ["tune", "report"])
@pytest.mark.parametrize("value", ["-0", "-0.0%", "-0e-2", "-.0%"])
def test_a_slowdown_of_minus_zero_is_not_said_to_be_negative(capsys, model, command, value):
    """-0 is zero: it was "a slowdown cannot be negative: '-0'"."""
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", value)
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: argument --max-slowdown: a slowdown is written without a sign: {value!r} "
                   f"(write 0) (see 'wsarena {command} --help')\n")


@pytest.mark.parametrize("command", ["tune", "report"])
@pytest.mark.parametrize("value", ["-inf", "-Infinity", "-nan"])
def test_a_negative_infinity_or_nan_slowdown_is_a_value_refused_as_no_number(capsys, model, command, value):
    """Not "expected one argument", as if ``-inf`` were an unknown option: the value is said to be no number."""
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", value)
    assert code == 2 and out == ""
    assert err == (f"wsarena: error: argument --max-slowdown: expected a percentage (2%) or a fraction (0.02), not "
                   f"{value!r} (see 'wsarena {command} --help')\n")


@pytest.mark.parametrize("command", ["tune", "report"])
@pytest.mark.parametrize(("value", "says"), [("x" * 5000, "expected a percentage"), ("-" + "1" * 5000, "negative"),
                                             ("1" * 5000 + "%", "finite"), ("9" * 300, "is read as a fraction")])
def test_a_long_slowdown_is_shortened_in_its_error(capsys, model, command, value, says):
    """As the rest of wsarena's errors shorten a value: one line of a readable length, not the whole value (and, for
    a fraction of 1 or more, the percentage it reads as not written out in all its digits)."""
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", value)
    assert (code, out) == (2, "") and says in err and err.count("\n") == 1 and len(err) < 250, err


LONG = "x" * 100_000


@pytest.mark.parametrize("command", ["tune", "report"])
@pytest.mark.parametrize(("flags", "says"), [
    (["--batch", LONG], "not an integer"), (["--batch", "-" + "9" * 4000], "must be >= 1"),
    (["--streams", LONG], "not an integer"), (["--passes", LONG], "--passes: expected distinct names"),
    (["--input-shape", LONG], "with integer dims"), (["--input-shape", " " * 100_000 + "=1,3,8,8"], "no input name"),
    (["--input-shape", "x=1x3x8x8", "--input-shape", "x=" + "1," * 50_000 + "1"], "given twice for input 'x'"),
    (["--input-shape", f"{LONG}=1x3x8x8", "--input-shape", f"{LONG}=1x3x8x8"], "given twice for input 'xxx"),
    (["--plot", " " * 100_000], "expected a file name"),
    (["--dtype", LONG], "invalid choice: 'xxx"), (["--layout", LONG], "invalid choice: 'xxx"),
    (["--format", LONG], "invalid choice: 'xxx"), (["--cudnn-api", LONG], "invalid choice: 'xxx"),
])
def test_a_long_value_is_shortened_in_its_error(capsys, model, command, flags, says):
    """As the rest of wsarena's errors shorten a value: a line of a readable length, not the whole value (a 100 kB
    argument gave a 100 kB error)."""
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", *flags)
    assert (code, out) == (2, "") and says in err and err.count("\n") == 1 and len(err) < 250, err[:300]


def test_a_long_cap_workspace_is_shortened_in_its_error(capsys, model):
    code, out, err = run_main(capsys, "report", model, "--backend", "cpu", "--cap-workspace", " " * 100_000)
    assert (code, out) == (2, "") and "expected a size or none" in err and len(err) < 250, err[:300]


@pytest.mark.parametrize(("flag", "says"), [
    (f"{LONG}=1x3x8x8", "no graph input 'xxx"),  # no such input
    ("x=8x3x" + "1" * 4000 + "x16", "the shape of input 'x' must be positive ints below 2**63, not (8, 3, 111"),
    # how many dims the cut leaves out, as reprlib's "(0, 0, 0, 0, 0, 0, ...)" (Python's Ellipsis, there) did not
    ("x=" + "0," * 50_000 + "0",
     "the shape of input 'x' must be positive ints below 2**63, not (0, 0, 0, 0, 0, 0, ... 49995 more)\n"),
])
def test_a_long_input_shape_is_shortened_in_the_models_error(capsys, tmp_path, flag, says):
    """The ONNX loader's refusal of an --input-shape quotes its name and shape shortened."""
    from .onnx_graphs import conv, save, vi, weight

    path = save(tmp_path / "m.onnx", [conv("stem", "x", "w", "y", pads=[1, 1, 1, 1])], [vi("x", ["N", 3, "H", "W"])],
                [weight("w", (8, 3, 3, 3))])
    code, out, err = run_main(capsys, "tune", str(path), "--backend", "cpu", "--input-shape", flag)
    assert (code, out) == (2, "") and says in err and err.count("\n") == 1 and len(err) < 400, err[:500]


def test_the_long_input_names_a_shape_with_no_name_leaves_open_are_shortened(capsys, tmp_path):
    """One --input-shape with no name, for a model of two inputs: the refusal lists the inputs, each shortened."""
    from .onnx_graphs import conv, save, vi, weight

    nodes = [conv("a", LONG, "w", "y", pads=[1, 1, 1, 1]), conv("b", LONG + "2", "w", "z", pads=[1, 1, 1, 1])]
    path = save(tmp_path / "m.onnx", nodes, [vi(LONG, ["N", 3, "H", "W"]), vi(LONG + "2", ["N", 3, "H", "W"])],
                [weight("w", (8, 3, 3, 3))])
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--input-shape", "1x3x8x8")
    assert (code, out) == (2, "") and "one input shape was given but the model has 2 inputs ('xxx" in err, err[:300]
    assert "x...x" in err and err.count("\n") == 1 and len(err) < 400, err[:300]


def test_a_long_input_name_is_shortened_in_the_warning_of_its_batch(capsys, tmp_path):
    """The warning that an input shape's batch is not --batch's names the input shortened, as an error would."""
    from .onnx_graphs import conv, save, vi, weight

    path = save(tmp_path / "m.onnx", [conv("stem", LONG, "w", "y", pads=[1, 1, 1, 1])], [vi(LONG, ["N", 3, "H", "W"])],
                [weight("w", (8, 3, 3, 3))])
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--input-shape", f"{LONG}=8x3x16x16")
    assert code == 0 and out, err[:300]
    assert err.startswith("wsarena: warning: --input-shape xxx") and "x...x" in err, err[:300]
    assert "x=8x3x16x16 has batch 8: " in err and err.count("\n") == 1 and len(err) < 250, err[:300]


@pytest.mark.parametrize("command", ["tune", "report"])
def test_an_option_after_max_slowdown_is_still_an_option(capsys, model, command):
    """Only what reads as a number is taken as the value: an option in its place is a missing value."""
    code, out, err = run_main(capsys, command, model, "--backend", "cpu", "--max-slowdown", "--format", "json")
    assert code == 2 and out == ""
    assert err.startswith("wsarena: error: argument --max-slowdown: expected one argument"), err


@pytest.mark.skipif(gpu_unusable_reason() is None, reason="a usable GPU is present")
def test_cudnn_without_a_gpu_exits_3(capsys, model):
    code, out, err = run_main(capsys, "tune", model, "--backend", "cudnn")
    assert code == 3 and out == "" and err.count("\n") == 1


def test_report_max_slowdown_is_the_plan_under_the_recommended_cap(capsys, model):
    d = tune_json(capsys, model, "--max-slowdown", "5%")
    code, out, err = run_main(capsys, "report", model, "--backend", "cpu", "--batch", "2", "--max-slowdown", "5%",
                              "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert r["cap_workspace_bytes"] == d["recommended_cap_bytes"] and r["max_slowdown"] == 0.05
    assert r["search"] == "exhaustive"
    assert r["arena_bytes"] == next(p["arena_bytes"] for p in d["curve"]
                                    if p["cap_workspace_bytes"] == d["recommended_cap_bytes"])
    code, out, err = run_main(capsys, "report", model, "--backend", "cpu", "--batch", "2", "--max-slowdown", "5%")
    assert code == 0, err
    # the table says where its cap came from: a cap the user never gave would otherwise look like one they did
    (cap,) = re.findall(r"  cap (.+?) \(the smallest within a 5% slowdown\)  ", out.splitlines()[1])
    assert (None if cap == "none" else wsarena.parse_size(cap)) == r["cap_workspace_bytes"]  # exactly this cap


def test_cache_info_and_clear(capsys, model, tmp_path, monkeypatch):
    code, out, _ = run_main(capsys, "cache", "info")
    assert (code, out) == (0, "the search cache is off (WSARENA_CACHE_DIR=off)\n")
    folder = tmp_path / "cache"
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(folder))
    wsarena._config._reset()  # as a new command reads it
    calls = tune_json(capsys, model)["distinct_calls"]
    code, out, _ = run_main(capsys, "cache", "info", "--format", "json")
    info = json.loads(out)
    assert code == 0 and info["directory"] == str(folder) and info["entries"] == calls
    assert info["max_size_bytes"] == 64 << 20
    assert [(e["backend"], e["entries"]) for e in info["environments"]] == [("cpu", calls)]
    code, out, _ = run_main(capsys, "cache", "info")
    assert code == 0 and out.splitlines()[0] == f"search cache: {folder} (from WSARENA_CACHE_DIR)"
    assert out.splitlines()[1].startswith(f"entries: {calls} (") and out.splitlines()[1].endswith("; limit 64 MiB)")
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "1048575")  # format_size's 1 MiB is a byte more
    wsarena._config._reset()
    code, out, _ = run_main(capsys, "cache", "info")
    assert code == 0 and out.splitlines()[1].endswith("; limit 1048575 B)")  # as the setting takes it back
    assert wsarena.parse_size(out.splitlines()[1].rpartition("; limit ")[2].rstrip(")")) == (1 << 20) - 1
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "none")
    wsarena._config._reset()
    code, out, _ = run_main(capsys, "cache", "info")
    assert code == 0 and out.splitlines()[1].endswith("; no limit)")
    code, out, _ = run_main(capsys, "cache", "clear")
    assert code == 0 and out.startswith(f"removed {calls} entries (") and out.endswith(f"from {folder}\n")
    code, out, _ = run_main(capsys, "cache", "clear", "--format", "json")
    assert json.loads(out) == {"directory": str(folder), "removed": 0, "unreadable": 0, "freed_bytes": 0}


def test_cache_clear_says_how_many_unreadable_files_it_removed(capsys, model, tmp_path, monkeypatch):
    """It counted them among the entries, where `cache info` lists them apart."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(folder))
    wsarena._config._reset()
    calls = tune_json(capsys, model)["distinct_calls"]
    (folder / "search" / ("0" * 40 + ".json")).write_text("not an entry")
    code, out, _ = run_main(capsys, "cache", "clear")
    assert code == 0 and out.startswith(f"removed {calls} entries and 1 unreadable file(s) ("), out


def test_cache_info_and_clear_escape_control_characters(capsys, model, tmp_path, monkeypatch):
    # a folder's name and an entry's strings (a file anyone may edit) reach a terminal: a newline would forge a line,
    # an escape sequence would drive the terminal
    folder = tmp_path / "ca\nche\x1b[2J"
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(folder))
    wsarena._config._reset()
    calls = tune_json(capsys, model)["distinct_calls"]
    entry = next((folder / "search").glob("*.json"))
    data = json.loads(entry.read_text())
    data["key"]["environment"]["device"] = "cpu\n  999  forged\x1b[31m"
    entry.write_text(json.dumps(data))
    code, out, _ = run_main(capsys, "cache", "info")
    escaped = str(folder).replace("\n", "\\n").replace("\x1b", "\\x1b")
    assert code == 0 and "\x1b" not in out and len(out.splitlines()) == 4, out
    assert out.splitlines()[0] == f"search cache: {escaped} (from WSARENA_CACHE_DIR)"
    assert "cpu\\n  999  forged\\x1b[31m" in out and f"{calls - 1}  cpu:" in out
    code, out, _ = run_main(capsys, "cache", "clear")
    assert code == 0 and out.endswith(f"from {escaped}\n") and len(out.splitlines()) == 1


@pytest.mark.parametrize("value", ["lots", "0", "-1MiB"])
def test_a_bad_cache_size_exits_2_naming_the_variable(capsys, model, monkeypatch, tmp_path, value):
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", value)
    wsarena._config._reset()
    for argv in (["cache", "info"], ["tune", model, "--backend", "cpu"]):
        code, out, err = run_main(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"wsarena: error: environment variable WSARENA_SEARCH_CACHE_MAX_SIZE={value!r}: ")
    assert not (tmp_path / "cache").exists()  # refused before anything was searched or saved


def test_cache_clear_needs_no_size_limit_and_clears_under_a_bad_one(capsys, model, monkeypatch, tmp_path):
    """Clearing reads no limit: a bad WSARENA_SEARCH_CACHE_MAX_SIZE (a typo the user may be clearing the cache to
    get past) made `cache clear` exit 2 and remove nothing, as `cache info`, which shows the limit, still does."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "cache"))
    wsarena._config._reset()
    calls = tune_json(capsys, model)["distinct_calls"]
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "64 MB of it")
    wsarena._config._reset()
    code, out, err = run_main(capsys, "cache", "clear", "--format", "json")
    assert (code, err) == (0, "") and json.loads(out)["removed"] == calls > 0
    assert not list((tmp_path / "cache" / "search").glob("*.json"))
    code, out, err = run_main(capsys, "cache", "info")
    assert code == 2 and err.startswith("wsarena: error: environment variable WSARENA_SEARCH_CACHE_MAX_SIZE=")


@pytest.mark.parametrize("var", ["WSARENA_CAP_WORKSPACE", "WSARENA_BACKEND", "WSARENA_DEBUG", "WSARENA_ALLOCATOR"])
def test_the_cache_command_reads_only_the_caches_settings(capsys, model, monkeypatch, tmp_path, var):
    # the command uses the folder and its size limit alone: a bad variable of another setting does not stop it
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "cache"))
    wsarena._config._reset()
    calls = tune_json(capsys, model)["distinct_calls"]
    monkeypatch.setenv(var, "lots")
    wsarena._config._reset()
    code, out, err = run_main(capsys, "cache", "info", "--format", "json")
    assert (code, err) == (0, "") and json.loads(out)["entries"] == calls
    assert json.loads(out)["source"] == "environment"  # the folder's origin, still its variable
    code, out, err = run_main(capsys, "cache", "clear", "--format", "json")
    assert (code, err) == (0, "") and json.loads(out)["removed"] == calls
    code, out, err = run_main(capsys, "report", model)  # a command that reads it still stops
    assert code == 2 and err.startswith(f"wsarena: error: environment variable {var}='lots': ")


def test_two_processes_tuning_at_once_lose_no_entry(model, tmp_path):
    env = {"WSARENA_CACHE_DIR": str(tmp_path / "cache")}
    argv = [sys.executable, "-m", "wsarena", "tune", model, "--backend", "cpu", "--format", "json"]
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}, **env}
    procs = [subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    calls = json.loads(results[0][0])["distinct_calls"]
    r = run_cli("cache", "info", "--format", "json", env=env)
    info = json.loads(r.stdout)
    assert info["entries"] == calls and info["unreadable"] == 0
    # later processes find every call: they time nothing, so their curves are the same to the last digit
    later = [run_cli("tune", model, "--backend", "cpu", "--format", "json", env=env) for _ in range(2)]
    assert [r.returncode for r in later] == [0, 0], later
    assert json.loads(later[0].stdout)["curve"] == json.loads(later[1].stdout)["curve"]
    assert json.loads(run_cli("cache", "info", "--format", "json", env=env).stdout)["entries"] == calls


@pytest.mark.parametrize("action", ["info", "clear"])
@pytest.mark.parametrize("where", ["a-file", "a-file/below"])
def test_a_cache_folder_that_cannot_be_listed_exits_3(capsys, monkeypatch, tmp_path, action, where):
    """A file where the folder should be: every search goes without the cache, which `cache info` must not show
    as an empty cache, and it is the environment, not the command, that is wrong."""
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / where))
    wsarena._config._reset()
    code, out, err = run_main(capsys, "cache", action)
    assert (code, out) == (3, "") and err.count("\n") == 1
    assert err.startswith(f"wsarena: error: cannot {'read' if action == 'info' else 'clear'} the search cache: ")
    assert "Not a directory" in err


def test_a_cache_folder_of_a_long_name_is_shortened_in_errors_and_warnings(capsys, model, monkeypatch, tmp_path):
    """WSARENA_CACHE_DIR of 10 kB, which no file system takes: `cache info` and `cache clear` quoted it whole in their
    error, and a search's warnings twice each (the folder, and the file the OSError names)."""
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / ("c" * 10_000)))
    wsarena._config._reset()
    for action in ("info", "clear"):
        code, out, err = run_main(capsys, "cache", action)
        assert (code, out) == (3, "") and err.count("\n") == 1 and len(err) < 400, err[:500]
        assert "File name too long" in err and "...ccc" in err, err
    code, out, err = run_main(capsys, "tune", model, "--backend", "cpu", "--apply")
    assert code == 0 and out.startswith("WSARENA_CAP_WORKSPACE="), err[:500]
    warned = err.splitlines()
    assert [w.split(":")[1] for w in warned] == [" warning"] * 2 and max(map(len, warned)) < 500, err[:1000]
    assert "cannot read the search cache in " in warned[0] and "cannot save to the search cache in " in warned[1]


def test_a_cache_folder_that_may_not_be_read_exits_3(capsys, monkeypatch, tmp_path):
    from pathlib import Path

    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path))
    wsarena._config._reset()

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)  # what another user's folder gives (root reads anything)
    code, out, err = run_main(capsys, "cache", "info")
    assert (code, out) == (3, "") and err.count("\n") == 1
    assert err.startswith("wsarena: error: cannot read the search cache: ") and "Permission denied" in err


@pytest.mark.parametrize("command", [["tune"], ["report", "--search", "exhaustive"],
                                     ["report", "--max-slowdown", "2%"]])
@pytest.mark.parametrize(("stop", "code", "says"), [(KeyboardInterrupt, 130, "wsarena: interrupted"),
                                                    (MemoryError, 3, "wsarena: error: out of memory")])
def test_work_stopped_midway_wipes_the_progress_bar(capsys, model, monkeypatch, command, stop, code, says):
    """On a terminal the bar is drawn in place, with no newline: Ctrl-C or an error midway must not print its line
    onto the end of the bar."""
    from wsarena.backends._cpu_backend import CpuBackend

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    # A search's timing out of memory is no error (the call takes the heuristic order): memory fails the ranking
    name = "measure" if stop is KeyboardInterrupt else "candidates"
    real = getattr(CpuBackend, name)
    calls = []

    def stopping(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # the first layer's three passes, then the second layer's first
            raise stop()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuBackend, name, stopping)
    got, out, err = run_main(capsys, command[0], model, "--backend", "cpu", *command[1:])
    assert (got, out) == (code, "")
    bar = re.search(r"\r(\[[#.]+\] 1/4 stem *)", err)
    assert bar, err  # the bar was drawn ...
    wipe = r"\r {" + str(len(bar[1])) + r",}\r"  # ... and wiped before the line
    assert re.search(re.escape(bar[1]) + wipe + re.escape(says) + r"[^\r\n]*\n\Z", err), err


def _interrupt():
    raise KeyboardInterrupt


class _LeftOnSecondCtrlC(list):
    """The bars drawn (wsarena.cli's ``_bars``), whose remove() raises as a second Ctrl-C landing there would."""

    def remove(self, value):
        _interrupt()


@pytest.mark.parametrize("command", [["tune"], ["report", "--search", "exhaustive"]])
@pytest.mark.parametrize("where", ["in the wipe", "as the wipe is flushed", "as the bar is let go"])
def test_a_second_ctrl_c_as_the_bar_is_wiped_still_wipes_it(capsys, model, monkeypatch, command, where):
    """A second Ctrl-C (a key pressed twice, or held down) that lands as the first one's cleanup wipes the bar: in
    its wipe, before the blanks are out, or as the bar leaves the bars a warning wipes, where it was let go before it
    was wiped. The bar was left drawn, and "wsarena: interrupted" said onto its end, on the bar's row: it is wiped,
    and the line starts a row of its own."""
    from wsarena import cli
    from wsarena.backends._cpu_backend import CpuBackend

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    real, calls = CpuBackend.measure, []

    def measure(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # the first layer's three passes, then the second layer's first
            _interrupt()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuBackend, "measure", measure)
    write, flush, second = sys.stderr.write, sys.stderr.flush, []

    def wiping(text):
        if text.startswith("\r ") and not second:  # the bar's wipe: blanks between two "\r"
            if where == "in the wipe":
                second.append(1)
                _interrupt()
            second.append(0)
        return write(text)

    def flushing():
        flush()
        if second == [0]:
            second.append(1)
            _interrupt()

    monkeypatch.setattr(sys.stderr, "write", wiping)
    monkeypatch.setattr(sys.stderr, "flush", flushing)
    if where == "as the bar is let go":
        monkeypatch.setattr(cli, "_bars", _LeftOnSecondCtrlC())
    try:
        code, out, err = run_main(capsys, command[0], model, "--backend", "cpu", *command[1:])
    except KeyboardInterrupt:  # caught here: left to pytest, it would end the whole run
        pytest.fail("the Ctrl-C left main()")
    assert (code, out) == (130, "")
    assert where == "as the bar is let go" or second[-1] == 1  # the second Ctrl-C landed where it was meant to
    bar = re.search(r"\r(\[[#.]+\] 1/4 stem *)", err)
    assert bar, err  # the bar was drawn ...
    wipe = r"\r {" + str(len(bar[1])) + r",}\r"  # ... and wiped before the line, which is said once
    assert re.search(re.escape(bar[1]) + r"(" + wipe + r")+wsarena: interrupted\n\Z", err), err


@pytest.mark.parametrize("command", [["report"], ["report", "--search", "exhaustive"], ["tune"]])
def test_a_ctrl_c_in_a_finalizer_still_stops_the_command(capsys, model, monkeypatch, command):
    """A Ctrl-C that lands in a finalizer (the collector runs them anywhere, and planning from device properties
    destroys cuDNN descriptors all the time) raises KeyboardInterrupt there, which Python only reports ("Exception
    ignored in ..."): the command went on, printed the whole report and exited 0 (2 of 30 Ctrl-Cs during
    ``wsarena report inception_v3 --device-properties``). It stops after that layer, 130, and the hook that keeps
    such interrupts is Python's again afterwards."""
    import weakref

    from wsarena import planner

    real, calls = planner.select, []

    def select(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first layer's second pass
            weakref.finalize(type("Owner", (), {})(), _interrupt)  # collected at once: its finalizer runs here
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "select", select)
    hook = sys.unraisablehook
    assert run_main(capsys, command[0], model, "--backend", "cpu", *command[1:]) == (130, "", "wsarena: interrupted\n")
    assert len(calls) == 3 and sys.unraisablehook is hook


class _InterruptedAtTheEnd(list):
    """The interrupts kept (wsarena.cli's ``_lost``), whose clear() as the command's blocks end raises as a Ctrl-C
    landing there would."""

    def clear(self):
        super().clear()
        _interrupt()


@pytest.mark.parametrize("first", [None, KeyboardInterrupt], ids=["done", "interrupted"])
def test_a_ctrl_c_as_the_command_ends_exits_130_with_one_line(capsys, model, monkeypatch, first):
    """A Ctrl-C that lands as the command's blocks end, after the command is done (its output written) or after a
    first Ctrl-C's line (a key pressed twice, or held down: 1 of 10 storms of SIGINT every 2 ms gave it), left
    main() as a traceback. It exits 130, with the line said once."""
    from wsarena import cli, planner

    if first is not None:
        monkeypatch.setattr(planner, "select", lambda *args, **kwargs: _interrupt())
    monkeypatch.setattr(cli, "_lost", _InterruptedAtTheEnd())
    try:
        code, out, err = run_main(capsys, "report", model, "--backend", "cpu")
    except KeyboardInterrupt:  # caught here: left to pytest, it would end the whole run
        pytest.fail("the Ctrl-C left main()")
    assert (code, err) == (130, "wsarena: interrupted\n")
    assert ("wsarena: interrupted" not in out) and (out.startswith("wsarena ") if first is None else out == "")


@pytest.mark.parametrize("case", ["help", "error", "second"])
def test_a_ctrl_c_where_no_line_said_it_exits_130_with_the_line_said_once(capsys, model, monkeypatch, case):
    """A Ctrl-C that lands where _main() no longer catches it, and before the line is said, exited 130 with nothing
    said: as --help's exit (its SystemExit) leaves the command's blocks, or just after an error's line. A second
    one that lands as the first one's line is said is the same interruption: the line once."""
    from wsarena import cli, planner

    say, said = cli._say, []

    def said_then_interrupted(line):  # a Ctrl-C that lands just after the first line is written
        say(line)
        said.append(line)
        if len(said) == 1:
            _interrupt()

    if case == "help":
        monkeypatch.setattr(cli, "_lost", _InterruptedAtTheEnd())
        argv = ["report", "--help"]
    else:
        monkeypatch.setattr(cli, "_say", said_then_interrupted)
        argv = ["report", model, "--backend", "cpu", "--batch", "0"]
        if case == "second":
            monkeypatch.setattr(planner, "select", lambda *args, **kwargs: _interrupt())
            argv = argv[:-2]
    try:
        code, out, err = run_main(capsys, *argv)
    except KeyboardInterrupt:  # caught here: left to pytest, it would end the whole run
        pytest.fail("the Ctrl-C left main()")
    assert code == 130 and err.endswith("wsarena: interrupted\n") and err.count("wsarena: interrupted") == 1, err
    if case == "help":
        assert out.startswith("usage: wsarena report") and err == "wsarena: interrupted\n"
    else:
        assert out == "" and err.count("\n") == (2 if case == "error" else 1), err
        assert err.startswith("wsarena: error: argument --batch" if case == "error" else "wsarena: interrupted"), err


@pytest.mark.parametrize("command", [["tune"], ["report", "--search", "exhaustive"]])
def test_a_warning_midway_starts_a_line_of_its_own_and_the_bar_goes_on(capsys, model, monkeypatch, command):
    """A warning while the bar is drawn (a bad search cache file found at the tenth layer, say) wipes the bar
    first, instead of printing onto the end of it; the bar is drawn again below it."""
    import warnings

    from wsarena.backends._cpu_backend import CpuBackend
    from wsarena.errors import SearchCacheWarning

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    real = CpuBackend.measure
    calls = []

    def measure(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the second layer's first pass: the bar shows the first layer done
            warnings.warn("a warning midway", SearchCacheWarning, stacklevel=1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuBackend, "measure", measure)
    code, out, err = run_main(capsys, command[0], model, "--backend", "cpu", *command[1:])
    assert code == 0 and out
    bar = re.search(r"\r(\[[#.]+\] 1/4 stem *)", err)
    assert bar, err
    wipe = r"\r {" + str(len(bar[1])) + r",}\r"
    assert re.search(re.escape(bar[1]) + wipe + r"wsarena: warning: a warning midway\n\r\[", err), err


@pytest.mark.parametrize("command", [["tune"], ["report", "--search", "exhaustive"]])
def test_plot_without_matplotlib_fails_before_searching(capsys, model, monkeypatch, tmp_path, command):
    """Not after a search that can take minutes on a GPU, to say that the plot cannot be drawn."""
    from wsarena.backends._cpu_backend import CpuBackend

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without wsarena[plot] has

    def refuse(*args, **kwargs):
        raise AssertionError("searched although the plot could never be drawn")

    monkeypatch.setattr(CpuBackend, "measure", refuse)
    code, out, err = run_main(capsys, command[0], model, "--backend", "cpu", *command[1:],
                              "--plot", str(tmp_path / "p.png"))
    assert (code, out) == (3, "") and err == "wsarena: error: --plot needs matplotlib: pip install 'wsarena[plot]'\n"


@pytest.mark.parametrize("command", [["tune"], ["report", "--search", "exhaustive"],
                                     ["report", "--max-slowdown", "2%"]])
@pytest.mark.parametrize(("where", "why"), [("", "Is a directory"), ("no-such-folder/p.png", "No such file"),
                                            ("small.json/p.png", "Not a directory")])
def test_a_plot_that_cannot_be_written_there_fails_before_searching(capsys, model, monkeypatch, tmp_path, command,
                                                                    where, why):
    """A folder, or a file in a folder that is missing (or is a file): the error the plot would get after the
    search, before it, and nothing left in the folder by finding it out."""
    pytest.importorskip("matplotlib")
    from wsarena.backends._cpu_backend import CpuBackend

    def refuse(*args, **kwargs):
        raise AssertionError("searched although the plot could never be written")

    monkeypatch.setattr(CpuBackend, "measure", refuse)
    path = os.path.join(str(tmp_path), where)
    code, out, err = run_main(capsys, command[0], model, "--backend", "cpu", *command[1:], "--plot", path)
    assert (code, out) == (3, "") and err.startswith(f"wsarena: error: cannot write the plot to {path!r}: {why}"), err
    assert err.count("\n") == 1 and os.listdir(tmp_path) == ["small.json"]


@pytest.mark.parametrize(("variable", "argv"), [
    ("WSARENA_BACKEND", ["tune", "MODEL", "--backend", "cpu"]),
    ("WSARENA_CAP_WORKSPACE", ["tune", "MODEL", "--backend", "cpu"]),
    ("WSARENA_ALGO_SEARCH", ["tune", "MODEL", "--backend", "cpu"]),
    ("WSARENA_CAP_WORKSPACE", ["report", "MODEL", "--backend", "cpu", "--max-slowdown", "2%"]),
    ("WSARENA_ALGO_SEARCH", ["report", "MODEL", "--backend", "cpu", "--max-slowdown", "2%"]),
])
def test_an_invalid_variable_of_a_setting_the_command_decides_does_not_matter(capsys, model, monkeypatch, variable,
                                                                             argv):
    """A flag replaces its setting's variable, as the README says of every setting; tune and --max-slowdown decide
    the cap and the search themselves, so their variables are replaced as well, not an error."""
    monkeypatch.setenv(variable, "bogus")
    wsarena._config._reset()
    code, out, err = run_main(capsys, *[model if a == "MODEL" else a for a in argv])
    assert (code, err) == (0, "") and out


@pytest.mark.parametrize(("variable", "argv"), [
    ("WSARENA_BACKEND", ["tune", "MODEL"]),
    ("WSARENA_CUDNN_API", ["tune", "MODEL", "--backend", "cpu"]),
    ("WSARENA_BACKEND", ["report", "MODEL", "--max-slowdown", "2%"]),
    ("WSARENA_CUDNN_HEURISTIC", ["report", "MODEL", "--backend", "cpu", "--max-slowdown", "2%"]),
])
def test_an_invalid_variable_of_a_setting_left_to_it_still_stops_the_command(capsys, model, monkeypatch, variable,
                                                                            argv):
    """The other half of the rule: what neither a flag nor the command decides is read from its variable, and an
    invalid one is the one-line error it names (exit 2), not a silent default."""
    monkeypatch.setenv(variable, "bogus")
    wsarena._config._reset()
    code, out, err = run_main(capsys, *[model if a == "MODEL" else a for a in argv])
    assert (code, out) == (2, "") and f"{variable}='bogus'" in err and err.count("\n") == 1


@pytest.mark.parametrize("command", [["tune"], ["report"]])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError(28, "No space left on device")])
@pytest.mark.parametrize("before", [None, b"the plot of an earlier run"])
@pytest.mark.parametrize("where", ["drawing", "writing"])
def test_a_plot_stopped_midway_leaves_no_half_written_file(capsys, model, monkeypatch, tmp_path, command, stop, before,
                                                           where):
    """Ctrl-C or a full disk while the PNG is drawn or written: the path holds what it held before (nothing, or the
    earlier plot), never part of a PNG, and no temporary file is left beside it."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    save, replace = matplotlib.figure.Figure.savefig, os.replace

    def half(self, fname, **kwargs):  # a part of the PNG is out when it stops
        save(self, fname, **kwargs)
        if hasattr(fname, "truncate"):
            fname.truncate(100)
        else:
            os.truncate(fname, 100)
        if where == "drawing":
            raise stop

    def stopped(src, dst):
        if str(dst).endswith("curve.png"):
            raise stop
        replace(src, dst)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half)
    if where == "writing":
        monkeypatch.setattr(os, "replace", stopped)
    target = tmp_path / "plots" / "curve.png"
    target.parent.mkdir()
    if before is not None:
        target.write_bytes(before)
    code, out, err = run_main(capsys, command[0], model, "--backend", "cpu", "--plot", str(target))
    assert code == (130 if stop is KeyboardInterrupt else 3) and out == "", err
    assert os.listdir(target.parent) == ([] if before is None else ["curve.png"])
    if before is not None:
        assert target.read_bytes() == before


@pytest.mark.parametrize("command", [["tune"], ["report"]])
@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="no /dev/fd")
def test_a_plot_goes_into_a_pipe_named_by_dev_fd(capsys, model, command):
    """``--plot /dev/stdout | viewer``, or a shell's ``--plot >(viewer)`` (``/dev/fd/63``): the path leads to a pipe,
    whose realpath (``/proc/self/fd/pipe:[N]``) is no file's, which failed the plot with "No such file"."""
    pytest.importorskip("matplotlib")
    import threading

    read, write = os.pipe()
    got = []
    reader = threading.Thread(target=lambda: got.append(os.fdopen(read, "rb").read()))
    reader.start()
    try:
        code, out, err = run_main(capsys, command[0], model, "--backend", "cpu", "--plot", f"/dev/fd/{write}")
    finally:
        os.close(write)
        reader.join(timeout=60)
    assert (code, err) == (0, "") and out
    assert got and got[0][:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", [["tune"], ["report"], ["report", "--max-slowdown", "2%"]])
def test_a_plot_draws_dollar_signs_in_names_as_they_are(capsys, tmp_path, command):
    """A model's file name and its layers' names are any text: a $ pair in them is no mathematics for matplotlib
    to parse (``$^^$`` it cannot), which failed the plot after the search, with matplotlib's parser's lines."""
    pytest.importorskip("matplotlib")
    layers = [dict(layer, name=f"{layer['name']}$^^$ $x_1$") for layer in MODEL["layers"]]
    path = tmp_path / "model $^^$.json"
    path.write_text(json.dumps({"layers": layers}))
    target = tmp_path / "p.png"
    code, out, err = run_main(capsys, command[0], str(path), "--backend", "cpu", *command[1:], "--plot", str(target))
    assert (code, err) == (0, "") and out
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_a_plot_written_over_an_earlier_one_keeps_its_permissions(capsys, model, tmp_path):
    """Renamed over the earlier file, the new one has the earlier one's permissions, as a file written over in place
    has: a private plot stays private; a new one has the umask's, as open() gives."""
    pytest.importorskip("matplotlib")
    private, new = tmp_path / "private.png", tmp_path / "new.png"
    private.write_bytes(b"old")
    private.chmod(0o600)
    for path in (private, new):
        code, _, err = run_main(capsys, "report", model, "--backend", "cpu", "--plot", str(path))
        assert code == 0, err
        assert path.read_bytes()[:4] == b"\x89PNG"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask


def test_a_plot_may_have_the_longest_name_the_file_system_takes(capsys, model, tmp_path):
    """The file written beside it first has a name of its own, not the plot's lengthened past that limit."""
    pytest.importorskip("matplotlib")
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = tmp_path / ("p" * (longest - 4) + ".png")
    code, _, err = run_main(capsys, "report", model, "--backend", "cpu", "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("command", [["tune"], ["report"]])
def test_a_plot_replaces_the_file_a_link_names_and_writes_into_what_is_no_file(capsys, model, tmp_path, command):
    """The PNG goes where the path leads: through a symbolic link into the file it names (the link stays), and
    into a path that is no regular file (a named pipe, /dev/stdout) as it is, since nothing can be renamed over
    it."""
    pytest.importorskip("matplotlib")
    real, link = tmp_path / "real.png", tmp_path / "link.png"
    real.write_bytes(b"old")
    link.symlink_to(real)
    code, _, err = run_main(capsys, command[0], model, "--backend", "cpu", "--plot", str(link))
    assert code == 0, err
    assert link.is_symlink() and real.read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(tmp_path)) == ["link.png", "real.png", "small.json"]

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    code, _, err = run_main(capsys, command[0], model, "--backend", "cpu", "--plot", str(fifo))
    reader.join(timeout=60)
    assert code == 0, err
    assert got and got[0][:4] == b"\x89PNG" and fifo.is_fifo()
