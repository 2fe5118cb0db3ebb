"""Fuzzing what a user writes or hands over: sizes, settings, JSON layer lists, damaged ONNX files, and the command
line. Only the documented exceptions escape (``TypeError``/``ValueError`` naming the argument, ``ModelError`` for a
model), and ``wsarena report`` exits 0, or 2 with one line on stderr.

Each test tries a fixed number of inputs, the same ones every run; ``WSARENA_FUZZ_EXAMPLES=N`` tries N instead (a
longer campaign), and ``WSARENA_FUZZ_TALLY=FILE`` writes what was tried and refused (:mod:`tests.fuzz_tally`).
"""

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wsarena
from wsarena._config import _reset
from wsarena.cli import main
from wsarena.models import ConvLayer, ModelError

from .fuzz_tally import record, write_tally  # noqa: F401 - the module fixture that writes the tally
from .onnx_graphs import unet

FUZZ = settings(max_examples=int(os.environ.get("WSARENA_FUZZ_EXAMPLES", "300")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12), st.binary(max_size=8),
    st.sampled_from([np.int64(5), np.uint8(3), np.float32(2.0), np.True_, np.array(4), np.array([4]), [5], (5,),
                     {"a": 1}, object(), 2**64, -(2**63), float("nan"), "1e3", "٣", "5 MiB", "0x10", " 1.5GiB "]),
)
SIZE_TEXT = st.from_regex(r"\s?-?[0-9]{0,25}(\.[0-9]{0,4})?\s?(|b|B|kB|KiB|MiB|mib|GiB|TB|TiB|XB|k|iB)\s?",
                          fullmatch=True)


@FUZZ
@given(st.one_of(ODD_VALUES, SIZE_TEXT, st.integers(min_value=0)))
def test_parse_size(value):
    try:
        n = wsarena.parse_size(value)
    except (TypeError, ValueError) as exc:
        ok = "size" in str(exc) or repr(value) in str(exc)
        record("parse_size", exc, ok)
        assert ok, exc
        return
    except Exception as exc:  # an escape: counted, then raised
        record("parse_size", exc, False)
        raise
    record("parse_size", None, True)
    assert type(n) is int and n >= 0
    if isinstance(value, int) and not isinstance(value, bool):
        assert n == value


VALID_SETTINGS = {
    "cap_workspace": [None, 0, 1 << 20, "64KiB", "none", "1.5GiB", np.int64(4096)],
    "algo_search": ["heuristic", "exhaustive"],
    "backend": ["auto", "cpu", "cudnn"],
    "debug": [True, False],
}


@st.composite
def setting_changes(draw):
    """A few settings, each valid or not; now and then a name that is no setting."""
    keys = draw(st.lists(st.sampled_from(list(VALID_SETTINGS)), max_size=3, unique=True))
    if draw(st.integers(0, 5)) == 5:
        keys.append(draw(st.sampled_from(["cap", "Backend"])))
    changes = {}
    for key in keys:
        valid = st.sampled_from(VALID_SETTINGS.get(key, [1]))
        changes[key] = draw(st.one_of(valid, valid, valid, ODD_VALUES, SIZE_TEXT))
    return changes


@FUZZ
@given(setting_changes())
def test_configure_and_config(changes):
    _reset()
    before = wsarena.get_config()
    try:
        new = wsarena.configure(**changes)
    except (TypeError, ValueError) as exc:
        named = any(key in str(exc) for key in changes) or "size" in str(exc)
        record("configure", exc, named and wsarena.get_config() == before)
        assert named, exc
        assert wsarena.get_config() == before  # a refused change changes nothing
        return
    record("configure", None, True)
    assert wsarena.get_config() == new
    with wsarena.config(**changes) as cfg:
        assert cfg == new


ENV_VALUES = st.one_of(st.sampled_from(["", "none", "64KiB", "heuristic", "exhaustive", "auto", "cpu", "1", "off",
                                        " Yes "]), SIZE_TEXT, st.text(max_size=10))


@FUZZ
@given(st.dictionaries(st.sampled_from(["WSARENA_CAP_WORKSPACE", "WSARENA_ALGO_SEARCH", "WSARENA_BACKEND",
                                        "WSARENA_DEBUG", "WSARENA_SEARCH_CACHE_MAX_SIZE"]), ENV_VALUES, max_size=5))
def test_environment_variables(monkeypatch, env):
    for var, value in env.items():
        monkeypatch.setenv(var, value.replace("\0", ""))
    _reset()
    try:
        cfg = wsarena.get_config()
    except ValueError as exc:
        ok = any(f"environment variable {var}=" in str(exc) for var in env)
        record("environment", exc, ok)
        assert ok, exc
    else:
        record("environment", None, True)
        assert isinstance(cfg, wsarena.Config)
    finally:
        for var in env:
            monkeypatch.delenv(var)
        _reset()


# ------------------------------------------------------------------------------------------ models and the CLI

def report(path, *flags):
    """``wsarena report PATH``: the exit code and stderr, checked for the command line's promises."""
    import io
    import sys

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", str(path), "--backend", "cpu", *flags])
    errors = [line for line in err.getvalue().splitlines() if not line.startswith("wsarena: warning: ")]
    documented = code == 0 and not errors or (code == 2 and len(errors) == 1
                                               and errors[0].startswith("wsarena: error: ") and not out.getvalue())
    record("command line", None if code == 0 else errors, documented)
    assert documented, (code, err.getvalue(), sys.exc_info())
    return code


def load(path, **kwargs):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # skipped convs: the report says so, tested elsewhere
            layers = wsarena.load_model(path, **kwargs)
    except ModelError as exc:
        record("model files", exc, "\n" not in str(exc))
        assert "\n" not in str(exc)
        return None
    except Exception as exc:  # an escape: counted, then raised
        record("model files", exc, False)
        raise
    record("model files", None, True)
    assert layers and all(isinstance(layer, ConvLayer) for layer in layers)
    return layers


LAYER = {"name": "c", "input_shape": [1, 4, 8, 8], "weight_shape": [4, 2, 3, 3], "stride": [1, 1],
         "padding": [1, 1], "dilation": [1, 1], "groups": 2, "transposed": False}
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**31 - 2, max_value=2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def layer_lists(draw):
    """A JSON document: mostly a layer list close to a valid one (a field replaced, dropped or added)."""
    if draw(st.integers(0, 4)) == 0:
        return json.dumps(draw(JSON_VALUES))
    layers = []
    for i in range(draw(st.integers(1, 3))):
        layer = dict(LAYER, name=f"c{i}")
        for _ in range(draw(st.integers(0, 2))):
            key = draw(st.sampled_from([*LAYER, "strides", "fwd", "layout"]))
            action = draw(st.sampled_from(["replace", "drop", "entry"]))
            if action == "drop":
                layer.pop(key, None)
            elif action == "entry" and isinstance(layer.get(key), list) and layer[key]:
                at = draw(st.integers(0, len(layer[key]) - 1))
                layer[key] = [*layer[key][:at], draw(JSON_VALUES), *layer[key][at + 1:]]
            else:
                layer[key] = draw(JSON_VALUES)
        layers.append(layer)
    document = {"layers": layers, "layout": draw(st.sampled_from(["NCHW", "NHWC", 3]))} if draw(
        st.booleans()) else layers
    return json.dumps(document)


@FUZZ
@given(st.one_of(layer_lists(), st.text(max_size=40), st.sampled_from(["1" * 5000, "[" * 5000, "[1" + "0" * 5000 + "]",
                                                                       '{"layers": [' + "9" * 4400 + "]}"])))
def test_json_layer_lists(tmp_path, text):
    path = tmp_path / "model.json"
    path.write_text(text, encoding="utf-8")
    if load(path) is not None:
        assert report(path) == 0
    else:
        assert report(path) == 2


@functools.cache
def onnx_bytes():
    """The U-Net of tests.onnx_graphs as a file's bytes (not a fixture: hypothesis would print them)."""
    with tempfile.TemporaryDirectory() as folder:
        return unet(Path(folder) / "unet.onnx").read_bytes()


@FUZZ
@given(data=st.data())
def test_damaged_onnx_files(tmp_path, data):
    damaged = bytearray(onnx_bytes())
    if data.draw(st.booleans()):
        damaged = damaged[: data.draw(st.integers(0, len(damaged) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, len(damaged) - 1))
            damaged[at] ^= 1 << data.draw(st.integers(0, 7))
    path = tmp_path / "damaged.onnx"
    path.write_bytes(bytes(damaged))
    layers = load(path, skip_unknown=data.draw(st.booleans()))
    code = report(path, "--skip-unknown")
    assert code == 0 if layers is not None else code in (0, 2)


FLAGS = {
    "--batch": st.one_of(st.integers(-2, 4).map(str), st.sampled_from(["x", "", "1.5", "99999999999999999999"])),
    "--dtype": st.sampled_from(["float32", "float64", "float16", "int8", ""]),
    "--layout": st.sampled_from(["NCHW", "NHWC", "nhwc"]),
    "--cap-workspace": st.one_of(SIZE_TEXT, st.sampled_from(["none", "lots", "-1"])),
    "--passes": st.sampled_from(["fwd", "fwd,fwd", "bwd_data,bwd_filter", "", ",", "sideways"]),
    "--streams": st.sampled_from(["1", "2", "3", "0", "-1", "x"]),
    "--search": st.sampled_from(["heuristic", "exhaustive", "fast"]),
    "--format": st.sampled_from(["table", "json", "csv", "xml"]),
    "--input-shape": st.sampled_from(["1,3,8,8", "1x3x8x8", "x=1,3", "a,b", "=", ""]),
    "--max-slowdown": st.sampled_from(["2%", "0.5", "-1", "nan", "inf%", "x"]),
    "--asymmetric-pads": st.sampled_from(["widen", "error", "crop"]),
}


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: FLAGS[k] for k in keys})))
def test_command_line_flags(tmp_path, flags):
    path = tmp_path / "small.json"
    path.write_text(json.dumps([dict(LAYER, name=f"c{i}") for i in range(3)]))
    report(path, *(token for flag, value in flags.items() for token in (flag, value)))


def test_the_tally_counts_every_area(tmp_path):
    """The fuzz modules, run on their own with three inputs a test, write every area's counts to the tally file (what
    bench/reliability_campaign.py reports). In a process of its own: the counts of this one depend on which tests ran
    before, in what order."""
    tally = tmp_path / "tally.jsonl"
    modules = [str(Path(__file__).with_name(name)) for name in ("test_fuzz_inputs.py", "test_fuzz_ops.py")]
    env = {**os.environ, "WSARENA_FUZZ_EXAMPLES": "3", "WSARENA_FUZZ_TALLY": str(tally)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-k", "not test_the_tally_counts_every_area", *modules], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:]
    rows = [json.loads(line) for line in tally.read_text().splitlines()]
    assert {row["area"] for row in rows} == {"parse_size", "configure", "environment", "model files", "command line",
                                             "conv arguments", "conv out="}
    assert all(row["tried"] > 0 and row["refused as documented"] == row["refused"] for row in rows)
