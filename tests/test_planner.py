"""The planner: totals, streams, caps, bad input, and that the report tells the truth about a real run."""

import contextlib
import enum
import io
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import wsarena
from wsarena import config, conv_backward_data, conv_backward_filter, conv_forward, format_size
from wsarena._gpu import gpu_unusable_reason
from wsarena._report_cli import render_table
from wsarena._sizes import positive_batch
from wsarena.arena import Arena, HostProvider
from wsarena.arena._stats import aligned_size
from wsarena.backends._cpu_backend import CpuBackend
from wsarena.errors import BackendUnavailableError, WorkspaceCapWarning
from wsarena.models import ConvLayer
from wsarena.planner import check_streams_bound, text_progress

from .pipe_helpers import written_pipe

pytestmark = pytest.mark.usefixtures("fresh_arena")  # from conftest: a host arena of the test's own


@pytest.fixture(scope="module")
def resnet50():
    return wsarena.load_model("resnet50")


def test_totals_are_max_and_sum(resnet50):
    p = wsarena.plan(resnet50, batch=2, backend="cpu", cap_workspace=None)
    chosen = [c.workspace_bytes for lp in p.layers for c in lp.choices.values()]
    assert len(p.layers) == 53 and len(chosen) == 53 * 3
    assert p.unshared_bytes == sum(chosen)
    assert p.arena_bytes == max(chosen)
    assert p.held_bytes == aligned_size(max(chosen)) >= p.arena_bytes
    assert p.saved_bytes == p.unshared_bytes - p.arena_bytes > 0


def test_to_dict_follows_the_report_schema(resnet50):
    d = wsarena.plan(resnet50[:3], batch=4, backend="cpu", cap_workspace="1MiB", passes=("fwd", "bwd_filter")).to_dict()
    for key in ("wsarena_version", "model", "backend", "device", "batch", "dtype", "layout", "cap_workspace_bytes",
                "streams", "layers", "arena_bytes", "unshared_bytes", "saved_bytes"):
        assert key in d
    assert (d["backend"], d["batch"], d["cap_workspace_bytes"], d["streams"]) == ("cpu", 4, 1 << 20, 1)
    layer = d["layers"][0]
    assert layer["input_shape"] == [4, 3, 224, 224] and layer["weight_shape"] == [64, 3, 7, 7]
    assert (layer["stride"], layer["padding"], layer["dilation"], layer["groups"]) == ([2, 2], [3, 3], [1, 1], 1)
    assert "bwd_data" not in layer and set(layer["fwd"]) == {"algo", "workspace_bytes"}


def test_exhaustive_plan_leases_under_its_own_cap_not_the_configured_one(resnet50, monkeypatch):
    # The plan's cap is above the configured one: the search leases (and times in) what the plan's cap allows.
    leased, real_measure = [], CpuBackend.measure
    monkeypatch.setattr(CpuBackend, "measure", lambda self, *a: leased.append(a[5].nbytes) or real_measure(self, *a))
    with config(cap_workspace="1KiB"):
        p = wsarena.plan(resnet50[:2], batch=1, backend="cpu", search="exhaustive", cap_workspace="1GiB")
    assert p.cap_workspace == 1 << 30 and max(leased) > 1024  # which algorithm wins is up to the clock


def test_exhaustive_plan_times_each_distinct_shape_once_and_the_ops_follow_it(resnet50, monkeypatch):
    layers = resnet50[4:11]  # layer1.1 and layer1.2 repeat layer1.0's shapes after its downsample
    geoms = {layer.geometry(batch=1) for layer in layers}
    made, timed = [], []
    real_random, real_measure = CpuBackend.random, CpuBackend.measure
    monkeypatch.setattr(CpuBackend, "random", lambda self, *a: made.append(a) or real_random(self, *a))
    monkeypatch.setattr(CpuBackend, "measure", lambda self, *a: timed.append(a) or real_measure(self, *a))
    p = wsarena.plan(layers, batch=1, backend="cpu", search="exhaustive", passes=("fwd",), cap_workspace=None)
    assert len(geoms) < len(layers)
    assert len(made) == 3 * len(geoms) and len(timed) == len(geoms)  # x, w and y per distinct forward shape
    # The ops, searching exhaustively too, find the plan's choices in the cache: nothing is timed again.
    with config(algo_search="exhaustive"):
        for lp in p.layers:
            g = lp.geometry
            x, w = np.zeros(g.input_shape, np.float32), np.zeros(g.weight_shape, np.float32)
            conv_forward(x, w, stride=g.stride, padding=g.padding, dilation=g.dilation, groups=g.groups)
    assert len(timed) == len(geoms)


@pytest.mark.parametrize("search", ["heuristic", "exhaustive"])
def test_a_plan_ranks_a_call_the_backend_ranks_without_some_candidates_once(resnet50, monkeypatch, search):
    """Memory keeps the backend from ranking its last candidate (PartlyRanked): that ranking is not kept for good,
    and each call ranks again; a plan ranks each distinct call once, however many layers repeat it, and another plan
    ranks it again. Each layer that repeated a geometry ranked it again."""
    from wsarena.backends import PartlyRanked

    layers = resnet50[4:11]  # layer1.1 and layer1.2 repeat layer1.0's shapes after its downsample
    geoms = {layer.geometry(batch=1) for layer in layers}
    ranked, real = [], CpuBackend.candidates

    def candidates(self, pass_, geom):
        ranked.append(geom)
        raise PartlyRanked(real(self, pass_, geom)[:-1])

    monkeypatch.setattr(CpuBackend, "candidates", candidates)
    for plans in (1, 2):
        p = wsarena.plan(layers, batch=1, backend="cpu", search=search, passes=("fwd",), cap_workspace=None)
        assert len(geoms) < len(layers) and len(ranked) == plans * len(geoms)
    chosen = {lp.geometry: lp.choices["fwd"] for lp in p.layers}
    assert all(lp.choices["fwd"] == chosen[lp.geometry] for lp in p.layers)


def test_a_plan_searches_a_call_whose_search_could_time_nothing_once(resnet50, monkeypatch):
    """Every timing runs out of memory of its own (NumPy's temporaries): each search times nothing and the call gets
    the heuristic order, kept for this call alone. A plan searches each distinct call once, however many layers
    repeat it, making its operands once, and another plan searches again. Each layer that repeated a geometry
    made fresh operands and searched again."""
    from wsarena.backends import cpu

    layers = resnet50[4:11]  # layer1.1 and layer1.2 repeat layer1.0's shapes after its downsample
    geoms = {layer.geometry(batch=1) for layer in layers}
    made, timed = [], []
    real_random = CpuBackend.random

    def measure(self, *args):
        timed.append(1)
        raise MemoryError("no memory for the search's temporaries")

    monkeypatch.setattr(CpuBackend, "random", lambda self, *a: made.append(a) or real_random(self, *a))
    monkeypatch.setattr(CpuBackend, "measure", measure)
    for plans in (1, 2):
        with pytest.warns(wsarena.SearchFallbackWarning) if plans == 1 else contextlib.nullcontext():
            p = wsarena.plan(layers, batch=1, backend="cpu", search="exhaustive", passes=("fwd",), cap_workspace=None)
        assert len(geoms) < len(layers) and len(made) == 3 * plans * len(geoms)
    assert timed  # the searches ran, and timed nothing
    want = {g: cpu.candidates("fwd", g)[0] for g in geoms}  # the heuristic order's first
    assert all(lp.choices["fwd"].algo == want[lp.geometry] for lp in p.layers)


@pytest.mark.parametrize("alike", [True, False])
def test_a_plan_asks_once_whether_a_ranking_kept_for_operands_alike_serves_a_call(resnet50, monkeypatch, alike):
    """The backend refuses its last candidate on the search's operands (PartlyTimed's refused, as cuDNN refuses a
    tensor-core algorithm on a view): the ranking without it serves only calls on operands alike, which the ops ask of
    each call's own. A plan's operands are its own random ones, the same for each layer that repeats a call: it asks
    once per plan, making its operands once, where they are alike and where no memory can make them, and each layer
    gets the same choice. Each layer that repeated a geometry made fresh operands to ask again."""
    from wsarena.backends import PartlyTimed

    layers = resnet50[4:11]  # layer1.1 and layer1.2 repeat layer1.0's shapes after its downsample
    geoms = {layer.geometry(batch=1) for layer in layers}
    made = []
    real_random, real_measure = CpuBackend.random, CpuBackend.measure

    def random(self, *args):
        made.append(args)
        if len(made) > 3 * len(geoms) and not alike:
            raise MemoryError("no memory for the operands")
        return real_random(self, *args)

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        timed = real_measure(self, pass_, geom, a, b, out, workspace, candidates, stream)
        refused = [c for c in candidates if c.algo == candidates[-1].algo]
        raise PartlyTimed([c for c in timed if c not in refused], [], refused)

    monkeypatch.setattr(CpuBackend, "random", random)
    monkeypatch.setattr(CpuBackend, "measure", measure)
    monkeypatch.setattr(CpuBackend, "operands_key", lambda self, a, b, out: "alike", raising=False)
    p = wsarena.plan(layers, batch=1, backend="cpu", search="exhaustive", passes=("fwd",), cap_workspace=None)
    assert len(geoms) < len(layers) and len(made) == 3 * len(geoms)
    first = {lp.geometry: lp.choices["fwd"] for lp in p.layers}
    with pytest.warns(wsarena.SearchFallbackWarning) if not alike else contextlib.nullcontext():
        p = wsarena.plan(layers, batch=1, backend="cpu", search="exhaustive", passes=("fwd",), cap_workspace=None)
    assert len(made) == 3 * len(geoms) + (3 if alike else 1) * len(geoms)
    chosen = {lp.geometry: lp.choices["fwd"] for lp in p.layers}
    assert all(lp.choices["fwd"] == chosen[lp.geometry] for lp in p.layers)
    if alike:
        assert chosen == first


def test_cap_bounds_every_choice(resnet50):
    cap = 2 << 20
    p = wsarena.plan(resnet50, batch=8, backend="cpu", cap_workspace=cap)
    assert all(c.workspace_bytes <= cap for lp in p.layers for c in lp.choices.values())
    zero = wsarena.plan(resnet50, batch=8, backend="cpu", cap_workspace=0)
    assert zero.arena_bytes == 0 == zero.unshared_bytes


def test_a_capped_plan_warns_about_nothing_and_leaves_the_warning_to_the_ops(resnet50):
    layers, cap = resnet50[:5], 64 << 10
    free = wsarena.plan(layers, batch=4, backend="cpu", cap_workspace=None, passes=("fwd",))
    assert any(lp.choices["fwd"].workspace_bytes > cap for lp in free.layers)  # the cap excludes favourites
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the report shows each choice: a warning per excluded algorithm is noise
        capped = wsarena.plan(layers, batch=4, backend="cpu", cap_workspace=cap, passes=("fwd",))
    g = next(lp.geometry for lp, f in zip(capped.layers, free.layers) if f.choices["fwd"].workspace_bytes > cap)
    x, w = np.zeros(g.input_shape, np.float32), np.zeros(g.weight_shape, np.float32)
    with config(cap_workspace=cap), pytest.warns(WorkspaceCapWarning):  # running the shape still says so, once
        conv_forward(x, w, stride=g.stride, padding=g.padding, dilation=g.dilation, groups=g.groups)


def test_cap_takes_what_configure_takes(resnet50):
    assert wsarena.plan(resnet50[:2], backend="cpu", cap_workspace="none").cap_workspace is None
    assert wsarena.plan(resnet50[:2], backend="cpu", cap_workspace="64KiB").cap_workspace == 64 << 10


def test_configured_cap_is_the_default(resnet50):
    with config(cap_workspace="1MiB"):
        assert wsarena.plan(resnet50[:5], batch=4, backend="cpu").cap_workspace == 1 << 20
    assert wsarena.plan(resnet50[:5], batch=4, backend="cpu").cap_workspace is None


def test_arguments_replace_invalid_environment_variables(resnet50, monkeypatch):
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "garbage")
    monkeypatch.setenv("WSARENA_ALGO_SEARCH", "fast")
    monkeypatch.setenv("WSARENA_BACKEND", "gpu")
    wsarena._config._reset()
    p = wsarena.plan(resnet50[:2], backend="cpu", search="heuristic", cap_workspace="1MiB")
    assert (p.backend, p.search, p.cap_workspace) == ("cpu", "heuristic", 1 << 20)
    with pytest.raises(ValueError, match="WSARENA_CAP_WORKSPACE='garbage'"):  # a setting left to the environment
        wsarena.plan(resnet50[:2], backend="cpu", search="heuristic")


@pytest.fixture
def offline_properties(monkeypatch, tmp_path):
    """A device-properties file, planned for by the CPU backend in place of cuDNN's (which needs cuDNN 9.8): what
    reaches the backend is what the tests look at. The files the backend was made for are listed."""
    from wsarena import planner
    from wsarena.backends import get_backend

    made = []

    def backend(text, source):
        made.append(source)
        return get_backend("cpu")

    monkeypatch.setattr(planner, "device_properties_backend", backend)
    path = tmp_path / "props.json"
    path.write_text("{}")
    return path, made


@pytest.mark.parametrize("variable", ["WSARENA_BACKEND", "WSARENA_ALGO_SEARCH", "WSARENA_CUDNN_API"])
def test_device_properties_decide_the_backend_search_and_api_whatever_their_variables(resnet50, monkeypatch,
                                                                                    offline_properties, variable):
    """device_properties plans cuDNN's heuristic choices through the graph API: an invalid variable of those
    settings does not matter, as an argument's would not; the cap's still does, as the plan is made under it."""
    path, made = offline_properties
    monkeypatch.setenv(variable, "bogus")
    wsarena._config._reset()
    p = wsarena.plan(resnet50[:2], device_properties=path)
    assert (p.backend, p.search, made) == ("cudnn", "heuristic", [str(path)])
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "bogus")
    wsarena._config._reset()
    with pytest.raises(ValueError, match="WSARENA_CAP_WORKSPACE='bogus'"):
        wsarena.plan(resnet50[:2], device_properties=path)


def test_device_properties_in_a_file_whose_name_starts_with_a_brace(resnet50, offline_properties, monkeypatch,
                                                                     capsys):
    """A path is a file whatever its name, and so is the command's FILE: ``{gpu}.json`` was taken for the JSON text
    itself, and cuDNN refused its name as properties, naming no file."""
    from wsarena.cli import main

    path, made = offline_properties
    braced = path.rename(path.with_name("{gpu}.json"))
    wsarena.plan(resnet50[:1], device_properties=braced)
    monkeypatch.chdir(braced.parent)
    assert main(["report", "resnet50", "--device-properties", "{gpu}.json", "--format", "json"]) == 0
    assert capsys.readouterr().err == ""
    assert made == [str(braced), "{gpu}.json"]
    wsarena.plan(resnet50[:1], device_properties=' {"warpSize": 32}')  # a str that starts as JSON is the text
    assert made[-1] is None


def test_device_properties_larger_than_any_gpus_are_refused_unread(resnet50, offline_properties):
    """A GPU's properties take about 1 KiB: more than 64 KiB, in a file or as text, is bad input, and no more of a
    file is read (cuDNN copied 50 MiB of them over and over, to 3 GiB)."""
    path, made = offline_properties
    path.write_text("{}" + " " * (64 << 10))
    with pytest.raises(ValueError, match=rf"^device properties '{path}' are larger than 64 KiB: a GPU's take about"):
        wsarena.plan(resnet50[:1], device_properties=path)
    with pytest.raises(ValueError, match="^device properties given as text are larger than 64 KiB"):
        wsarena.plan(resnet50[:1], device_properties=path.read_text())
    assert made == []
    path.write_text("{}" + " " * ((64 << 10) - 2))
    wsarena.plan(resnet50[:1], device_properties=path)
    assert made == [str(path)]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero, a file without end")
def test_device_properties_from_a_file_without_end_are_refused(tmp_path):
    """``--device-properties /dev/zero`` read until memory ran out, then exited 3 with an empty error line (a
    MemoryError's); a child under a 3 GiB address-space limit, so that the test machine's memory is not what runs
    out. It is a character device, refused unread."""
    model = tmp_path / "one.json"
    model.write_text(json.dumps([{"name": "c", "input_shape": [1, 8, 16, 16], "weight_shape": [16, 8, 3, 3]}]))
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "from wsarena.cli import main\n"
            "sys.exit(main(['report', sys.argv[1], '--device-properties', '/dev/zero']))\n")
    result = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("wsarena: error: cannot read the device properties '/dev/zero': it is a character device, "
                             "not a regular file or a pipe\n")


@pytest.mark.parametrize("kind", ["folder", "link-to-device", "socket"])
@pytest.mark.parametrize("as_path", [False, True])
def test_device_properties_from_no_regular_file_nor_a_pipe_are_refused_unread(resnet50, offline_properties,
                                                                             monkeypatch, kind, as_path):
    """A folder given as the device properties file was "Is a directory", and a link to a device read (/dev/zero
    without end). Each is refused, saying what it is, as a model path that is neither is, and nothing is planned."""
    import socket

    path, made = offline_properties
    path.unlink()
    monkeypatch.chdir(path.parent)  # a socket's path is short: at most 107 bytes
    with socket.socket(socket.AF_UNIX) as listening:
        if kind == "folder":
            path.mkdir()
        elif kind == "socket":
            listening.bind(path.name)
        else:
            path.symlink_to(os.devnull)
        what = {"folder": "a folder", "link-to-device": "a character device", "socket": "a socket"}[kind]
        with pytest.raises(ValueError, match=rf"^cannot read the device properties '{re.escape(str(path))}': it is "
                                             f"{what}, not a regular file or a pipe$"):
            wsarena.plan(resnet50[:1], device_properties=path if as_path else str(path))
    assert made == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["empty file", "blank file", "fifo"])
def test_empty_device_properties_are_refused_before_cudnn(resnet50, offline_properties, kind):
    """A FIFO given as the device properties file that no writer has open was waited on until one came, for good
    where none came: it reads as empty, at once (the timeout fails a wait). Empty properties, from a pipe or a file,
    are refused, blank ones too, where they reached cuDNN, which says no JSON, where it loads, and nothing is
    planned."""
    path, made = offline_properties
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        why = r": the pipe gave nothing \(no writer had it open, or its writer wrote nothing\)"
    else:
        path.write_bytes(b"" if kind == "empty file" else b" \n\t\n")  # blank: what echo "$UNSET" gives
        why = ""
    with pytest.raises(ValueError, match=rf"^device properties '{re.escape(str(path))}' are empty{why}$"):
        wsarena.plan(resnet50[:1], device_properties=path)
    assert made == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", ["small", "past the limit"])
def test_device_properties_are_read_from_a_pipe(resnet50, offline_properties, monkeypatch, size):
    """``--device-properties <(ssh gpu-host cat props.json)`` names a pipe (/dev/fd/63), which was refused as no
    regular file: it is read to its end, as cat reads it, and planned for, or, past the 64 KiB and a byte no GPU's
    properties come near, read no further and refused."""
    from wsarena import planner

    _, made = offline_properties
    texts = []
    real = planner.device_properties_backend
    monkeypatch.setattr(planner, "device_properties_backend", lambda text, source: texts.append(text) or
                        real(text, source))
    properties = json.dumps({"deviceName": "NVIDIA H100", "multiProcessorCount": 132})
    data = (properties + " " * (64 << 10 if size == "past the limit" else 0) + "\n").encode()
    with written_pipe(data) as path:
        if size == "small":
            wsarena.plan(resnet50[:1], device_properties=path)
        else:
            with pytest.raises(ValueError, match=f"^device properties '{path}' are larger than 64 KiB"):
                wsarena.plan(resnet50[:1], device_properties=path)
    assert (texts, made) == (([data.decode()], [path]) if size == "small" else ([], []))


def test_an_exhaustive_plan_leases_under_its_own_cap(resnet50, monkeypatch):
    """The configured cap is not the plan's: the search's leases follow the plan's (none), so it times the candidates
    above the configured 1 KiB in a workspace they fit. Read from what the search is given, not from the choice: the
    fastest may need no workspace on a loaded machine, and a choice above 1 KiB failed the test at random."""
    from wsarena.backends._cpu_backend import CpuBackend

    real, given = CpuBackend.measure, []

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        given.append((workspace.array.nbytes, [c.workspace_bytes for c in candidates]))
        return real(self, pass_, geom, a, b, out, workspace, candidates, stream)

    monkeypatch.setattr(CpuBackend, "measure", measure)
    with config(cap_workspace="1KiB"):
        p = wsarena.plan(resnet50[:1], backend="cpu", search="exhaustive", cap_workspace=None, passes=("fwd",))
    assert p.cap_workspace is None and given
    assert max(need for _, needs in given for need in needs) > 1024
    assert all(held >= max(needs) for held, needs in given)
    assert all(c.time_ms is not None for lp in p.layers for c in lp.choices.values())


def test_streams_multiply_and_assignments_sum(resnet50):
    layers = resnet50[:6]
    one = wsarena.plan(layers, batch=2, backend="cpu")
    three = wsarena.plan(layers, batch=2, backend="cpu", streams=3)
    assert three.arena_bytes == 3 * one.arena_bytes and three.to_dict()["streams"] == 3
    assert [lp.stream for lp in three.layers] == [0] * 6  # shared: any stream runs any layer, each named by the first
    split = wsarena.plan(layers, batch=2, backend="cpu", streams=[0, 1, 1, 0, 2, 2])
    per = [max(lp.largest_bytes for lp in split.layers if lp.stream == s) for s in range(3)]
    assert split.stream_bytes == tuple(per)
    assert split.arena_bytes == sum(per) and split.streams == 3
    assert split.held_bytes == sum(aligned_size(b) for b in per)


def test_an_assignment_counts_only_the_streams_it_lists(resnet50):
    """streams=[5, 0, 0, 0, 0, 5] leaves streams 1 to 4 idle: the plan has two streams, each with its own layers'
    largest workspace, in the order of their indices. It counted six, each idle one holding 0 B (a report of
    "6 streams of 0 B to ...", and reserve_for() asking for six streams)."""
    from wsarena._report_cli import render_table

    layers = resnet50[:6]
    split = wsarena.plan(layers, batch=2, backend="cpu", streams=[5, 0, 0, 0, 0, 5])
    per = [max(lp.largest_bytes for lp in split.layers if lp.stream == s) for s in (0, 5)]
    assert split.stream_bytes == tuple(per) and split.streams == 2 and split.to_dict()["streams"] == 2
    assert split.to_dict()["stream_bytes"] == per and split.arena_bytes == sum(per)
    assert split.held_bytes == sum(aligned_size(b) for b in per) and min(per) > 0
    assert render_table(split).splitlines()[-2].endswith(
        f" (2 streams of {format_size(min(per))} to {format_size(max(per))})")
    arena = Arena(HostProvider())
    arena.reserve_for(split, streams=["a", "b"])
    assert {k: s.capacity_bytes for k, s in arena.stats().streams.items()} == {
        "a": aligned_size(per[0]), "b": aligned_size(per[1])}
    packed = wsarena.plan(layers, batch=2, backend="cpu", streams=[1, 0, 0, 0, 0, 1])  # the same run, streams 0, 1
    assert split.stream_bytes == packed.stream_bytes


@pytest.mark.parametrize(("labels", "packed"), [
    ([0, 5], [0, 1]),
    ([7, 7], [0, 0]),
    ([2**46, 0], [1, 0]),  # a stream's handle for its index
    ([0, 10**5000], [0, 1]),
])
def test_an_assignment_names_its_streams_by_any_index(resnet50, labels, packed):
    """An index of streams=[...] is a label: the plan has the streams the list names, never more than its layers.
    streams=[0, 5] on two layers was refused as more streams than layers, as if it planned six."""
    layers = resnet50[:2]
    labelled = wsarena.plan(layers, backend="cpu", streams=labels)
    assert labelled.streams == len(set(labels)) <= len(layers)
    assert labelled.stream_bytes == wsarena.plan(layers, backend="cpu", streams=packed).stream_bytes
    assert [lp.stream for lp in labelled.layers] == labels


def test_progress_is_called_as_each_layer_is_planned(resnet50, monkeypatch):
    layers, passes = resnet50[:4], ("fwd", "bwd_filter")
    chosen, calls = [], []
    real = wsarena.planner.select
    monkeypatch.setattr(wsarena.planner, "select", lambda *a, **kw: chosen.append(a[1]) or real(*a, **kw))

    def progress(done, total, name):
        calls.append((done, total, name, len(chosen)))

    wsarena.plan(layers, backend="cpu", passes=passes, progress=progress)
    # (layers done, layers in all, the layer just planned, passes chosen so far)
    assert calls == [(i, len(layers), layer.name, i * len(passes)) for i, layer in enumerate(layers, 1)]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_text_progress_draws_a_growing_bar_on_a_terminal_and_wipes_it_at_the_end():
    terminal = FakeTerminal()
    show = text_progress(terminal)
    names = ["conv1", "layer1.0.conv1", "layer1.0.conv2", "x" * 60]
    for done, name in enumerate(names, 1):
        show(done, len(names), name)
    *frames, wipe, end = terminal.getvalue().split("\r")[1:]
    assert len(frames) == len(names) and end == ""
    parsed = [re.fullmatch(r"\[(#*)(\.*)\] (\d+)/(\d+) (.*)", frame) for frame in frames]
    assert all(parsed), frames
    width = len(parsed[0][1] + parsed[0][2])
    for done, (m, name) in enumerate(zip(parsed, names), 1):
        filled, empty, shown_done, total, shown_name = m.groups()
        assert len(filled) + len(empty) == width and len(filled) == pytest.approx(width * done / len(names), abs=1)
        assert (int(shown_done), int(total), shown_name.rstrip()) == (done, len(names), name[:40])
    assert len(parsed[-1][1]) == width  # full when every layer is done
    assert wipe.strip() == "" and len(wipe) >= max(len(f) for f in frames)


def test_text_progress_on_a_closed_stream_draws_nothing_and_one_closed_midway_stops_drawing():
    """isatty() of a closed file raises ValueError: text_progress() raised it, and wsarena report with a
    sys.stderr a caller of main() closed exited 2; a write that fails later (a terminal hung up) ended the work."""
    closed = FakeTerminal()
    closed.close()
    show = text_progress(closed)
    show(1, 2, "conv")
    show.clear()
    terminal = FakeTerminal()
    show = text_progress(terminal)
    show(1, 3, "conv1")
    drawn = terminal.getvalue()
    terminal.close()
    show(2, 3, "conv2")  # nothing raised; nothing drawn from here on
    show.clear()
    assert drawn.startswith("\r[") and show.out is None and not show.shown


@pytest.mark.parametrize(("encoding", "name", "escape"),
                         [("ascii", "\u00fcbung", "\\xfc"), ("cp437", "s\u00e3o", "\\xe3")])
def test_text_progress_escapes_what_the_terminals_encoding_cannot_show_and_keeps_drawing(encoding, name, escape):
    """A layer name the terminal's encoding has no character for (ü on an ASCII stream, the ã that cp437 lacks)
    raised UnicodeEncodeError, a ValueError, which the bar took for a terminal gone: it drew nothing from there on.
    It is written with a backslash escape, as the command's lines are, cut to the bar's 40 characters once escaped,
    so that the wipe at the end covers it."""

    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    raw = io.BytesIO()
    terminal = Terminal(raw, encoding=encoding, errors="strict", newline="")
    show = text_progress(terminal)
    names = ["conv1", name, name * 30, "conv4"]
    for done, layer in enumerate(names, 1):
        show(done, len(names), layer)
    terminal.flush()
    *frames, wipe, end = raw.getvalue().decode(encoding).split("\r")[1:]
    assert len(frames) == len(names) and end == ""
    shown = [re.fullmatch(r"\[[#.]*\] \d+/\d+ (.*)", frame)[1].rstrip() for frame in frames]
    expected = name.encode(encoding, "backslashreplace").decode(encoding)
    assert escape in expected and shown == ["conv1", expected, (expected * 30)[:40], "conv4"]
    assert wipe.strip() == "" and len(wipe) >= max(len(f) for f in frames)


@pytest.mark.parametrize(("encoding", "name", "escape"), [("ascii", "\u00fc", "\\xfc"), ("cp437", "\u00e3", "\\xe3")])
def test_text_progress_pads_a_name_escaped_for_a_stream_that_names_no_encoding_by_its_escaped_width(
    encoding, name, escape
):
    """A caller's stream with no encoding attribute, whose writes refuse what ASCII (or cp437) lacks: the name was cut
    and padded to its 40 columns unescaped, then the whole line escaped on the refusal, so that a name of ü's took
    four columns each (a line of 167 columns on an 80-column terminal, which wrapped) and the wipe covered the 77
    counted. The name is escaped in the codec the refusal names before it is cut and padded, as for a stream that
    names one; a code page's refusal names "charmap", latin-1's codec, whose escapes kept the ã cp437 lacks, and the
    bar stopped: ASCII's escape it."""

    class Terminal:
        def __init__(self):
            self.written = []

        def isatty(self):
            return True

        def write(self, text):
            text.encode(encoding)  # UnicodeEncodeError, as a stream writing in that encoding raises it
            self.written.append(text)

        def flush(self):
            pass

    terminal = Terminal()
    assert not hasattr(terminal, "encoding")
    show = text_progress(terminal)
    names = ["conv1", name * 30, f"{name}bung", "conv4"]
    for done, layer in enumerate(names, 1):
        show(done, len(names), layer)
    *frames, wipe, end = "".join(terminal.written).split("\r")[1:]
    assert len(frames) == len(names) and end == ""
    assert [len(frame) for frame in frames] == [len(frames[0])] * len(names)  # the columns line up
    assert len(frames[0]) <= 79 and wipe == " " * len(frames[0])  # an unknown width is taken as 80 columns
    shown = [re.fullmatch(r"\[[#.]*\] \d+/\d+ (.*)", frame)[1].rstrip() for frame in frames]
    assert shown == ["conv1", (escape * 30)[:40], f"{escape}bung", "conv4"]


_PTY = pytest.mark.skipif(not hasattr(os, "openpty") or sys.platform == "win32", reason="a pseudo-terminal")


def _set_columns(fd, columns):
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))


def _drawn_on_a_pseudo_terminal(columns, draw, frames):
    """What ``draw(show, follower)`` draws with text_progress() on a pseudo-terminal of ``columns`` (None: its size
    never set), split at each ``"\\r"``: ``"", *frames, wipe, ""``. ``frames`` is how many it draws."""
    import select

    master, follower = os.openpty()
    if columns is not None:
        _set_columns(follower, columns)
    terminal = open(follower, "w", encoding="utf-8")  # noqa: SIM115 - closed below, with the reads
    written = b""
    try:
        draw(text_progress(terminal), follower)
        terminal.flush()
        # read until each frame's "\r" and the wipe's two have come; the wait only bounds a failure
        while written.count(b"\r") < frames + 2 and select.select([master], [], [], 30)[0]:
            written += os.read(master, 1 << 16)
    finally:
        terminal.close()
        os.close(master)
    return written.decode().split("\r")


@_PTY
@pytest.mark.parametrize(("columns", "drawn", "total"), [(80, range(100, 104), 159), (50, range(1, 4), 3),
                                                         (20, range(1, 4), 3), (2, range(1, 4), 3)])
def test_text_progress_fits_each_line_in_the_terminals_width(columns, drawn, total):
    """The bar's line, 78 to 85 characters, was drawn whole on any terminal: a line as wide as the terminal or
    wider wraps, and "\\r" returns to the start of its last row only, so that a narrower terminal (an 80-column one
    from the 100th layer on) got a row of bar for each layer; the wipe at the end, 85 spaces, wrapped on an
    80-column one too. Each line, the wipe's included, takes fewer characters than the terminal has columns."""

    def draw(show, follower):
        for done in drawn:
            show(done, total, f"layer{done}.conv" + "x" * 40)
        show.clear()

    first, *frames, wipe, end = _drawn_on_a_pseudo_terminal(columns, draw, len(drawn))
    assert (first, end) == ("", "") and len(frames) == len(drawn) and all(f.startswith("[") for f in frames), frames
    assert all(0 < len(line) < columns for line in [*frames, wipe]), [len(line) for line in frames]
    assert wipe == " " * len(frames[-1])
    assert frames[0].startswith(f"[{'#' * (30 * drawn[0] // total)}"[:columns - 1])


@_PTY
@pytest.mark.parametrize(("columns", "most"), [(None, 79), (0, 79), (1, 0)])
def test_text_progress_on_a_terminal_of_no_size_or_one_column(columns, most):
    """A terminal whose size was never set says 0 columns, and the whole line was drawn there, as on one of one
    column, where each of its 85 characters took a row. A width unknown is taken as 80 columns; one column has no
    room for a character."""

    def draw(show, follower):
        for done in range(100, 104):
            show(done, 159, "layer.conv" + "x" * 60)
        show.clear()

    first, *frames, wipe, end = _drawn_on_a_pseudo_terminal(columns, draw, 4)
    assert (first, end) == ("", "") and len(frames) == 4 and wipe == " " * most
    assert [len(frame) for frame in frames] == [most] * 4 and all(frame.startswith("[##"[:most]) for frame in frames)


@_PTY
@pytest.mark.parametrize(("columns", "kept"), [(100, 20), (50, 6), (49, 5)])
def test_text_progress_counts_a_wide_character_as_two_columns(columns, kept):
    """A character of a layer name that a terminal draws two columns wide (Chinese, Japanese, Korean) was counted
    as one: 40 of them took 80 columns in the name's 40, and the line wrapped, a row of bar for each layer, where
    the terminal was narrower than the 117 columns the line took. It is cut by columns, and a wide character that
    would take the line's last allowed column and one past it is left out whole."""
    name = "\u5377\u79ef\u5c42" * 20  # "convolution layer" in Chinese, 60 wide characters

    def draw(show, follower):
        for done in range(1, 3):
            show(done, 3, name)
        show.clear()

    first, *frames, wipe, end = _drawn_on_a_pseudo_terminal(columns, draw, 2)
    heads = ["[" + "#" * 10 + "." * 20 + "] 1/3 ", "[" + "#" * 20 + "." * 10 + "] 2/3 "]
    assert (first, end) == ("", "") and frames == [head + name[:kept] for head in heads]
    assert wipe == " " * (len(heads[1]) + 2 * kept)  # each column drawn, as the head's characters take one each


@_PTY
def test_text_progress_fits_the_terminals_width_after_a_resize():
    """The width is the terminal's as each line is drawn: a terminal made narrower midway gets lines that fit it
    from the next layer on, and the wipe covers the last line drawn, no further than the width then."""
    lengths = []

    def draw(show, follower):
        show(100, 159, "layer1.conv" + "x" * 40)
        _set_columns(follower, 30)
        show(101, 159, "layer2.conv" + "x" * 40)
        _set_columns(follower, 100)
        show(102, 159, "layer3")
        show(103, 159, "layer4.conv" + "x" * 40)
        _set_columns(follower, 40)
        show(104, 159, "layer5")
        lengths.append(show.drawn)
        _set_columns(follower, 20)
        show.clear()

    first, *frames, wipe, end = _drawn_on_a_pseudo_terminal(80, draw, 5)
    assert (first, end) == ("", "") and [len(frame) for frame in frames] == [79, 29, 81, 81, 39]
    assert lengths == [39] and wipe == " " * 19


def test_text_progress_draws_nothing_where_the_stream_is_not_a_terminal():
    stream = io.StringIO()
    show = text_progress(stream)
    for done in (1, 2):
        show(done, 2, "conv")
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch": 0}, ValueError, "batch"),
        ({"dtype": "int8"}, ValueError, "dtype"),
        ({"dtype": "FLOAT32"}, ValueError, "dtype"),
        ({"dtype": "f4"}, ValueError, "dtype"),  # NumPy's spellings are not names ("float" would be float64)
        ({"dtype": None}, ValueError, "dtype"),  # which NumPy would read as float64
        ({"dtype": np.int32}, ValueError, "dtype"),
        ({"dtype": object()}, ValueError, "dtype"),
        ({"passes": ("fwd", "bwd")}, ValueError, "passes"),
        ({"passes": ("fwd", "fwd")}, ValueError, "passes must be distinct names"),
        # an array's == answers an array: NumPy's "truth value ... is ambiguous", or "unhashable type" of one element
        ({"passes": [np.array(["fwd", "bwd_data"])]}, ValueError, r"passes must be distinct names .*, not \(array"),
        ({"passes": [np.array(["fwd"])]}, ValueError, r"passes must be distinct names .*, not \(array"),
        ({"streams": 0}, ValueError, "streams"),
        ({"batch": True}, TypeError, "batch must be a positive int, not True"),
        ({"batch": 2.0}, TypeError, "batch must be a positive int, not 2.0"),
        ({"batch": "2"}, TypeError, "batch must be a positive int, not '2'"),
        ({"batch": 0}, ValueError, "batch must be a positive int, not 0"),
        ({"streams": [0, 1]}, ValueError, "assigns 2 layers"),
        ({"streams": [0, -1, 1]}, ValueError, r"streams\[1\] must be a stream index >= 0, not -1"),
        ({"streams": [0, True, 1]}, TypeError, r"streams\[1\] must be an int"),
        ({"streams": [0, 1.0, 1]}, TypeError, r"streams\[1\] must be an int"),
        ({"streams": True}, TypeError, "streams must be an int or a sequence"),
        ({"streams": 2.0}, TypeError, "streams must be an int or a sequence"),
        ({"streams": None}, TypeError, "streams must be an int or a sequence"),
        ({"streams": "012"}, TypeError, "streams must be an int or a sequence"),
        ({"cap_workspace": "lots"}, ValueError, "size"),
        ({"search": "fastest"}, ValueError, "search"),
        # refused before the search or a GPU's properties are read: "{}" is no GPU's
        ({"backend": None, "device_properties": "{}", "search": "exhaustive"}, ValueError, "cannot time algorithms"),
        ({"backend": None, "device_properties": "{}", "max_slowdown": 0.1}, ValueError, "cannot time algorithms"),
        ({"max_slowdown": 0.1, "cap_workspace": "1MiB"}, ValueError, "give cap_workspace or max_slowdown, not both"),
        ({"max_slowdown": 0.1, "cap_workspace": None}, ValueError, "give cap_workspace or max_slowdown, not both"),
        ({"max_slowdown": 0.1, "search": "heuristic"}, ValueError, "max_slowdown needs search='exhaustive'"),
        ({"backend": "tpu"}, ValueError, "backend"),
        ({"dtype": "float16"}, ValueError, "float16"),
        pytest.param(
            {"dtype": "float16", "backend": "auto"}, BackendUnavailableError, "float16",
            marks=pytest.mark.skipif(gpu_unusable_reason() is None, reason="with a GPU, auto is cudnn: float16 plans"),
        ),
    ],
)
def test_bad_arguments(resnet50, kwargs, error, match):
    kwargs = {"backend": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        wsarena.plan(resnet50[:3], **kwargs)


@pytest.mark.parametrize(("batch", "shown"), [(2**31, "2147483648"), (np.int64(2**40), repr(np.int64(2**40))),
                                           (10**5000, "an integer of 16610 bits")], ids=["2**31", "int64", "10**5000"])
def test_a_batch_above_2_31_is_refused_naming_batch(resnet50, batch, shown):
    """A batch above what a cuDNN descriptor holds was refused as the first layer's input_shape (a ModelError), batch
    not named, where --batch named its bound; plan(), tune() and a layer's geometry now say it as --batch does.
    2**31 - 1 itself is planned."""
    said = f"batch must be at most 2**31 - 1 = 2147483647, the largest dimension a cuDNN descriptor holds, not {shown}"
    for call in (lambda: wsarena.plan(resnet50[:3], batch=batch, backend="cpu", passes=("fwd",)),
                 lambda: wsarena.tune(resnet50[:1], batch=batch, backend="cpu", passes=("fwd",)),
                 lambda: resnet50[0].geometry(batch=batch)):
        with pytest.raises(ValueError) as raised:
            call()
        assert type(raised.value) is ValueError and str(raised.value) == said
    p = wsarena.plan(resnet50[:3], batch=2**31 - 1, backend="cpu", passes=("fwd",))
    assert p.batch == 2**31 - 1 and p.layers[0].geometry.batch == 2**31 - 1


def test_pass_names_given_as_str_subclasses_are_kept_as_the_plain_names(resnet50):
    """A pass given as a (str, Enum) member or a numpy.str_ is the name it holds, and the plan keeps the plain str: a
    (str, Enum) member formats as its class's name ("Name.BWD_DATA"), which the report's head would show."""

    class Name(str, enum.Enum):
        BWD_DATA = "bwd_data"

    p = wsarena.plan(resnet50[:1], backend="cpu", passes=[Name.BWD_DATA, np.str_("fwd")])
    assert p.passes == ("bwd_data", "fwd") and [type(name) for name in p.passes] == [str, str]
    assert [type(name) for name in p.layers[0].choices] == [str, str]
    head = render_table(p).splitlines()[3]
    assert "bwd_data algo" in head and "fwd algo" in head and "Name." not in head


def test_a_layout_given_as_a_str_subclass_is_kept_as_the_plain_name(resnet50):
    """layout=numpy.str_("NHWC") was kept as given by the plan and its layers' geometries, as passes are not."""
    p = wsarena.plan(resnet50[:2], backend="cpu", layout=np.str_("NHWC"))
    held = [p.layout, *(layer.geometry.layout for layer in p.layers)]
    assert held == ["NHWC"] * 3 and {type(name) for name in held} == {str} and "np.str_" not in repr(p)


@pytest.mark.parametrize("entry", [wsarena.plan, wsarena.tune])
def test_the_model_name_is_text_or_a_path(resnet50, tmp_path, entry):
    """plan(model=Path(...)) kept the path, and to_dict(), which promises JSON, held it: json.dumps() failed, far
    from the call ("Object of type PosixPath is not JSON serializable"). A path is named by its text, and what is
    neither is refused at once."""
    path = tmp_path / "model.onnx"
    made = entry(resnet50[:1], backend="cpu", model=path)
    assert made.to_dict()["model"] == str(path) and json.loads(json.dumps(made.to_dict()))["model"] == str(path)
    for bad in (5, b"model.onnx", ["model"]):
        with pytest.raises(TypeError, match=r"^model must be a str, the model's name in the report, or a path, not "):
            entry(resnet50[:1], backend="cpu", model=bad)
    # a str subclass (numpy.str_) is kept as the plain text, as passes are: its repr was the plan's "np.str_('r')"
    made = entry(resnet50[:1], backend="cpu", model=np.str_("resnet"))
    named = made.model if entry is wsarena.plan else made.uncapped.model
    assert named == "resnet" and type(named) is str and "np.str_" not in repr(made)


_LONG = "x" * 100_000


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"search": _LONG}, "search must be one of ('heuristic', 'exhaustive'), not 'xxx"),
    ({"backend": _LONG, "device_properties": "{}"}, "device_properties plans for a cuDNN GPU: backend must be 'cudnn'"),
    ({"batch": _LONG}, "batch must be a positive int, not 'xxx"),
    ({"batch": -(10**5000)}, "batch must be a positive int, not a negative integer of 16610 bits"),
    ({"streams": _LONG}, "streams must be an int or a sequence of stream indices, not 'xxx"),
    ({"streams": -(10**5000)}, "streams must be >= 1, not a negative integer of 16610 bits"),
    ({"streams": 10**5000}, "streams=an integer of 16610 bits is more than the model's 3 layer(s)"),
    ({"streams": [0, _LONG, 1]}, "streams[1] must be an int, a stream index, not 'xxx"),
    ({"streams": [0, -(10**5000), 1]}, "streams[1] must be a stream index >= 0, not a negative integer of 16610 bits"),
    ({"passes": (_LONG,)}, "passes must be distinct names from fwd, bwd_data, bwd_filter, not ('xxx"),
], ids=["search", "backend", "batch", "batch-int", "streams", "streams-int", "streams-many",
        "stream", "stream-int", "passes"])
def test_a_long_bad_argument_is_quoted_in_part(resnet50, kwargs, said):
    """plan()'s own arguments were quoted whole (repr()), as the settings were: a 100 kB line, or repr()'s own
    ValueError for an int of 5000 digits."""
    kwargs = {"backend": "cpu", **kwargs}
    with pytest.raises((TypeError, ValueError)) as raised:
        wsarena.plan(resnet50[:3], **kwargs)
    assert str(raised.value).startswith(said) and len(str(raised.value)) < 300, str(raised.value)[:300]


def test_the_batch_check_names_the_batch_as_its_caller_says_it():
    """As the streams' bound (below): the command's --batch took plan()'s message and cut its "batch " off."""
    bound = "must be at most 2**31 - 1 = 2147483647, the largest dimension a cuDNN descriptor holds, not 2147483648"
    for prefix, said in ((None, "batch "), ("", ""), ("argument --batch: ", "argument --batch: ")):
        kwargs = {} if prefix is None else {"prefix": prefix}
        assert positive_batch(2**31 - 1, **kwargs) == 2**31 - 1
        with pytest.raises(ValueError) as raised:
            positive_batch(2**31, **kwargs)
        assert str(raised.value) == f"{said}{bound}"
        with pytest.raises(ValueError) as raised:
            positive_batch(0, **kwargs)
        assert str(raised.value) == f"{said}must be a positive int, not 0"
        with pytest.raises(TypeError) as raised:
            positive_batch(2.0, **kwargs)
        assert str(raised.value) == f"{said}must be a positive int, not 2.0"


def test_the_streams_bound_names_the_count_as_its_caller_says_it():
    """The bound of a count of streams, the model's layers, is checked by plan() (streams=) and by the command, of its
    flag (argument --streams: ...), in the same words: the command took plan()'s message and cut its "streams=" off,
    so that a message worded otherwise would have named plan()'s argument to the command's user, or lost words."""
    words = "is more than the model's 3 layer(s): one run of the model cannot keep more streams busy than it has layers"
    check_streams_bound(3, 3)
    with pytest.raises(ValueError) as raised:
        check_streams_bound(4, 3)
    assert str(raised.value) == f"streams=4 {words}"
    with pytest.raises(ValueError) as raised:
        check_streams_bound(10**5000, 3, prefix="argument --streams: ")
    assert str(raised.value) == f"argument --streams: an integer of 16610 bits {words}"
    with pytest.raises(ValueError) as raised:
        wsarena.plan([ConvLayer("a", (1, 3, 8, 8), (4, 3, 3, 3))] * 3, streams=4, backend="cpu")
    assert str(raised.value) == f"streams=4 {words}"


class _Unequal:
    """An object whose == raises, as some array-likes' does."""

    def __eq__(self, other):
        raise RuntimeError("no ==")

    __hash__ = object.__hash__


class _UnequalName(_Unequal, str):
    __hash__ = str.__hash__


class _NoDtype:
    @property
    def dtype(self):  # what NumPy reads of an object it is asked to take as a dtype
        raise RuntimeError("no dtype")


@pytest.mark.parametrize(
    "dtype", [10**5000, np.array(["float32"]), _Unequal(), _NoDtype()], ids=["huge-int", "array", "unequal", "no-dtype"]
)
def test_what_is_no_dtype_is_refused_naming_the_argument(resnet50, dtype):
    """The refusal names dtype, with the value shortened, whatever the object does when NumPy reads it or when it is
    compared (a one-element array of a name compares equal to it, as an array)."""
    with pytest.raises(ValueError, match=r"^dtype must be one of .*, not ") as caught:
        wsarena.plan(resnet50[:3], backend="cpu", dtype=dtype)
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize(
    "dtype", ["float64", np.float64, np.dtype("float64"), "torch.float64", _UnequalName("float64")],
    ids=["name", "numpy-type", "numpy-dtype", "torch", "str-subclass"],
)
def test_a_numpy_or_pytorch_dtype_is_planned_by_its_name(resnet50, dtype):
    """np.float64 and torch.float64 are what their users pass: the plan, its report and its JSON hold the name,
    and the plan is the one the name gives. np.dtype was taken before, but kept as it was, so to_dict() did not
    serialise."""
    if type(dtype) is str and dtype == "torch.float64":
        dtype = pytest.importorskip("torch").float64
    p = wsarena.plan(resnet50[:3], backend="cpu", dtype=dtype)
    named = wsarena.plan(resnet50[:3], backend="cpu", dtype="float64")
    assert type(p.dtype) is str and p.dtype == "float64"
    assert json.loads(json.dumps(p.to_dict())) == json.loads(json.dumps(named.to_dict()))


def test_device_properties_that_start_with_a_byte_order_mark_are_read_without_it(resnet50, monkeypatch, tmp_path,
                                                                                 capsys):
    """As a JSON layer list is read (Windows editors save UTF-8 so): cuDNN was handed the mark with the JSON, and
    refused it as no JSON, the command as bad input or, where cuDNN cannot plan, as the environment (exit 3)."""
    from wsarena import planner
    from wsarena.backends import get_backend
    from wsarena.cli import main

    texts = []
    monkeypatch.setattr(planner, "device_properties_backend",
                        lambda text, source: texts.append(text) or get_backend("cpu"))  # what cuDNN would read
    props = '{"warpSize": 32}'
    path = tmp_path / "gpu.json"
    path.write_bytes(b"\xef\xbb\xbf" + props.encode())
    wsarena.plan(resnet50[:1], device_properties=path)
    wsarena.plan(resnet50[:1], device_properties="\ufeff" + props)  # the text of that file, read as UTF-8
    assert main(["report", "resnet50", "--device-properties", str(path), "--format", "json"]) == 0
    assert capsys.readouterr().err == "" and texts == [props] * 3


@pytest.mark.parametrize("where", ["missing.json", "."])
def test_device_properties_that_cannot_be_read_name_the_file(resnet50, tmp_path, where):
    """Bad input, as a model file that cannot be read is: a ValueError naming the file and why, which the command
    prints as its one line (exit 2), not an OSError's "[Errno 2] ..." text."""
    path = tmp_path / where
    with pytest.raises(ValueError, match=rf"^cannot read the device properties '{re.escape(str(path))}': \w"):
        wsarena.plan(resnet50[:3], device_properties=path)


@pytest.mark.parametrize("value", [5, True, {"warpSize": 32}, [], b"{}", b"gpu.json", bytearray(b"{}")],
                         ids=["int", "bool", "dict", "list", "bytes-json", "bytes-path", "bytearray"])
def test_device_properties_of_another_type_are_the_type_error_naming_them(resnet50, value):
    # os.fspath's "expected str, bytes or os.PathLike object, not dict" named nothing; bytes failed on a str prefix
    with pytest.raises(TypeError, match=r"^device_properties must be the JSON text or a file holding it"):
        wsarena.plan(resnet50[:3], device_properties=value)


@pytest.mark.parametrize("value", ["\0", "gpu\0.json"])
def test_device_properties_with_a_nul_name_the_argument(resnet50, value):
    with pytest.raises(ValueError, match=r"^cannot read the device properties .*: embedded null byte"):
        wsarena.plan(resnet50[:3], device_properties=value)


@pytest.mark.parametrize(("batch", "error"), [(True, TypeError), (False, TypeError), (0, ValueError),
                                               (2.0, TypeError)])
def test_batch_is_checked_before_anything_else(batch, error):
    """A batch of the wrong type is a TypeError, as streams' is; one below 1 a ValueError."""
    with pytest.raises(error, match="batch must be a positive int"):
        wsarena.plan(HONEST_LAYERS, batch=batch, backend="cpu")
    with pytest.raises(error, match="batch must be a positive int"):  # not the GPU that auto or cudnn lacks
        wsarena.plan(HONEST_LAYERS, batch=batch, backend="cudnn")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"progress": 5}, "progress must be callable"),
        ({"passes": None}, "passes must be a sequence of pass names"),
        ({"passes": "fwd"}, r"passes must be a sequence of pass names .*\('fwd',\)"),
        ({"passes": bytearray(b"fwd")}, r"passes must be a sequence of pass names .*, not bytearray\(b'fwd'\)$"),
        # taken, a set of names gave the passes in another order each run (str hashes are randomized): the report's
        # columns, the CSV's and the plot's
        ({"passes": {"fwd", "bwd_data"}}, r"not \{'bwd_data', 'fwd'\}: a set has no order, and the plan lists "),
        ({"passes": frozenset({"fwd"})}, r"not frozenset\(\{'fwd'\}\): a set has no order"),
        ({"passes": {"fwd": 1, "bwd_data": 2}.keys()}, r"passes must be a sequence of pass names .*, not dict_keys"),
        ({"passes": {"fwd": 1}}, r"passes must be a sequence of pass names .*, not \{'fwd': 1\}$"),
        # taken, a set collapsed repeated indices ({0, 1, 0, 1, 2} is {0, 1, 2}: "assigns 3 layers") and a mapping
        # of layer to stream gave its layers as the streams
        ({"streams": {0, 1, 2}}, (r"^streams must be an int or a sequence of stream indices, not \{0, 1, 2\}: a set "
                                  r"has no order, and it collapses repeated indices, where streams lists each layer")),
        ({"streams": frozenset(range(5))}, r"streams must be an int or a sequence .*, not frozenset\(.*\): a set has "),
        ({"streams": dict.fromkeys(range(5), 0)}, r"streams must be an int or a sequence .*, not \{0: 0, .*\}$"),
        ({"streams": dict.fromkeys(range(5), 0).keys()}, r"streams must be an int or a sequence .*, not dict_keys"),
        ({"streams": b"\0\1\0\1\0"}, r"streams must be an int or a sequence .*, not b'\\x00"),
    ],
)
@pytest.mark.parametrize("function", ["plan", "tune"])
def test_a_progress_or_passes_of_the_wrong_type_is_refused_before_any_search(monkeypatch, kwargs, match, function):
    def searched(*args, **kw):
        raise AssertionError("searched before the arguments were checked")

    monkeypatch.setattr(wsarena.planner, "select", searched)
    with pytest.raises(TypeError, match=match):
        getattr(wsarena, function)(HONEST_LAYERS, backend="cpu", **kwargs)


def test_numpy_integers_count_as_ints_for_batch_and_streams():
    # As the ops and ConvLayer take them: a batch or a stream count computed with NumPy is an int like any other.
    ints = wsarena.plan(HONEST_LAYERS, batch=2, backend="cpu", streams=2)
    numpy = wsarena.plan(HONEST_LAYERS, batch=np.int64(2), backend="cpu", streams=np.int32(2))
    assert numpy.to_dict() == ints.to_dict() and type(numpy.to_dict()["batch"]) is int
    split = [0, 1, 1, 0, 2]
    assert (wsarena.plan(HONEST_LAYERS, backend="cpu", streams=np.array(split)).to_dict()
            == wsarena.plan(HONEST_LAYERS, backend="cpu", streams=split).to_dict())
    with pytest.raises(ValueError, match="batch must be a positive int"):
        wsarena.plan(HONEST_LAYERS, batch=np.int64(0), backend="cpu")
    with pytest.raises(TypeError, match="streams must be an int"):
        wsarena.plan(HONEST_LAYERS, backend="cpu", streams=np.True_)


def _run_layers(p, arena, xp=np):
    """Run every pass of every planned layer through the public ops, as a training step would."""
    warnings.simplefilter("ignore", WorkspaceCapWarning)  # the cap is meant to exclude algorithms here
    rng = np.random.default_rng(0)
    for lp in p.layers:
        g = lp.geometry
        x, w, dy = (xp.asarray(rng.standard_normal(s, dtype=np.float32))
                    for s in (g.input_shape, g.weight_shape, g.output_shape))
        kw = {"stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups, "layout": g.layout}
        conv_forward(x, w, **kw)
        conv_backward_data(dy, w, x.shape, **kw)
        conv_backward_filter(x, dy, w.shape, **kw)


HONEST_LAYERS = [
    ConvLayer.from_dict(d) for d in (
        {"name": "stem", "input_shape": [1, 3, 32, 32], "weight_shape": [16, 3, 3, 3], "stride": [2, 2],
         "padding": [1, 1]},
        {"name": "dw", "input_shape": [1, 16, 16, 16], "weight_shape": [16, 1, 3, 3], "padding": [1, 1], "groups": 16},
        {"name": "pw", "input_shape": [1, 16, 16, 16], "weight_shape": [32, 16, 1, 1]},
        {"name": "wide", "input_shape": [1, 32, 16, 16], "weight_shape": [32, 32, 3, 3], "padding": [2, 2],
         "dilation": [2, 2]},
        {"name": "conv1d", "input_shape": [1, 8, 40], "weight_shape": [8, 8, 5], "padding": [2]},
    )
]


@pytest.mark.parametrize("cap", [None, "256KiB"])
def test_report_is_honest_about_a_real_run(fresh_arena, monkeypatch, cap):
    with config(cap_workspace=cap):
        p = wsarena.plan(HONEST_LAYERS, batch=3, backend="cpu")
        _run_layers(p, fresh_arena)
        # what the arena holds is the plan's largest workspace, rounded up as the arena rounds every buffer
        assert fresh_arena.stats()["capacity_bytes"] == p.held_bytes
        assert fresh_arena.stats()["high_water_bytes"] == p.arena_bytes

        reserved = Arena(HostProvider())
        monkeypatch.setattr(CpuBackend, "arena", lambda self: reserved)
        reserved.reserve_for(p)
        before = reserved.stats()
        _run_layers(p, reserved)
        after = reserved.stats()
    assert after["capacity_bytes"] == p.held_bytes
    assert (after["allocations"], after["growths"]) == (before["allocations"], before["growths"])


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "inception_v3", "googlenet", "mobilenet_v2", "unet"])
def test_every_zoo_model_plans_and_sharing_saves(name):
    p = wsarena.plan(wsarena.load_model(name), batch=32, backend="cpu")
    largest = max(c.workspace_bytes for lp in p.layers for c in lp.choices.values())
    assert p.arena_bytes == largest
    assert 0 < p.arena_bytes < p.unshared_bytes


def test_a_plan_by_default_is_of_one_image_float32_nchw_every_pass_one_stream(resnet50):
    """The defaults the signature and the docstring name, read off the plan and its layers' geometries."""
    p = wsarena.plan(resnet50[:2], backend="cpu")
    assert (p.batch, p.dtype, p.layout, p.streams) == (1, "float32", "NCHW", 1)
    assert p.passes == ("fwd", "bwd_data", "bwd_filter")
    assert [lp.geometry.input_shape for lp in p.layers] == [(1, 3, 224, 224), (1, 64, 56, 56)]
    assert [list(lp.choices) for lp in p.layers] == [["fwd", "bwd_data", "bwd_filter"]] * 2


def test_a_layer_plan_made_by_hand_is_an_ordinary_convolution_of_no_workspace_until_given_choices():
    """LayerPlan is public: made with no choices, it needs no workspace, and its dict says "transposed" only of a
    transposed layer."""
    from wsarena.backends import Candidate
    from wsarena.planner import LayerPlan

    geom = ConvLayer("c", (1, 3, 8, 8), (4, 3, 3, 3)).geometry()
    bare = LayerPlan("c", geom, 0, {})
    assert bare.largest_bytes == 0 and not bare.transposed and "transposed" not in bare.to_dict()
    chosen = LayerPlan("c", geom, 0, {"fwd": Candidate("a", 96), "bwd_data": Candidate("b", 160)}, transposed=True)
    assert chosen.largest_bytes == 160 and chosen.to_dict()["transposed"] is True
    assert chosen.to_dict()["bwd_data"] == {"algo": "b", "workspace_bytes": 160}


def test_a_plan_and_its_layers_cannot_be_changed(resnet50):
    """A plan's totals are read off its fields each time: they stay those of the plan made (reserve_for reads them)."""
    import dataclasses

    p = wsarena.plan(resnet50[:2], backend="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stream_bytes = (0,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.layers[0].stream = 1


def test_saved_is_never_negative_even_for_one_call():
    layer = ConvLayer.from_dict({"name": "one", "input_shape": [1, 3, 40, 40], "weight_shape": [4, 3, 3, 3]})
    p = wsarena.plan([layer], backend="cpu", passes=("fwd",))
    assert p.saved_bytes == 0 and p.arena_bytes == p.unshared_bytes > 0


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn_api", ["legacy", "graph"])
@pytest.mark.parametrize("cap", [None, "256KiB"])
def test_report_is_honest_about_a_real_run_on_cudnn(cap, cudnn_api):
    import cupy

    from wsarena.arena import CupyProvider, set_arena

    device = cupy.cuda.Device().id
    arenas = []
    try:
        for _ in range(2):
            arenas.append(Arena(CupyProvider(device)))
        with config(cap_workspace=cap, cudnn_api=cudnn_api):
            wsarena.algos.cache_clear()
            set_arena(device, arenas[0])
            p = wsarena.plan(HONEST_LAYERS, batch=3, backend="cudnn")
            if cudnn_api == "graph":
                assert any(c.algo.startswith("eng") for lp in p.layers for c in lp.choices.values())
            _run_layers(p, arenas[0], xp=cupy)
            cupy.cuda.get_current_stream().synchronize()
            assert arenas[0].stats()["capacity_bytes"] == p.held_bytes
            assert arenas[0].stats()["high_water_bytes"] == p.arena_bytes
            set_arena(device, arenas[1])
            arenas[1].reserve_for(p)
            before = arenas[1].stats()
            _run_layers(p, arenas[1], xp=cupy)
            after = arenas[1].stats()
        assert (after["allocations"], after["growths"]) == (before["allocations"], before["growths"])
    finally:
        set_arena(device, None)
        for arena in arenas:
            arena.close()


def test_a_plan_searches_again_a_call_memory_cut_short_once_what_it_lacked_can_be_had(monkeypatch):
    """The first of two layers of one geometry is searched while the provider refuses every allocation: the search
    times implicit_gemm (no workspace) alone, cut short. Memory is back by the second layer (its progress callback
    gives it back, and a trim forgets the refusal): that layer's call searches again, timing every candidate, where
    a call kept for good, or one the plan ranks once, would take the first layer's choice."""
    from wsarena.arena.testing import RecordingProvider

    provider = RecordingProvider(fail=lambda n: True)
    arena = Arena(provider)
    monkeypatch.setattr(CpuBackend, "arena", lambda self: arena)
    measured, real = [], CpuBackend.measure

    def measure(self, pass_, geom, a, b, out, workspace, candidates, stream):
        measured.append(sorted(c.algo for c in candidates))
        return real(self, pass_, geom, a, b, out, workspace, candidates, stream)

    def progress(done, total, name):
        provider.fail = None
        arena.trim()

    monkeypatch.setattr(CpuBackend, "measure", measure)
    layers = [ConvLayer(name, (1, 8, 16, 16), (8, 8, 3, 3), padding=(1, 1)) for name in ("first", "second")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", wsarena.MemoryFallbackWarning)
        p = wsarena.plan(layers, batch=1, backend="cpu", search="exhaustive", passes=("fwd",), cap_workspace=None,
                         progress=progress)
    everything = sorted(c.algo for c in CpuBackend().candidates("fwd", p.layers[0].geometry))
    assert len(everything) > 1
    assert measured == [["implicit_gemm"], everything]
    assert p.layers[0].choices["fwd"].algo == "implicit_gemm"
    arena.close()


def test_text_progress_wipes_a_bar_whose_write_a_ctrl_c_interrupted_as_it_returned():
    """A Ctrl-C that lands as the bar's write returns, the line out: the bar was not marked drawn, and clear() (the
    CLI's, before it says "wsarena: interrupted") wiped nothing, leaving that line after the bar on the same row."""

    class InterruptedTerminal(FakeTerminal):
        interrupt = True

        def write(self, text):
            written = super().write(text)
            if self.interrupt and "[" in text:
                self.interrupt = False
                raise KeyboardInterrupt
            return written

    terminal = InterruptedTerminal()
    show = text_progress(terminal)
    with pytest.raises(KeyboardInterrupt):
        show(1, 3, "conv1")
    show.clear()
    frame, wipe, end = terminal.getvalue().split("\r")[1:]
    assert frame.startswith("[") and end == ""
    assert wipe.strip() == "" and len(wipe) >= len(frame)


def test_text_progress_wipes_a_bar_whose_wipe_a_ctrl_c_interrupted():
    """A Ctrl-C that lands in clear(), before its blanks are out: the bar was marked wiped first, and the next clear()
    (the CLI's, before it says "wsarena: interrupted") wiped nothing, leaving that line after the bar on the same row.
    Once the wipe is out, a clear() more is nothing."""

    class InterruptedTerminal(FakeTerminal):
        interrupt = True

        def write(self, text):
            if self.interrupt and text.startswith("\r "):
                self.interrupt = False
                raise KeyboardInterrupt
            return super().write(text)

    terminal = InterruptedTerminal()
    show = text_progress(terminal)
    show(1, 3, "conv1")
    with pytest.raises(KeyboardInterrupt):
        show.clear()
    show.clear()
    show.clear()
    frame, wipe, end = terminal.getvalue().split("\r")[1:]
    assert frame.startswith("[") and end == ""
    assert wipe.strip() == "" and len(wipe) >= len(frame)
