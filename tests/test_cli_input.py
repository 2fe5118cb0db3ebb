"""The command line with awkward input: where the plot goes, warnings, --streams, ONNX inputs, odd layer names,
and the hint an error about an unplannable ONNX node gives; for `report` and `tune` alike."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from onnx import TensorProto, helper

from wsarena import configure, parse_size
from wsarena._sizes import short_repr
from wsarena.cli import main

from .cli_helpers import run_cli, run_main
from .onnx_graphs import conv, save, vi, weight

PNG = b"\x89PNG\r\n\x1a\n"


def lost_conv_model(tmp_path, name="lost"):
    """Two convs; the second reads a tensor reshaped to a runtime shape, so its spatial size stays unknown."""
    nodes = [conv("known", "x", "w", "y0", pads=[1, 1, 1, 1]), helper.make_node("Reshape", ["y0", "s"], ["r"]),
             conv(name, "r", "w", "y1")]
    inputs = [vi("x", [1, 4, 8, 8]), helper.make_tensor_value_info("s", TensorProto.INT64, [4])]
    return save(tmp_path / "lost.onnx", nodes, inputs, [weight("w", (4, 4, 3, 3))])


TUNE = ("tune", "--max-slowdown", "50%")  # any slowdown: these tests look at the output, not the choice


def small_model(tmp_path, n=3):
    """A JSON model of ``n`` small layers, quick to tune."""
    layers = [{"name": f"c{i}", "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3], "padding": 1}
              for i in range(n)]
    path = tmp_path / "small.json"
    path.write_text(json.dumps(layers))
    return str(path)

# ----------------------------------------------------------------------------------------------------- --plot


@pytest.mark.parametrize("command", [("report",), TUNE])
def test_the_plot_is_written_exactly_where_asked(capsys, tmp_path, command):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    model = small_model(tmp_path)
    target = tmp_path / "workspace-plot"  # no extension: matplotlib alone would write workspace-plot.png
    code, _, err = run_main(capsys, *command, model, "--backend", "cpu", "--plot", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == PNG and sorted(os.listdir(tmp_path)) == ["small.json", "workspace-plot"]


@pytest.mark.parametrize("command", [("report",), TUNE])
@pytest.mark.parametrize("dash", ["-", " - "])
def test_a_plot_to_a_dash_is_refused_and_nothing_written(capsys, tmp_path, monkeypatch, command, dash):
    """'-' reads as stdout, which takes the command's output, and a PNG there is binary on a terminal: it was
    written, after the search, to a file named '-'. ./- names that file."""
    monkeypatch.chdir(tmp_path)
    model = small_model(tmp_path)
    code, out, err = run_main(capsys, *command, model, "--backend", "cpu", "--plot", dash)
    assert (code, out) == (2, "") and sorted(os.listdir(tmp_path)) == ["small.json"]
    assert err == (f"wsarena: error: argument --plot: expected a file name, not {dash!r}: the PNG is not written to "
                   f"stdout, which takes the output (./- names a file '-') (see 'wsarena {command[0]} --help')\n")


@pytest.mark.parametrize("command", [("report",), TUNE])
def test_a_plot_to_a_file_named_dash_is_written_through_its_path(capsys, tmp_path, monkeypatch, command):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    monkeypatch.chdir(tmp_path)
    model = small_model(tmp_path)
    code, _, err = run_main(capsys, *command, model, "--backend", "cpu", "--plot", "./-")
    assert code == 0, err
    assert (tmp_path / "-").read_bytes()[:8] == PNG


@pytest.mark.parametrize("command", [("report",), TUNE])
def test_a_plot_path_that_cannot_be_written_exits_3(capsys, tmp_path, command):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    model = small_model(tmp_path)
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for path, why in ((folder, "Is a directory"), (tmp_path / "missing" / "p.png", "No such file or directory")):
        code, out, err = run_main(capsys, *command, model, "--backend", "cpu", "--plot", str(path))
        assert (code, out) == (3, "")
        assert err == f"wsarena: error: cannot write the plot to {str(path)!r}: {why}\n"
    assert sorted(os.listdir(tmp_path)) == ["a-folder", "small.json"] and os.listdir(folder) == []  # no .png


@pytest.mark.parametrize("command", [("report",), TUNE])
def test_a_plot_over_the_model_file_is_refused_and_the_model_kept(capsys, tmp_path, command, monkeypatch):
    """As a compiler refuses an output that is its input: the PNG would replace the model file. Said with the help
    that lists the flags, as the command's other refusals of what its flags name together are."""
    model = small_model(tmp_path)
    before = (tmp_path / "small.json").read_bytes()
    monkeypatch.chdir(tmp_path)
    for plot in (model, "small.json", "./small.json"):
        code, out, err = run_main(capsys, *command, model, "--backend", "cpu", "--plot", plot)
        assert (code, out) == (2, "")
        assert err == (f"wsarena: error: --plot {plot!r} is the model file; the plot would replace it (see 'wsarena "
                       f"{command[0]} --help')\n")
    assert (tmp_path / "small.json").read_bytes() == before


@pytest.mark.parametrize("command", [("report",), ("tune", "--passes", "fwd")])
def test_a_plot_named_as_a_zoo_model_is_written_over_a_file_of_that_name(capsys, tmp_path, command, monkeypatch):
    """A zoo name names no file: the loader reads the zoo model whatever the working directory holds. A second
    `wsarena report mobilenet_v2 --plot mobilenet_v2` was refused, the first one's plot called the model file."""
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mobilenet_v2").write_bytes(b"an earlier plot")
    code, out, err = run_main(capsys, *command, "mobilenet_v2", "--backend", "cpu", "--plot", "mobilenet_v2")
    assert code == 0, err
    assert "mobilenet_v2" in out and (tmp_path / "mobilenet_v2").read_bytes()[:8] == PNG


def test_a_plot_over_the_device_properties_file_is_refused_and_the_file_kept(capsys, tmp_path, monkeypatch):
    """The --device-properties file is an input too, read before the plot is drawn (and made only on the GPU it
    describes): the PNG would replace it."""
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")
    from wsarena import planner
    from wsarena.backends import get_backend

    monkeypatch.setattr(planner, "device_properties_backend", lambda text, source: get_backend("cpu"))  # no cuDNN
    props = tmp_path / "props.json"
    props.write_text("{}")
    code, out, err = run_main(capsys, "report", small_model(tmp_path), "--device-properties", str(props),
                              "--plot", str(props))
    assert (code, out) == (2, "") and props.read_text() == "{}" and err.count("\n") == 1
    assert err == (f"wsarena: error: --plot {str(props)!r} is the --device-properties file; the plot would replace "
                   "it (see 'wsarena report --help')\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose writes fail")
def test_a_plot_on_a_full_device_exits_3(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib (wsarena[plot])")

    def stat(path):
        with contextlib.suppress(FileNotFoundError):
            return os.stat(path)
        return None

    before = stat("/dev/full.png")
    code, out, err = run_main(capsys, "report", small_model(tmp_path), "--backend", "cpu", "--plot", "/dev/full")
    assert (code, out) == (3, "")
    assert err == "wsarena: error: cannot write the plot to '/dev/full': No space left on device\n"
    assert stat("/dev/full.png") == before  # not written beside it


LONG_DIR = "d/" * 5000  # a path of 10 kB, past what any file system takes (4 kB)


@pytest.mark.parametrize(("argv", "says", "name"), [
    (["report", LONG_DIR + "model.onnx"], "wsarena: error: cannot read 'd/d/", "/model.onnx': File name too long"),
    (["tune", LONG_DIR + "model.json"], "wsarena: error: cannot read 'd/d/", "/model.json': File name too long"),
    (["report", LONG_DIR + "resnet"], "wsarena: error: unknown model 'd/d/", "/resnet': not a zoo model"),
    (["report", "vgg16", "--plot", LONG_DIR + "plot.png"], "wsarena: error: cannot write the plot to 'd/d/",
     "/plot.png': "),
    (["tune", "vgg16", "--plot", LONG_DIR + "curve.png"], "wsarena: error: cannot write the plot to 'd/d/",
     "/curve.png': "),
    (["report", "vgg16", "--device-properties", LONG_DIR + "gpu.json", "--backend", "cudnn"],
     "wsarena: error: cannot read the device properties 'd/d/", "/gpu.json': "),
])
def test_a_long_path_is_shortened_in_its_error_and_keeps_its_file_name(capsys, argv, says, name):
    """The model, --plot and --device-properties were quoted whole: a 10 kB path gave a 10 kB line. They are cut as
    wsarena's other errors cut a long value, in the folders, so that the file name can be read."""
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    backend = [] if "--backend" in argv else ["--backend", "cpu"]
    code, out, err = run_main(capsys, *argv, *backend)
    assert code in (2, 3) and out == "" and err.startswith(says), err[:300]
    assert name in err and "d..." in err and err.count("\n") == 1 and len(err) < 300, err[:400]


CONV = '{"name": "c", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]'


@pytest.mark.parametrize(("layer", "says"), [
    ('{"name": "' + "n" * 10_000 + '", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3], "padding": -1}',
     "layer 'nnnnnnnnnnnnnnnnnnnnnnnnnnn...nnnnnnnnnnnnnnnnnnnnnnnnnnnn': padding=(-1, -1) must be >= 0"),
    (CONV + ', "stride": [' + "1, " * 999 + "1]}",
     "stride=[1, 1, 1, 1, 1, 1, ... 994 more] must have one entry per spatial dimension (2)"),
    ('{"name": "c", "input_shape": [' + "1, " * 99 + '1], "weight_shape": [4, 3, 3, 3]}',
     "input_shape=[1, 1, 1, 1, 1, 1, ... 94 more] must have 3, 4 or 5 entries"),
    (CONV + ', "stride": "' + "x" * 1000 + '"}', "stride must be an integer, not 'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxx"),
    (CONV + ', "stride": [[' + "1, " * 999 + "1]]}",
     "stride[0] must be an integer, not [1, 1, 1, 1, 1, 1, ... 994 more]"),
    (CONV + ', "groups": 1' + "0" * 1000 + "}", "groups=100000000000000000...0000000000000000000 is above 2**31 - 1"),
    (CONV + ', "groups": 1' + "0" * 4000 + "}", "groups=an integer of 13288 bits is above 2**31 - 1"),
    # as far below: a negative of 1,000 digits was quoted whole
    (CONV + ', "groups": -1' + "0" * 1000 + "}", "groups must be >= 1, not -10000000000000000...0000000000000000000"),
    (CONV + ', "padding": -1' + "0" * 1000 + "}",
     "padding=(-10000000000000000...0000000000000000000, -10000000000000000...0000000000000000000) must be >= 0"),
    (CONV + ', "stride": [1, -1' + "0" * 1000 + "]}",
     "stride=(1, -10000000000000000...0000000000000000000) must be >= 1 in every dimension"),
    ('{"name": "c", "input_shape": [1, 3, 8, -1' + "0" * 1000 + '], "weight_shape": [4, 3, 3, 3]}',
     "input_shape[3] must be >= 1, not -10000000000000000...0000000000000000000"),
    ("[[" + "1, " * 999 + "1]]",  # said as JSON's kind of value, as a top-level one is, not quoted
     "layers[0] must be an object with name, input_shape and weight_shape, not an array\n"),
])
def test_a_long_value_in_a_layer_list_is_shortened_in_its_error(capsys, tmp_path, layer, says):
    """The JSON layer list's refusals quoted a value whole: a 10 kB layer name or a thousand strides gave a line as
    long; they are cut as wsarena's other errors cut a value."""
    path = tmp_path / "m.json"
    path.write_text(layer if layer.startswith("[") else f"[{layer}]")
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu")
    assert (code, out) == (2, "") and says in err and err.count("\n") == 1 and len(err) < 400, err[:500]


@pytest.mark.parametrize(("argv", "says"), [
    (["report", "vgg16", "extra"], "unrecognized arguments: extra (see 'wsarena report --help')"),
    (["tune", "vgg16", "--batch", "2", "one", "two"], "unrecognized arguments: one two (see 'wsarena tune --help')"),
    (["cache", "info", "--bogus"], "unrecognized arguments: --bogus (see 'wsarena cache --help')"),
    (["report", "vgg16", "x" * 100_000],
     f"unrecognized arguments: {'x' * 27}...{'x' * 28} (see 'wsarena report --help')"),
])
def test_arguments_left_over_are_named_shortened_with_the_subcommands_help(capsys, argv, says):
    """argparse leaves them to the top parser: "(see 'wsarena --help')", which does not list the subcommand's flags,
    and every one of them whole (a 100 kB argument, a 100 kB line)."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err) == (2, "", f"wsarena: error: {says}\n")


@pytest.mark.parametrize(("argv", "says"), [
    (["report", "vgg16", "--apply"], "--apply (see 'wsarena report --help'); tune takes --apply"),
    (["report", "vgg16", "--apply", "--app"], "--apply --app (see 'wsarena report --help'); tune takes --apply"),
    (["tune", "vgg16", "--search", "exhaustive"],
     "--search exhaustive (see 'wsarena tune --help'); report takes --search"),
    (["tune", "vgg16", "--se=heuristic", "--device-properties", "p.json", "--app"],
     ("--se=heuristic --device-properties p.json (see 'wsarena tune --help'); report takes --search and "
      "--device-properties")),
    (["info", "--batch", "4", "--apply", "extra"],
     "--batch 4 --apply extra (see 'wsarena info --help'); report and tune take --batch; tune takes --apply"),
    (["cache", "clear", "--bogus", "-"], "--bogus - (see 'wsarena cache --help')"),
])
def test_options_of_another_command_left_over_are_said_to_be_its(capsys, argv, says):
    """`wsarena report vgg16 --apply` was "unrecognized arguments: --apply", as for an option that no command takes:
    that tune takes it is said, with the option's full name where it was abbreviated (--se, report's --search)."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err) == (2, "", f"wsarena: error: unrecognized arguments: {says}\n")


@pytest.mark.parametrize(("argv", "says"), [
    (["--bogus", "report", "vgg16"], "unrecognized arguments before the command: --bogus (see 'wsarena --help')"),
    (["-v", "cache", "info"], "unrecognized arguments before the command: -v (see 'wsarena --help')"),
    (["--bogus", "report", "vgg16", "--bad"],
     ("unrecognized arguments before the command: --bogus (see 'wsarena --help'), and after it: --bad "
      "(see 'wsarena report --help')")),
    (["--batch=4", "--x", "--dtype=float16", "--batch=8", "tune", "vgg16"],
     ("unrecognized arguments before the command: --batch=4 --x --dtype=float16 --batch=8 (see 'wsarena --help'); "
      "tune's own options (--batch, --dtype) go after 'tune'")),
    (["--format=json", "info"],
     ("unrecognized arguments before the command: --format=json (see 'wsarena --help'); info's own options "
      "(--format) go after 'info'")),
])
def test_arguments_left_over_before_the_command_are_said_with_the_top_help(capsys, argv, says):
    """An unknown option before the command is the top parser's, whose help lists the options taken there: argparse
    puts them in one list with the command's own, and the error pointed at the command's help, which lists options
    that are not taken there. One of the command's own, given before it, is said to go after it."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err) == (2, "", f"wsarena: error: {says}\n")


@pytest.mark.parametrize(("argv", "says"), [
    (["--bogus", "report"],
     ("unrecognized arguments before the command: --bogus (see 'wsarena --help'), and after it: the following "
      "arguments are required: model (see 'wsarena report --help')")),
    (["-v", "tune", "vgg16", "--batch", "x"],
     ("unrecognized arguments before the command: -v (see 'wsarena --help'), and after it: argument --batch: not an "
      "integer: 'x' (see 'wsarena tune --help')")),
    (["--batch=4", "report"],
     ("unrecognized arguments before the command: --batch=4 (see 'wsarena --help'), and after it: the following "
      "arguments are required: model (see 'wsarena report --help'); report's own options (--batch) go after "
      "'report'")),
    (["report"], "the following arguments are required: model (see 'wsarena report --help')"),
])
def test_arguments_before_the_command_are_said_with_the_commands_own_error(capsys, argv, says):
    """The command's own error (its model missing, a value refused) was all that was said, where an option before
    the command, none of the top parser's, was left unnamed: argparse says its leftovers only after the command's
    parser is done, which stopped at its error."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err) == (2, "", f"wsarena: error: {says}\n")


@pytest.mark.parametrize(("argv", "command"), [
    (["--", "report", "vgg16"], "report"), (["--", "tune", "vgg16", "--batch", "2"], "tune"), (["--"], "report"),
    (["--bogus", "--", "tune"], "tune"), (["--", "--version"], "report"), (["--", "bogus"], "report"),
])
def test_a_double_dash_before_the_command_is_said_to_go_after_it(capsys, argv, command):
    """`wsarena -- report vgg16` was argparse's "invalid choice: '--'" (3.11's argparse takes the '--' for the
    command, where 3.13's drops it and runs the command): it is refused on each Python, with where a '--' goes."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: '--' goes after the command, where it ends the command's options: wsarena "
                   f"{command} -- MODEL (see 'wsarena --help')\n")


@pytest.mark.parametrize(("argv", "command"), [
    (["--", "cache", "info"], "cache"), (["--bogus", "--", "cache", "clear"], "cache"), (["--", "info"], "info"),
])
def test_a_double_dash_before_a_command_that_takes_no_model_is_said_to_be_left_out(capsys, argv, command):
    """cache and info take no model, which a '--' after the command would let begin with a dash: the refusal of the
    '--' before them says to leave it out, where it showed `wsarena report -- MODEL`, another command's line."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: '--' goes after the command, where it ends the command's options; {command} "
                   f"takes no model: leave the '--' out (see 'wsarena {command} --help')\n")


@pytest.mark.parametrize("first", ["--help", "-h", "--he", "--version", "--vers=x"])
def test_the_top_options_before_a_double_dash_are_answered_as_before(capsys, first):
    """--help and --version, which argparse answers as it meets them, are answered before a '--' that follows them is
    refused; --vers=x is refused as --version's own error."""
    if first == "--vers=x":
        assert main([first, "--", "report", "vgg16"]) == 2
        assert capsys.readouterr().err == ("wsarena: error: argument --version: ignored explicit argument 'x' (see "
                                           "'wsarena --help')\n")
        return
    with pytest.raises(SystemExit):
        main([first, "--", "report", "vgg16"])
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: wsarena" if "h" in first else "wsarena "), out


def test_a_double_dash_after_the_command_ends_its_options(capsys, tmp_path, monkeypatch):
    """After the command, '--' ends its options: a model file whose name starts with '-' is read as the model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-m.json").write_text('[{"name": "c", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}]')
    code, out, err = run_main(capsys, "report", "--backend", "cpu", "--format", "json", "--", "-m.json")
    assert (code, err) == (0, "") and json.loads(out)["model"] == "-m.json", err


def test_an_abbreviated_option_of_the_command_before_it_is_said_to_go_after_it(capsys):
    """The command takes its options abbreviated (--bat=4 is --batch=4 after it), but one given so before it was not
    said to be the command's: only the full name was looked up. An abbreviation that several of its options start
    with (--c) is none of them, as after the command."""
    code, out, err = run_main(capsys, "--bat=4", "--c=1", "--batch=8", "--str", "report", "vgg16")
    assert (code, out) == (2, "")
    assert err == ("wsarena: error: unrecognized arguments before the command: --bat=4 --c=1 --batch=8 --str (see "
                   "'wsarena --help'); report's own options (--batch, --streams) go after 'report'\n")


@pytest.mark.parametrize(("argv", "hint"), [
    (["--batch", "4", "--dtype", "float16", "tune", "vgg16"],
     "; tune's own options (--batch, --dtype) go after 'tune'"),
    (["--format", "json", "info"], "; info's own options (--format) go after 'info'"),
    (["--bat", "4", "report", "vgg16"], "; report's own options (--batch) go after 'report'"),
    (["--format", "json", "cache", "info"], "; cache's own options (--format) go after 'cache'"),
    (["--batch", "4", "cache", "info"], ""),  # none of cache's options
    (["--x", "4", "report", "vgg16"], ""),
    (["--batch", "4"], ""),  # no command given after it
    # a command mistyped, after no option of the later command's: the command a later word names (a plot file's) is
    # not the one meant, whatever options come before that word
    (["reprot", "vgg16", "--format", "json", "--plot", "info"], ""),
    (["--cudnn-api", "graph", "reprot", "vgg16", "--format", "json", "--plot", "info"], ""),
    (["--skip-unknown", "m.onnx", "report"], "; report's own options (--skip-unknown) go after 'report'"),
])
def test_an_option_of_the_command_before_it_with_its_value_apart_is_said_to_go_after_it(capsys, argv, hint):
    """--batch=4 before the command was said to go after it, but --batch 4, as options are mostly written, was said
    only as an invalid command, the value (4) having been taken for the command: the options of the command's before
    it are said to go after it there too; a command mistyped, after no option of the command's, names none of them."""
    code, out, err = run_main(capsys, *argv)
    value = next(arg for arg in argv if not arg.startswith("-"))  # the first word argparse takes for the command
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: argument command: invalid choice: {value!r} (choose from 'report', 'tune', "
                   f"'cache', 'info'){hint} (see 'wsarena --help')\n")


@pytest.mark.parametrize(("argv", "says"), [
    (["--bogus"], "unrecognized arguments: --bogus; "),
    (["-v"], "unrecognized arguments: -v; "),
    (["--bogus", "--x=" + "x" * 100_000], f"unrecognized arguments: --bogus --x={'x' * 15}...{'x' * 28}; "),
    ([], ""),
])
def test_no_command_names_the_options_given_and_lists_the_commands(capsys, argv, says):
    """Without a command, argparse said only "the following arguments are required: command": an unknown option
    given (`wsarena -v`) was not named, nor were the commands."""
    code, out, err = run_main(capsys, *argv)
    expected = "a command is required: report, tune, cache or info (see 'wsarena --help')"
    assert (code, out, err) == (2, "", f"wsarena: error: {says}{expected}\n")


@pytest.mark.parametrize("argv", [["x" * 100_000], ["cache", "x" * 100_000], ["info", "--format", "x" * 100_000]])
def test_a_long_choice_is_shortened_in_its_error(capsys, argv):
    """argparse quotes a value that is none of a flag's or a subcommand's choices whole."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out) == (2, "") and f"invalid choice: '{'x' * 27}...{'x' * 28}' (choose from '" in err, err[:300]
    assert len(err) < 250, err[:300]


@pytest.mark.parametrize(("argv", "says"), [
    (["report", "vgg16", "--cud=" + "x" * 100_000],
     (f"ambiguous option: --cud={'x' * 21}...{'x' * 28} could match --cudnn-api, --cudnn-heuristic "
      "(see 'wsarena report --help')")),
    (["report", "vgg16", "--cud=a\nb"],
     "ambiguous option: --cud=a\\nb could match --cudnn-api, --cudnn-heuristic (see 'wsarena report --help')"),
    (["tune", "vgg16", "--apply=" + "x" * 100_000],
     f"argument --apply: ignored explicit argument '{'x' * 27}...{'x' * 28}' (see 'wsarena tune --help')"),
    (["--version=" + "x" * 100_000],
     f"argument --version: ignored explicit argument '{'x' * 27}...{'x' * 28}' (see 'wsarena --help')"),
    (["tune", "vgg16", "--apply=it's \"so\""],
     "argument --apply: ignored explicit argument 'it\\'s \"so\"' (see 'wsarena tune --help')"),
])
def test_an_argument_argparse_quotes_whole_is_shortened(capsys, argv, says):
    """argparse's "ambiguous option" and "ignored explicit argument" quoted the argument whole: a 100 kB line, and a
    newline in it broke the line."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err) == (2, "", f"wsarena: error: {says}\n")


@pytest.mark.parametrize("value", ["-1", " -2GiB", "-0.5MiB"])
def test_a_negative_size_is_said_to_be_negative(capsys, monkeypatch, value):
    """As a negative --batch or --max-slowdown is; it was "not a size: '-1' (expected e.g. '512', ...)"."""
    code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu", "--cap-workspace", value)
    assert (code, out) == (2, "") and err.startswith(
        f"wsarena: error: argument --cap-workspace: a size cannot be negative: {value!r}"), err
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", value)
    code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu")
    said = f"environment variable WSARENA_CAP_WORKSPACE={value!r}: a size cannot be negative: {value!r}"
    assert (code, out, err) == (2, "", f"wsarena: error: {said}\n")


def test_an_integer_of_more_digits_than_python_reads_is_said_to_be_too_large(capsys, monkeypatch):
    """int() takes at most 4300 digits from a string: --batch of 5000 was "not an integer", which it is."""
    import wsarena

    many = "9" * 5000
    for flag, value in (("--batch", many), ("--streams", many), ("--input-shape", f"1,3,{many},4")):
        code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu", flag, value)
        assert (code, out) == (2, "") and err.count("\n") == 1 and len(err) < 300, err[:400]
        assert err.startswith(f"wsarena: error: argument {flag}: an integer of 5000 digits is too large"), err[:400]
    monkeypatch.setenv("WSARENA_PLAN_CACHE_SIZE", many)
    wsarena._config._reset()
    code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu")
    assert (code, out) == (2, "") and err.endswith("': an integer of 5000 digits is too large\n"), err[:400]


def test_streams_of_as_many_digits_as_python_reads_are_quoted_in_part(capsys):
    """4300 digits int() reads: the error that there are more streams than layers quoted all of them."""
    code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu", "--streams", "9" * 4300)
    assert (code, out) == (2, "")
    assert err == ("wsarena: error: argument --streams: an integer of 14285 bits is more than the model's 13 layer(s): "
                   "one run of the model cannot keep more streams busy than it has layers (see 'wsarena report --help')"
                   "\n")


def test_memory_running_out_is_said_to(capsys, monkeypatch):
    """Python's MemoryError, where an allocation fails (reading a model too large for memory), has no message: the
    error line was "wsarena: error: " and nothing more."""
    import wsarena.models

    def load_model(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(wsarena.models, "load_model", load_model)
    assert run_main(capsys, "report", "vgg16", "--backend", "cpu") == (3, "", "wsarena: error: out of memory\n")


def assert_cap_refused(capsys, monkeypatch, value, said):
    """``value`` refused with ``said`` as --cap-workspace's value and as WSARENA_CAP_WORKSPACE's, exit 2 each."""
    code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu", "--cap-workspace", value)
    assert (code, out) == (2, "")
    assert err == f"wsarena: error: argument --cap-workspace: {said} (see 'wsarena report --help')\n"
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", value)
    code, out, err = run_main(capsys, "report", "vgg16", "--backend", "cpu")
    assert (code, out) == (2, "")
    assert err == f"wsarena: error: environment variable WSARENA_CAP_WORKSPACE={value!r}: {said}\n"
    monkeypatch.delenv("WSARENA_CAP_WORKSPACE")


@pytest.mark.parametrize("value", ["-0", "-0.0", " -00MiB", "-.0GiB"])
def test_a_size_of_minus_zero_is_not_said_to_be_negative(capsys, monkeypatch, value):
    """-0 is zero: it was "a size cannot be negative: '-0'"."""
    assert_cap_refused(capsys, monkeypatch, value, f"a size is written without a sign: {value!r} (write 0)")


@pytest.mark.parametrize(("value", "written"), [("+4MiB", "4MiB"), (" + 0 ", "0"), ("+.5KiB", ".5KiB")])
def test_a_size_with_a_plus_sign_is_said_to_be_written_without_one(capsys, monkeypatch, value, written):
    """"+4MiB" was "not a size: '+4MiB' (expected e.g. '512', ...)", as if the size itself were wrong, where
    --batch +4 is said to be written without a sign: so is a size, from the flag, the variable and configure()."""
    said = f"a size is written without a sign: {value!r} (write {written!r})"
    assert_cap_refused(capsys, monkeypatch, value, said)
    with pytest.raises(ValueError) as info:
        configure(cap_workspace=value)
    assert str(info.value) == f"cap_workspace={value!r}: {said}"
    for other in ("+", "+-4", "++4", "+4 MiBs"):  # no size after the sign: not a size, as before
        with pytest.raises(ValueError) as info:
            parse_size(other)
        assert str(info.value) == f"not a size: {other!r} (expected e.g. '512', '64KiB', '1.5GiB', '2GB')"


def test_a_layer_list_that_starts_with_a_byte_order_mark_is_read(capsys, tmp_path):
    """As Windows editors save UTF-8: it was refused, "Unexpected UTF-8 BOM (decode using utf-8-sig)", a hint to a
    Python programmer."""
    path = tmp_path / "m.json"
    path.write_bytes(b"\xef\xbb\xbf" + f"[{CONV}}}]".encode())
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--format", "json")
    assert code == 0 and [layer["name"] for layer in json.loads(out)["layers"]] == ["c"], err


@pytest.mark.parametrize(("node", "shape", "says"), [
    (conv("n" * 10_000, "x", "w", "y"), ["N", 3, "H", "W"],
     f"1 conv node(s) cannot be planned: '{'n' * 27}...{'n' * 28}' (input shape"),
    (conv("c", "x", "w", "y", pads=[0] * 1000), [1, 3, 8, 8],
     "ONNX node 'c': pads=[0, 0, 0, 0, 0, 0, ... 994 more] must have 4 entries"),
    (conv("n" * 10_000, "x", "w", "y", strides=[1] * 1000), [1, 3, 8, 8],
     f"ONNX node '{'n' * 27}...{'n' * 28}': strides=[1, 1, 1, 1, 1, 1, ... 994 more] and dilations=[1, 1] need 2"),
])
def test_a_long_node_name_or_attribute_is_shortened_in_the_onnx_loaders_error(capsys, tmp_path, node, shape, says):
    """A node's name and its attributes were quoted whole: a 10 kB name, or a thousand pads, gave a line as long."""
    path = save(tmp_path / "m.onnx", [node], [vi("x", shape)], [weight("w", (8, 3, 3, 3))])
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu")
    assert (code, out) == (2, "") and says in err and err.count("\n") == 1 and len(err) < 500, err[:600]


def test_a_long_name_of_the_node_that_lost_a_shape_is_shortened(capsys, tmp_path):
    """The node where a conv's input shape was lost (a Reshape to a shape computed at run time), named whole."""
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"], name="R" * 10_000), conv("c", "r", "w", "y")]
    inputs = [vi("x", [1, 3, 8, 8]), helper.make_tensor_value_info("s", TensorProto.INT64, [4])]
    path = save(tmp_path / "m.onnx", nodes, inputs, [weight("w", (8, 3, 3, 3))])
    says = f"shape inference cannot work out the output of Reshape '{'R' * 27}...{'R' * 28}')"
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu")
    assert (code, out) == (2, "") and says in err and err.count("\n") == 1 and len(err) < 500, err[:600]


def test_the_inputs_a_refused_input_shape_lists_are_cut_after_five(capsys, tmp_path):
    """The refusal of an --input-shape named as no input listed every input: a line as long as the model has inputs
    (a mask per image, say)."""
    nodes = [conv(f"c{i}", f"x{i}", "w", f"y{i}", pads=[1, 1, 1, 1]) for i in range(12)]
    path = save(tmp_path / "m.onnx", nodes, [vi(f"x{i}", ["N", 3, "H", "W"]) for i in range(12)],
                [weight("w", (8, 3, 3, 3))])
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--input-shape", "y=1x3x8x8")
    assert (code, out) == (2, "") and err.endswith(
        ": no graph input 'y'; the inputs are 'x0', 'x1', 'x2', 'x3', 'x4', and 7 more\n"), err
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--input-shape", "1x3x8x8")
    assert (code, out) == (2, "") and err.endswith(
        ": one input shape was given but the model has 12 inputs ('x0', 'x1', 'x2', 'x3', 'x4', and 7 more); name "
        "each, NAME=DIMS\n"), err


def test_a_folder_given_as_the_model_is_said_to_be_one(capsys, tmp_path):
    """Where it read "'/tmp': unknown model file extension '(none)'"."""
    code, out, err = run_main(capsys, "report", str(tmp_path), "--backend", "cpu")
    assert (code, out) == (2, "") and err == f"wsarena: error: {str(tmp_path)!r} is a folder: expected a .onnx or " \
                                             ".json file\n"
    (tmp_path / "model").write_text("{}")
    code, out, err = run_main(capsys, "report", str(tmp_path / "model"), "--backend", "cpu")
    assert (code, out) == (2, "") and err.endswith(": unknown model file extension (none); expected .onnx or .json\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", ["report", "tune"])
def test_a_fifo_given_as_the_model_is_not_waited_on(capsys, tmp_path, command):
    """``wsarena report pipe.onnx`` waited for a writer, for good where none came, where ``cat`` would have: a FIFO
    that no writer has open gives nothing at once (the timeout fails a wait), and is refused, saying so."""
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    code, out, err = run_main(capsys, command, str(fifo), "--backend", "cpu")
    assert (code, out) == (2, "") and err == f"wsarena: error: {str(fifo)!r} is a pipe that gave nothing: no writer " \
                                             "had it open, or its writer wrote nothing\n"


@pytest.mark.timeout(30)
def test_a_fifo_given_as_the_device_properties_is_not_waited_on(capsys, tmp_path):
    """``wsarena report resnet50 --device-properties pipe.json`` waited for a writer, for good where none came: a FIFO
    that no writer has open gives nothing at once, and is refused, saying so."""
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    code, out, err = run_main(capsys, "report", "resnet50", "--device-properties", str(fifo))
    assert (code, out) == (2, "") and err == f"wsarena: error: device properties {str(fifo)!r} are empty: the pipe " \
                                             "gave nothing (no writer had it open, or its writer wrote nothing)\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["process substitution", "here-string", "piped to stdin"])
def test_device_properties_are_read_from_a_pipe_the_shell_gives(tmp_path, how):
    """``--device-properties <(ssh gpu-host cat props.json)`` (bash passes /dev/fd/63, a pipe), ``/dev/stdin`` with
    a here-string or with the properties piped in: each was refused as no regular file. Each is read, as its
    error, which names the member no GPU has, shows: said before cuDNN is loaded, it is the same with cuDNN or
    without (exit 2)."""
    props = tmp_path / "props.json"
    props.write_text(json.dumps({"deviceName": "NVIDIA H100", "multiProcessorCount": 0}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    report = [sys.executable, "-m", "wsarena", "report", "resnet50", "--device-properties"]
    stdin = None
    if how == "piped to stdin":
        argv, stdin = [*report, "/dev/stdin"], props.read_text()
    else:
        bash = shutil.which("bash")
        if bash is None:
            pytest.skip(f"{how} is bash's: no bash here")
        line = '"$@" <(cat "$PROPS")' if how == "process substitution" else '"$@" /dev/stdin <<< "$(cat "$PROPS")"'
        argv, env["PROPS"] = [bash, "-c", line, "bash", *report], str(props)
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=100, check=False)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert re.fullmatch(r"wsarena: error: /dev/(fd/\d+|stdin): device properties member multiProcessorCount is 0: "
                        r"a GPU has at least 1; .*\n", done.stderr), done.stderr


# --------------------------------------------------------------------------------------------------- warnings


@pytest.mark.parametrize("command", [("report",), TUNE])
def test_warnings_are_one_line_each(tmp_path, command):
    path = lost_conv_model(tmp_path)
    r = run_cli(*command, str(path), "--backend", "cpu", "--skip-unknown")
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"wsarena: warning: {str(path)!r}: skipped 1 conv node(s): 'lost' (input shape [1, 4, ?, ?] "
                        "unknown: shape inference cannot work out the output of Reshape 'r')\n")


def test_a_multi_line_warning_becomes_one_line(capsys, monkeypatch):
    import warnings

    import wsarena.cli

    def warn_twice(args):
        warnings.warn("first line\nsecond line", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(wsarena.cli, "_info", warn_twice)
    code, _, err = run_main(capsys, "info")
    assert code == 0 and err == "wsarena: warning: first line second line\n"


# ---------------------------------------------------------------------------------------------------- streams


@pytest.mark.parametrize("command", [("report",), TUNE])
@pytest.mark.parametrize("streams", [4, 10**9, 10**30])
def test_more_streams_than_layers_is_refused_by_the_flag(capsys, tmp_path, command, streams):
    """--streams has the bound plan() checks, the model's layers, which only the model read tells: a count above it
    was refused as plan()'s streams= ("streams=1000000000 is more than ..."), the flag not named. It is said of the
    flag, as --batch's bound is, with the command's help, which says the bound, as each error of a flag's value is;
    the layers' count itself is planned."""
    model = small_model(tmp_path, 3)
    code, out, err = run_main(capsys, *command, model, "--backend", "cpu", "--streams", str(streams))
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: argument --streams: {streams} is more than the model's 3 layer(s): one run of "
                   f"the model cannot keep more streams busy than it has layers (see 'wsarena {command[0]} --help')\n")
    code, out, err = run_main(capsys, *command, model, "--backend", "cpu", "--streams", "3", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["streams"] == 3


# ----------------------------------------------------------------------------------------------- ONNX inputs


def test_input_shape_counts_only_inputs_without_an_initializer(capsys, tmp_path):
    # Older exporters (IR version 3) list every weight as a graph input too.
    nodes = [conv("c1", "x", "w1", "y1", pads=[1, 1, 1, 1]), conv("c2", "y1", "w2", "y2")]
    inputs = [vi("x", ["N", 3, "H", "W"]), vi("w1", [8, 3, 3, 3]), vi("w2", [4, 8, 3, 3])]
    path = save(tmp_path / "weights-as-inputs.onnx", nodes, inputs, [weight("w1", (8, 3, 3, 3)),
                                                                     weight("w2", (4, 8, 3, 3))])
    for command in (("report",), TUNE):
        code, out, err = run_main(capsys, *command, str(path), "--backend", "cpu", "--input-shape", "1,3,64,64",
                                  "--format", "json")
        assert code == 0, err
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--input-shape", "1,3,64,64",
                              "--format", "json")
    assert [layer["input_shape"] for layer in json.loads(out)["layers"]] == [[1, 3, 64, 64], [1, 8, 64, 64]]


def test_a_layer_name_with_a_newline_keeps_the_table_whole(capsys, tmp_path):
    path = save(tmp_path / "odd.onnx", [conv("stem\nconv\t1", "x", "w", "y")], [vi("x", [1, 3, 8, 8])],
                [weight("w", (4, 3, 3, 3))])
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu")
    assert code == 0, err
    head, rule, row = out.splitlines()[3:6]
    assert head.startswith("layer") and set(rule) == {"-", " "}
    assert row.startswith("stem\\nconv\\t1  1x3x8x8  4x3x3x3  s1 p0")
    assert len(out.splitlines()) == 10  # title, settings, blank, head, rule, the row, blank, three totals


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_output_the_terminal_cannot_encode_exits_3_saying_so(tmp_path, fmt):
    """A layer name stdout's encoding cannot show (a report redirected to a file under a non-UTF-8 locale) is the
    environment, not bad input: exit 3, one line that says what to do."""
    path = tmp_path / "names.json"
    path.write_text(json.dumps([{"name": "\u00fcbung", "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3]}]))
    done = run_cli("report", str(path), "--backend", "cpu", "--format", fmt, env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 3 and "bung" not in done.stdout  # what came before the name may have been written
    assert done.stderr.startswith("wsarena: error: cannot write the output: its encoding, ascii, cannot show '\\xfc'")
    assert done.stderr.count("\n") == 1 and "PYTHONIOENCODING=utf-8" in done.stderr
    assert run_cli("report", str(path), "--backend", "cpu", "--format", fmt).returncode == 0  # UTF-8 shows it


def test_output_a_code_page_cannot_encode_names_the_code_page(tmp_path):
    """A code page's codec names itself "charmap" in its errors, which the line said for stdout's encoding ("its
    encoding, charmap, ..."), a name the user never set: it names the code page, as stdout names it."""
    path = tmp_path / "names.json"
    path.write_text(json.dumps([{"name": "S\u00e3o", "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3]}]))
    done = run_cli("report", str(path), "--backend", "cpu", "--format", "csv", env={"PYTHONIOENCODING": "cp437"})
    assert done.returncode == 3
    assert done.stderr.startswith("wsarena: error: cannot write the output: its encoding, cp437, cannot show '\\xe3'")


def test_a_long_run_of_characters_the_encoding_cannot_show_is_quoted_in_part(tmp_path):
    """The run of characters was quoted whole: a layer name of 100,000 of them gave a line as long."""
    path = tmp_path / "names.json"
    path.write_text(json.dumps([{"name": "\u00fc" * 100_000, "input_shape": [1, 4, 8, 8],
                                 "weight_shape": [4, 4, 3, 3]}]))
    done = run_cli("report", str(path), "--backend", "cpu", "--format", "csv", env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 3 and done.stderr.count("\n") == 1 and len(done.stderr) < 400, done.stderr[:400]
    assert "cannot show '\\xfc\\xfc" in done.stderr and "..." in done.stderr
    assert "\\xfc' (use a UTF-8 locale" in done.stderr


def test_a_lone_surrogate_no_encoding_shows_exits_3_saying_how_to_write_it(tmp_path):
    # JSON's "\udcff", or a byte that decoded to no character: a UTF-8 locale, the usual advice, cannot show it
    path = tmp_path / "names.json"
    path.write_text('[{"name": "a\\udcffb", "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3]}]')
    done = run_cli("report", str(path), "--backend", "cpu", "--format", "csv", env={"PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 3 and done.stderr.count("\n") == 1
    assert "cannot show '\\udcff' (a lone surrogate" in done.stderr and "UTF-8 locale" not in done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    argv = [sys.executable, "-m", "wsarena", "report", str(path), "--backend", "cpu", "--format", "csv"]
    fixed = subprocess.run(argv, capture_output=True, env={**env, "PYTHONIOENCODING": "utf-8:surrogateescape"},
                           check=False)
    assert fixed.returncode == 0 and b"\na\xffb," in fixed.stdout  # as the hint says: the byte 0xff


@pytest.mark.parametrize("code", ["d800", "dc7f", "dd00", "dfff"])
def test_a_lone_surrogate_of_no_byte_exits_3_saying_how_to_write_it(tmp_path, code):
    # JSON's "\ud800" stands for no byte: surrogateescape, which the hint of a byte's named, refuses it too, as it
    # does all but U+DC80 to U+DCFF (U+DD00 and above were given its hint)
    path = tmp_path / "names.json"
    path.write_text('[{"name": "a\\u' + code + 'b", "input_shape": [1, 4, 8, 8], "weight_shape": [4, 4, 3, 3]}]')
    done = run_cli("report", str(path), "--backend", "cpu", "--format", "csv", env={"PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 3 and done.stderr.count("\n") == 1
    assert f"cannot show '\\u{code}' (a lone surrogate" in done.stderr and "surrogateescape" not in done.stderr
    assert done.stderr.endswith("PYTHONIOENCODING=utf-8:backslashreplace escapes it)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    argv = [sys.executable, "-m", "wsarena", "report", str(path), "--backend", "cpu", "--format", "csv"]
    for errors, exit_code in (("surrogateescape", 3), ("backslashreplace", 0)):
        fixed = subprocess.run(argv, capture_output=True, env={**env, "PYTHONIOENCODING": f"utf-8:{errors}"},
                               check=False)
        assert fixed.returncode == exit_code
    assert f"\na\\u{code}b,".encode() in fixed.stdout  # as the hint says: escaped


@pytest.mark.parametrize(
    ("attrs", "flags", "why", "hint"),
    [
        ({"pads": [0, 0, 1, 1]}, ("--asymmetric-pads", "error"), "asymmetric pads (begin [0, 0], end [1, 1])",
         ("model asymmetric pads as onnxruntime runs them (asymmetric_pads='widen' / --asymmetric-pads widen), or "
          "skip them with skip_unknown=True / --skip-unknown")),
        ({"op": "ConvTranspose", "strides": [2, 2], "output_shape": [40, 40]}, (),
         "output_shape [40, 40] larger than the full output [17, 17] by a stride or more",
         "skip them with skip_unknown=True / --skip-unknown"),
    ],
)
def test_an_unplannable_node_gets_the_hint_that_fits_it(capsys, tmp_path, attrs, flags, why, hint):
    path = save(tmp_path / "m.onnx", [conv("c", "x", "w", "y", **attrs)], [vi("x", [1, 4, 8, 8])],
                [weight("w", (4, 4, 3, 3))])
    for command in (("report",), TUNE):
        code, out, err = run_main(capsys, *command, str(path), "--backend", "cpu", *flags)
        assert (code, out) == (2, "")
        assert err == f"wsarena: error: {str(path)!r}: 1 conv node(s) cannot be planned: 'c' ({why}) ({hint})\n"


def test_an_unknown_shape_suggests_fixing_the_input_shapes_where_they_are_not_fixed(capsys, tmp_path):
    # The Reshape's target shape is a runtime value: with the inputs' shapes fixed, --input-shape cannot help
    path = lost_conv_model(tmp_path)
    code, _, err = run_main(capsys, "report", str(path), "--backend", "cpu")
    assert code == 2
    assert err.endswith("'lost' (input shape [1, 4, ?, ?] unknown: shape inference cannot work out the output of "
                        "Reshape 'r') (skip them with skip_unknown=True / --skip-unknown)\n")
    symbolic = save(tmp_path / "symbolic.onnx", [conv("c", "x", "w", "y")], [vi("x", [1, 4, "H", "W"])],
                    [weight("w", (4, 4, 3, 3))])
    code, _, err = run_main(capsys, "report", str(symbolic), "--backend", "cpu")
    assert code == 2
    assert err.endswith("'c' (input shape [1, 4, ?, ?] unknown) (fix the model's input shapes (input_shapes= / "
                        "--input-shape), or skip them with skip_unknown=True / --skip-unknown)\n")


@pytest.mark.parametrize("command", ["report", "tune"])
@pytest.mark.parametrize(("flags", "says"), [
    (["--skip-unknown"], "--skip-unknown applies"),
    (["--asymmetric-pads", "widen"], "--asymmetric-pads applies"),
    (["--asymmetric-pads", "error", "--skip-unknown"], "--skip-unknown and --asymmetric-pads apply"),
    (["--input-shape", "1,1,4,4"], "--input-shape applies"),
    (["--input-shape", "1,1,4,4", "--asymmetric-pads", "error", "--skip-unknown"],
     "--skip-unknown, --asymmetric-pads and --input-shape apply"),
])
def test_the_onnx_loaders_flags_are_refused_for_another_model(capsys, tmp_path, command, flags, says):
    """--skip-unknown and --asymmetric-pads read ONNX models only, as --input-shape does; they were taken for
    another model and did nothing. The refusal names the flags with the help that lists them, as a flag's error
    does, where it had no help, and --input-shape's was load_model()'s, which named its input_shapes= too."""
    json_model = small_model(tmp_path)
    for model in ("resnet50", str(json_model)):
        code, out, err = run_main(capsys, command, model, "--backend", "cpu", *flags)
        said = f"wsarena: error: {says} to .onnx models only, not {model!r} (see 'wsarena {command} --help')\n"
        assert (code, out, err) == (2, "", said)
    onnx_model = tmp_path / "small.onnx"
    save(onnx_model, [conv("c", "x", "w", "y")], [vi("x", (1, 1, 4, 4))], [weight("w", (2, 1, 3, 3))])
    code, out, err = run_main(capsys, command, str(onnx_model), "--backend", "cpu", "--passes", "fwd", *flags)
    assert (code, err) == (0, ""), err


@pytest.mark.parametrize("command", ["report", "tune"])
@pytest.mark.parametrize("flags", [["--skip-unknown"], ["--asymmetric-pads", "error"], ["--input-shape", "1,3,8,8"],
                                   ["--skip-unknown", "--input-shape", "1,3,8,8"]])
def test_an_unknown_model_is_said_before_its_onnx_flags_are_refused(capsys, tmp_path, command, flags):
    """A name that names no model, given with a flag of ONNX models, was refused as a model other than ONNX ("--skip-
    unknown applies to .onnx models only, not 'resnt50'"): the typo's hint was lost, and the name's error is the
    real problem (the flag may be right for the model meant)."""
    code, out, err = run_main(capsys, command, "resnt50", "--backend", "cpu", *flags)
    assert (code, out) == (2, "")
    assert err.startswith("wsarena: error: unknown model 'resnt50': not a zoo model (resnet50, ")
    assert err.endswith(" nor a .onnx or .json file; did you mean 'resnet50'?\n")
    (tmp_path / "model.onx").write_text("")
    code, out, err = run_main(capsys, command, str(tmp_path / "model.onx"), "--backend", "cpu", *flags)
    assert (code, out) == (2, "") and err.endswith("unknown model file extension '.onx'; expected .onnx or .json\n")


@pytest.mark.parametrize("command", ["report", "tune"])
@pytest.mark.parametrize("batch", [2**31, 10**20])
def test_a_batch_above_what_the_geometry_takes_is_refused_by_its_flag(capsys, command, batch):
    """A batch above 2**31 - 1 was refused as the first layer's input_shape, --batch not named; 2**31 - 1 itself is
    planned (each layer's input at that batch is a valid geometry)."""
    code, out, err = run_main(capsys, command, "resnet50", "--backend", "cpu", "--batch", str(batch))
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: argument --batch: must be at most 2**31 - 1 = 2147483647, the largest dimension "
                   f"a cuDNN descriptor holds, not {batch} (see 'wsarena {command} --help')\n")
    code, out, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--passes", "fwd",
                              "--batch", str(2**31 - 1), "--format", "json")
    assert code == 0 and json.loads(out)["batch"] == 2**31 - 1, err


def test_a_flags_choice_is_taken_in_any_case_as_the_variables_take_theirs(capsys, tmp_path):
    """WSARENA_BACKEND=CPU is the cpu backend, but --backend CPU was refused: every flag's choice is now taken in any
    case, as what it names; the choices --help lists and an invalid choice's error stay as they were."""
    canonical = ["--backend", "cpu", "--layout", "NHWC", "--dtype", "float64", "--search", "heuristic", "--cudnn-api",
                 "graph", "--cudnn-heuristic", "instant", "--passes", "fwd", "--format", "json"]
    any_case = ["--backend", "CPU", "--layout", "nhwc", "--dtype", "Float64", "--search", "HEURISTIC", "--cudnn-api",
                "Graph", "--cudnn-heuristic", "INSTANT", "--passes", "fwd", "--format", "JSON"]
    code, expected, err = run_main(capsys, "report", "resnet50", *canonical)
    assert code == 0 and json.loads(expected)["layout"] == "NHWC", err
    assert run_main(capsys, "report", "resnet50", *any_case) == (0, expected, "")
    model = str(tmp_path / "m.onnx")
    save(model, [conv("c", "x", "w", "y", pads=[0, 0, 1, 1])], [vi("x", (1, 1, 4, 4))], [weight("w", (2, 1, 3, 3))])
    code, out, err = run_main(capsys, "tune", model, "--backend", "Cpu", "--asymmetric-pads", "ERROR",
                              "--format", "Csv")
    assert (code, out) == (2, "") and "asymmetric pads" in err, err
    for command in (["info"], ["cache", "info"]):
        code, out, err = run_main(capsys, *command, "--format", "Json")
        assert code == 0 and isinstance(json.loads(out), dict), err
    code, out, err = run_main(capsys, "report", "resnet50", "--backend", "CUDA")
    assert (code, out) == (2, "")
    assert err == ("wsarena: error: argument --backend: invalid choice: 'CUDA' (choose from 'auto', 'cudnn', 'cpu') "
                   "(see 'wsarena report --help')\n")
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "[--layout {NCHW,NHWC}]" in usage and "[--backend {auto,cudnn,cpu}]" in usage


@pytest.mark.parametrize(("flag", "value"), [
    ("--backend", "cpu "), ("--backend", " CPU"), ("--backend", "\uff43\uff50\uff55"), ("--backend", "cpus"),
    ("--backend", "c"), ("--layout", "NCH\u0174"), ("--dtype", "FLOAT_32"), ("--format", "JSONS"),
    ("--cudnn-heuristic", "\u0392"),  # Greek capital beta, which looks like B
])
def test_a_flags_choice_differing_by_more_than_case_is_refused_as_given(capsys, flag, value):
    """Only case is set aside: a value with spaces, in fullwidth or lookalike letters, or spelled otherwise is no
    choice, and the error quotes it as given."""
    code, out, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", flag, value)
    assert (code, out) == (2, "")
    assert err.startswith(f"wsarena: error: argument {flag}: invalid choice: {value!r} (choose from "), err


@pytest.mark.parametrize(("argv", "says"), [
    (["report", "m.json", "--max-slowdown", "2%", "--cap-workspace", "1MiB"],
     "give --cap-workspace or --max-slowdown, not both: --max-slowdown picks the cap"),
    (["report", "m.json", "--max-slowdown", "2%", "--search", "heuristic"],
     "--max-slowdown times every algorithm: it needs --search exhaustive (or no --search)"),
    (["report", "m.json", "--device-properties", "p.json", "--backend", "cpu"],
     "--device-properties plans for a cuDNN GPU: leave out --backend cpu"),
    (["report", "m.json", "--device-properties", "p.json", "--search", "exhaustive"],
     "--device-properties plans without the GPU, which cannot time algorithms: leave out --search exhaustive"),
    (["report", "m.json", "--device-properties", "p.json", "--max-slowdown", "2%"],
     "--device-properties plans without the GPU, which cannot time algorithms: leave out --max-slowdown"),
    (["report", "m.json", "--device-properties", "p.json", "--cudnn-api", "legacy"],
     "--device-properties plans through cuDNN's graph API: leave out --cudnn-api legacy"),
    (["tune", "m.json", "--apply", "--format", "json"],
     "--apply prints one line, WSARENA_CAP_WORKSPACE=... WSARENA_ALGO_SEARCH=exhaustive; leave out --format"),
    (["tune", "m.onnx", "--input-shape", "1,3,8,8", "--input-shape", "x=1,3,8,8"],
     "with several --input-shape options, name each input: --input-shape NAME=DIMS"),
    (["report", "m.onnx", "--input-shape", "x=1,3,8,8", "--input-shape", "x=1,3,9,9"],
     "--input-shape given twice for input 'x': 1x3x8x8 and 1x3x9x9"),
])
def test_the_commands_refusals_end_with_its_help(capsys, argv, says):
    """The flags the command refuses together are said with the help that lists them, as argparse's error of a flag
    and the refusal of the ONNX loader's flags for another model are; these ended with the reason alone."""
    code, out, err = run_main(capsys, *argv)
    assert (code, out, err) == (2, "", f"wsarena: error: {says} (see 'wsarena {argv[0]} --help')\n")


def test_the_passes_are_taken_in_any_case_and_their_error_names_the_flag_once(capsys):
    """--passes FWD was refused, where every flag's choice is taken in any case (--layout nhwc); and its error named
    the flag twice ("argument --passes: --passes takes ...")."""
    code, expected, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--passes", "fwd,bwd_data")
    assert code == 0, err
    any_case = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--passes", " FWD , Bwd_Data")
    assert any_case == (0, expected, "")
    for value in ("fwd,FWD", "fwd,sideways", ",", "ＦＷＤ"):
        code, out, err = run_main(capsys, "report", "resnet50", "--backend", "cpu", "--passes", value)
        assert (code, out) == (2, "")
        assert err == (f"wsarena: error: argument --passes: expected distinct names from fwd,bwd_data,bwd_filter, not "
                       f"{value!r} (see 'wsarena report --help')\n")


@pytest.mark.parametrize("command", ["report", "tune"])
@pytest.mark.parametrize(("flag", "value", "written"), [
    ("--batch", "+4", "4"), ("--streams", " +02 ", "02"), ("--batch", "+" + "9" * 5000, f"{'9' * 27}...{'9' * 28}"),
])
def test_a_count_with_a_plus_sign_is_said_to_be_written_without_one(capsys, command, flag, value, written):
    """'+4' is an integer, which the error said it was not ("not an integer: '+4'"): a count, as a size, is written
    without a sign."""
    code, out, err = run_main(capsys, command, "resnet50", "--backend", "cpu", flag, value)
    assert (code, out) == (2, "")
    assert err == (f"wsarena: error: argument {flag}: a count is written without a sign: {short_repr(value)} (write "
                   f"{written}) (see 'wsarena {command} --help')\n")
    for other in ("+", "+x", "++4", "+4.5"):
        code, out, err = run_main(capsys, command, "resnet50", "--backend", "cpu", flag, other)
        assert err == (f"wsarena: error: argument {flag}: not an integer: {other!r} (see 'wsarena {command} "
                       "--help')\n")
    for zero in ("+0", " +000"):  # not "(write 0)", a count refused in turn
        code, out, err = run_main(capsys, command, "resnet50", "--backend", "cpu", flag, zero)
        assert err == f"wsarena: error: argument {flag}: must be >= 1, not {zero!r} (see 'wsarena {command} --help')\n"
