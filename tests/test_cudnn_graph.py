"""A convolution through cuDNN's graph API, built on the CPU against device properties (no GPU, no handle).

``tests/data/h100-handwritten.json`` holds an H100's properties written by hand in the JSON schema cuDNN 9.28
reads (docs/deviceless.md); ``tests/data/h100.json``, where present, holds those ``bench/gpu_check.py`` captured
on the GPU. ``tests/data/h200-cudnn91900.json`` holds an H200's as cuDNN 9.19 captured them, which checks the
hand-written values and the refusal of another version's schema. The conftest loads a stand-in for
``libcuda.so.1`` where the driver is missing; everything here skips, with the reason, where cuDNN still cannot
finalize.
"""

from __future__ import annotations

import ctypes
import json
import weakref
from pathlib import Path

import pytest

from wsarena import cudnn
from wsarena._geometry import conv_geometry
from wsarena._pass import PASSES
from wsarena.backends import _graph_plans
from wsarena.backends._graph_plans import ALIGNED, conv_problem, numerics_refusal, ranked_names, shortlist, usable
from wsarena.cudnn import _prototypes, graph, load_library

from .cudnn_probe import driver

DATA = Path(__file__).parent / "data"
PROPERTIES = [p for p in (DATA / "h100-handwritten.json", DATA / "h100.json") if p.exists()]
# An H200's properties as cuDNN 9.19 serialised them on the GPU (bench/gpu_check.py, 2026-11-26)
CAPTURED_H200 = DATA / "h200-cudnn91900.json"

GEOMETRIES = {
    "2d": conv_geometry((2, 4, 9, 9), (6, 4, 3, 3), padding=1),
    "2d-grouped-strided-dilated": conv_geometry((2, 4, 11, 10), (6, 2, 3, 2), stride=(2, 1), padding=(2, 1),
                                                dilation=(1, 2), groups=2),
    "1d": conv_geometry((3, 5, 17), (4, 5, 4), stride=2, padding=1),
    "3d": conv_geometry((1, 2, 6, 7, 5), (4, 2, 3, 3, 1), stride=(1, 2, 1), padding=(1, 1, 0)),
    "2d-nhwc": conv_geometry((2, 9, 9, 8), (16, 3, 3, 8), padding=1, layout="NHWC"),
    "depthwise": conv_geometry((2, 8, 9, 9), (8, 1, 3, 3), padding=1, groups=8),
}


@pytest.fixture(scope="module", params=PROPERTIES, ids=lambda p: p.stem)
def props(request):
    reason = driver.finalize_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return graph.device_properties(request.param.read_text())


def test_the_handwritten_properties_name_every_member_cuDNN_asks_for():
    text = json.loads((DATA / "h100-handwritten.json").read_text())
    assert text["multiProcessorCount"] == 132 and text["deviceVer"] == 900


# What an H200 and an H100 SXM share: the chip (GH100, 132 SMs); their memory, L2, clocks and PCI ids differ
SAME_CHIP = (
    "maxGridSize", "maxBlockSize", "regsPerBlock", "multiProcessorCount", "warpSize", "maxSharedMemoryPerBlock",
    "maxSharedMemoryPerBlockOptin", "reservedSharedMemoryPerBlock", "maxRegistersPerSM", "maxCtasPerSM",
    "maxThreadsPerBlock", "maxThreadsPerSM", "supportCoopLaunch", "smClockRateKHz", "deviceVer",
)


def test_the_handwritten_values_are_those_a_hopper_gpu_reports():
    """The hand-written H100 values that describe the chip are those an H200 (the same GH100 chip) reported to
    cuDNN: taken from public specifications, they were checked against no device until then."""
    written = json.loads((DATA / "h100-handwritten.json").read_text())
    captured = json.loads(CAPTURED_H200.read_text())
    assert captured["deviceName"] == "NVIDIA H200"
    assert {k: written[k] for k in SAME_CHIP} == {k: captured[k] for k in SAME_CHIP}


def test_properties_another_cudnn_version_serialised_are_refused_with_the_reason():
    """cuDNN 9.28 reads members 9.19 did not write (smCountOrigin among them): an H200's 9.19 capture is refused
    with the typed error that says how to get ones it reads, rather than failing later or planning wrongly."""
    reason = driver.finalize_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    version = load_library().version
    if version < 92800:
        pytest.skip(f"cuDNN {version} may read 9.19's members; the refusal is 9.28's")
    with pytest.raises(graph.DevicePropertiesError, match="members this cuDNN version reads"):
        graph.device_properties(CAPTURED_H200.read_text())


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("case", list(GEOMETRIES))
def test_every_pass_dtype_and_geometry_gets_a_graph(props, case, dtype, pass_):
    geom = GEOMETRIES[case].with_dtype(dtype)
    with graph.operation_graph(conv_problem(pass_, geom)) as op_graph:
        assert op_graph.finalized
        assert op_graph.get_one(cudnn.BackendAttributeName.OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
                                cudnn.BackendAttributeType.INT64) > 0


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("case", ["2d", "2d-grouped-strided-dilated", "3d", "2d-nhwc"])
def test_plans_finalize_with_exact_workspace_sizes_and_names_rebuild_them(props, case, pass_):
    geom = GEOMETRIES[case]
    op_graph = graph.operation_graph(conv_problem(pass_, geom))
    ranked = ranked_names(graph, op_graph, geom.dtype, properties=props)
    names = [name for name, _ in ranked]
    assert names and len(names) == len(set(names))
    for name, nbytes in ranked[:6]:
        index, _ = graph.parse_name(name)
        assert name.startswith(f"eng{index}")
        cfg = graph.engine_config(op_graph, name, properties=props)
        plan = graph.execution_plan(cfg, properties=props)
        assert plan.name == name  # the rebuilt configuration names itself as it was named
        assert plan.workspace_bytes >= 0 and plan.workspace_bytes == cudnn.plan_workspace_size(plan.descriptor)
        assert plan.workspace_bytes == nbytes == graph.config_workspace(cfg)
        assert plan.numerical_notes == graph.engine_notes(cfg)[0]  # what algo= is checked against
        plan.close()
        assert plan.closed


@pytest.mark.parametrize("failure", ["refused", "interrupted"])
@pytest.mark.parametrize("make", ["config_workspace", "execution_plan"])
def test_a_plan_is_destroyed_on_every_way_out(props, monkeypatch, make, failure):
    """The plan cuDNN 9.0 and 9.1 finalize only to read a configuration's workspace (config_workspace), and the plan
    execution_plan makes, are destroyed before the error reaches the caller: cuDNN refusing the plan, or an
    interrupt once it is finalized. The error's traceback, which a caller may keep (a REPL's sys.last_exc, a
    log), must not keep the descriptor alive."""
    import dataclasses
    import weakref

    from wsarena.cudnn import _library

    cfg = graph.engine_configs(graph.operation_graph(conv_problem("fwd", GEOMETRIES["2d"])), properties=props)[0]
    monkeypatch.setattr(_library, "_loaded", dataclasses.replace(_library.load_library(), version=90100))
    plans = []
    real_finalize = cudnn.BackendDescriptor.finalize

    def finalize(self):
        if self.kind != cudnn.BackendDescriptorType.EXECUTION_PLAN_DESCRIPTOR:
            return real_finalize(self)
        plans.append(weakref.ref(self))
        if failure == "refused":  # what ranked_names lets through: the handle or the library, not the configuration
            raise cudnn.CudnnError(int(cudnn.Status.NOT_INITIALIZED), "refused", "cudnnBackendFinalize")
        real_finalize(self)
        raise KeyboardInterrupt  # a signal handled as the finalize returns

    monkeypatch.setattr(cudnn.BackendDescriptor, "finalize", finalize)
    with pytest.raises((cudnn.CudnnNotInitializedError, KeyboardInterrupt)) as caught:
        getattr(graph, make)(cfg, properties=props)
    assert len(plans) == 1
    assert plans[0]() is None or plans[0]().closed, f"{make}: the plan outlives {caught.typename}"


@pytest.mark.parametrize("version", [90100, None])
def test_ranking_drops_a_configuration_cuDNN_refuses_and_no_other_failure(props, monkeypatch, version):
    """On cuDNN 9.0 and 9.1 a configuration whose plan cuDNN refuses to finalize is left out of the ranking, and
    the others keep their sizes. A failure to read ENGINECFG_WORKSPACE_SIZE (9.2 and later), or one of the handle
    or the library, is no verdict on one configuration: it reaches the caller rather than thinning the list."""
    import dataclasses

    from wsarena.cudnn import _library

    op_graph = graph.operation_graph(conv_problem("fwd", GEOMETRIES["2d"]))
    full = ranked_names(graph, op_graph, "float32", properties=props)
    refused = full[1][0]
    if version is not None:
        monkeypatch.setattr(_library, "_loaded", dataclasses.replace(_library.load_library(), version=version))
    real_finalize, real_get_one = cudnn.BackendDescriptor.finalize, cudnn.BackendDescriptor.get_one
    status = cudnn.Status.NOT_SUPPORTED

    def finalize(self):
        if self.kind == cudnn.BackendDescriptorType.EXECUTION_PLAN_DESCRIPTOR and made_from.get(id(self)) == refused:
            raise cudnn.CudnnError(int(status), "refused", "cudnnBackendFinalize")
        return real_finalize(self)

    def get_one(self, attr, kind):
        if attr == cudnn.BackendAttributeName.ENGINECFG_WORKSPACE_SIZE and graph.config_name(self) == refused:
            raise cudnn.CudnnError(int(status), "refused", "cudnnBackendGetAttribute")
        return real_get_one(self, attr, kind)

    real_set, made_from = cudnn.BackendDescriptor.set, {}

    def set_(self, attr, kind, value):  # which configuration a plan is finalized from
        if attr == cudnn.BackendAttributeName.EXECUTION_PLAN_ENGINE_CONFIG:
            made_from[id(self)] = graph.config_name(value)
        return real_set(self, attr, kind, value)

    monkeypatch.setattr(cudnn.BackendDescriptor, "finalize", finalize)
    monkeypatch.setattr(cudnn.BackendDescriptor, "get_one", get_one)
    monkeypatch.setattr(cudnn.BackendDescriptor, "set", set_)
    if version is None:
        with pytest.raises(cudnn.CudnnError, match="refused"):
            ranked_names(graph, op_graph, "float32", properties=props)
        return
    assert ranked_names(graph, op_graph, "float32", properties=props) == [item for item in full if item[0] != refused]
    status = cudnn.Status.NOT_INITIALIZED
    with pytest.raises(cudnn.CudnnNotInitializedError):
        ranked_names(graph, op_graph, "float32", properties=props)


def test_float32_candidates_exclude_tensor_cores_and_run_time_compilation(props):
    geom = GEOMETRIES["2d"]
    op_graph = graph.operation_graph(conv_problem("fwd", geom))
    configs = graph.engine_configs(op_graph, properties=props)
    notes = {graph.config_name(c): graph.engine_notes(c) for c in configs}
    tensor_core = {n for n, (numerical, _) in notes.items() if cudnn.BackendNumericalNote.TENSOR_CORE in numerical}
    assert tensor_core, "the heuristics list tensor-core (TF32) engines for float32 here"
    kept = [name for name, _ in ranked_names(graph, op_graph, "float32", properties=props)]
    assert kept and not set(kept) & tensor_core
    half = ranked_names(graph, graph.operation_graph(conv_problem("fwd", geom.with_dtype("float16"))), "float16",
                        properties=props)
    assert half  # tensor cores are allowed for half data


def test_shortlist_keeps_the_first_and_the_smallest():
    ranked = [(f"eng{i}", nbytes) for i, nbytes in enumerate([50, 40, 60, 10, 0, 0, 30])]
    assert shortlist(ranked, 3) == ["eng0", "eng1", "eng2", "eng4"]
    assert shortlist(ranked, 5) == ["eng0", "eng1", "eng2", "eng3", "eng4"]
    assert shortlist(ranked[:2], 3) == ["eng0", "eng1"] and shortlist([], 3) == []


def test_usable_notes():
    assert usable("float32", frozenset(), frozenset())
    assert not usable("float32", frozenset({0}), frozenset())  # TENSOR_CORE: TF32
    assert not usable("float64", frozenset({1}), frozenset())  # DOWN_CONVERT_INPUTS
    assert usable("float16", frozenset({0, 1}), frozenset())
    assert not usable("bfloat16", frozenset({2}), frozenset())  # REDUCED_PRECISION_REDUCTION
    assert not usable("float16", frozenset(), frozenset({0}))  # RUNTIME_COMPILATION
    note = cudnn.BackendNumericalNote
    assert (_graph_plans._TENSOR_CORE, _graph_plans._DOWN_CONVERT, _graph_plans._REDUCED_REDUCTION) == (
        note.TENSOR_CORE, note.DOWN_CONVERT_INPUTS, note.REDUCED_PRECISION_REDUCTION)  # its ints are the header's
    assert numerics_refusal("float32", frozenset({note.FFT, note.WINOGRAD})) is None
    assert numerics_refusal("float16", frozenset({note.TENSOR_CORE})) is None
    why = numerics_refusal("float32", frozenset({note.TENSOR_CORE, note.DOWN_CONVERT_INPUTS}))
    assert why is not None and "TENSOR_CORE" in why and "DOWN_CONVERT_INPUTS" in why and "no TF32" in why
    assert "accumulator" in (numerics_refusal("bfloat16", frozenset({note.REDUCED_PRECISION_REDUCTION})) or "")


def test_conv_problem_dims_strides_and_one_d_promotion():
    p = conv_problem("bwd_data", GEOMETRIES["1d"])
    assert p.dims == ((3, 5, 1, 17), (4, 5, 1, 4), (3, 4, 1, 8))
    assert p.strides[0] == (85, 17, 17, 1)
    assert (p.padding, p.stride, p.dilation) == ((0, 1), (1, 2), (1, 1))
    assert p.data_type is cudnn.DataType.FLOAT and p.alignments == ALIGNED
    q = conv_problem("fwd", GEOMETRIES["2d-nhwc"].with_dtype("bfloat16"), (16, 8, 2))
    assert q.dims[0] == (2, 8, 9, 9) and q.strides[0] == (648, 1, 72, 8)  # channels last
    assert q.strides[1] == (72, 1, 24, 8)
    assert (q.data_type, q.compute_type) == (cudnn.DataType.BFLOAT16, cudnn.DataType.FLOAT)
    assert conv_problem("fwd", GEOMETRIES["2d"].with_dtype("float64")).compute_type is cudnn.DataType.DOUBLE


def test_names_parse_and_bad_names_are_value_errors():
    assert graph.parse_name("eng28") == (28, [])
    assert graph.parse_name("eng0:tile_size=3,use_tex=0") == (0, [(2, 3), (3, 0)])
    assert graph.parse_name("eng7:k99=1") == (7, [(99, 1)])  # a knob these headers do not name
    assert graph._name(7, [(99, 1), (2, -1)]) == "eng7:tile_size=-1,k99=1"
    for bad in ("implicit_gemm", "eng", "eng1:", "eng1:tile_size", "eng1:nosuchknob=2", 28):
        with pytest.raises(ValueError, match="engine configuration name"):
            graph.parse_name(bad)


def test_an_unknown_engine_is_a_typed_error(props):
    op_graph = graph.operation_graph(conv_problem("fwd", GEOMETRIES["2d"]))
    with pytest.raises(cudnn.CudnnError):
        graph.engine_config(op_graph, "eng100000", properties=props)


def test_a_variant_pack_takes_pointers_once_and_refuses_a_change(props):
    pack = graph._variant_pack((0x1000, 0x2000, 0x3000, 0x4000))
    assert pack.finalized
    with pytest.raises(cudnn.CudnnBadParamError):  # why the plan keeps finalized packs by their pointers
        pack.set(cudnn.BackendAttributeName.VARIANT_PACK_WORKSPACE, cudnn.BackendAttributeType.VOID_PTR, 0x5000)


def test_device_properties_refuse_json_without_a_member_and_need_a_device_otherwise(props):
    text = json.loads((DATA / "h100-handwritten.json").read_text())
    del text["l2CacheSize"]
    with pytest.raises(cudnn.CudnnBadParamError):
        graph.device_properties(json.dumps(text))
    # cuDNN's own reason (!json_object.IsObject()) from 9.14 on; before, the message names the descriptor
    reason = "IsObject" if load_library().version >= 91400 else r"\[DEVICEPROP_DESCRIPTOR\]"
    with pytest.raises(cudnn.CudnnBadParamError, match=reason):
        graph.device_properties("not json")
    with pytest.raises(cudnn.CudnnNotInitializedError):  # from the device: there is none
        graph.device_properties()
    again = graph.device_properties(graph.device_properties_json(props))
    assert json.loads(graph.device_properties_json(again)) == json.loads(graph.device_properties_json(props))


def test_device_properties_read_json_text_that_starts_with_a_byte_order_mark_as_without_it(props):
    """As plan() reads it (a file saved by a Windows editor): device_properties() handed cuDNN the mark, which it
    refused as no JSON, and its own checks could not read the members (a value no GPU has went unnamed)."""
    text = (DATA / "h100-handwritten.json").read_text()
    with_mark = graph.device_properties("\ufeff" + text)
    assert json.loads(graph.device_properties_json(with_mark)) == json.loads(graph.device_properties_json(props))
    bad = json.loads(text) | {"multiProcessorCount": 0}
    with pytest.raises(graph.DevicePropertiesError, match="multiProcessorCount is 0: a GPU has at least 1") as caught:
        graph.device_properties("\ufeff" + json.dumps(bad), source="gpu.json")
    assert (caught.value.source, caught.value.member) == ("gpu.json", "multiProcessorCount")


@pytest.mark.parametrize("reuse", [True, False])
def test_plan_execute_gives_cudnn_a_finalized_pack_in_both_modes(props, monkeypatch, reuse):
    """cudnnBackendExecute replaced (it needs a GPU); everything before it is cuDNN's own."""
    op_graph = graph.operation_graph(conv_problem("fwd", GEOMETRIES["2d"]))
    (name, _), *_ = ranked_names(graph, op_graph, "float32", properties=props)
    plan = graph.execution_plan(graph.engine_config(op_graph, name, properties=props), properties=props)
    plan.reuse_variant_packs = reuse
    seen, status = [], [0]

    def execute(handle, plan_arg, pack):
        seen.append((handle, pack.value if hasattr(pack, "value") else pack.handle))
        return status[0]

    monkeypatch.setitem(_prototypes._bound, "cudnnBackendExecute", execute)
    for i in range(graph._VARIANT_PACKS_KEPT + 3):
        plan.execute("handle", 0x1000 * (i + 1), 0x2000, 0x3000, 0x4000)
    plan.execute("handle", 0x1000, 0x2000, 0x3000, 0x4000)
    assert len(seen) == graph._VARIANT_PACKS_KEPT + 4 and all(p for _, p in seen)
    assert len(plan._packs) == (graph._VARIANT_PACKS_KEPT if reuse else 0)
    status[0] = int(cudnn.Status.NOT_SUPPORTED)
    with pytest.raises(cudnn.CudnnNotSupportedError, match="cudnnBackendExecute.*plan eng"):
        plan.execute("handle", 0x9000, 0x2000, 0x3000, 0x4000)
    kept = list(plan._packs.values())
    plan.close()
    assert plan.closed and all(p.closed for p in kept) and not plan._packs


@pytest.mark.parametrize("reuse", [True, False])
def test_plan_execute_passes_the_plans_pointer_and_refuses_a_closed_plan(props, monkeypatch, reuse):
    """cudnnBackendExecute gets the plan's and the kept pack's raw pointers; a closed plan raises ValueError and
    reaches no cuDNN call (its pointer, destroyed, must never be passed)."""
    op_graph = graph.operation_graph(conv_problem("fwd", GEOMETRIES["2d"]))
    (name, _), *_ = ranked_names(graph, op_graph, "float32", properties=props)
    plan = graph.execution_plan(graph.engine_config(op_graph, name, properties=props), properties=props)
    plan.reuse_variant_packs = reuse
    seen = []

    def execute(handle, plan_arg, pack):
        seen.append((plan_arg, pack.value))
        return 0

    monkeypatch.setitem(_prototypes._bound, "cudnnBackendExecute", execute)
    plan.execute("handle", 0x1000, 0x2000, 0x3000, 0x4000)
    assert seen[0][0] == plan.descriptor.handle and seen[0][1]
    if reuse:
        assert seen[0][1] == plan._packs[(0x1000, 0x2000, 0x3000, 0x4000)].handle
    assert not plan.closed
    plan.descriptor.close()  # closed under the plan, as a cache's discard or the handles' teardown would
    assert plan.closed  # what the plan cache asks before it gives a cached plan again
    with pytest.raises(ValueError, match="closed"):
        plan.execute("handle", 0x1000, 0x2000, 0x3000, 0x4000)
    assert len(seen) == 1
    plan.close()


class _Handle(cudnn.Handle):
    """A handle as ctypes would be given one (an ``Owned``), with no cuDNN handle behind it: the pointer is never
    dereferenced, since cudnnBackendExecute is a C no-op here."""

    def __init__(self) -> None:
        self.device, self.thread_id = 0, 0
        self._handle = 0x1
        self._stream = None
        self._finalizer = weakref.finalize(self, int)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_ctrl_c_anywhere_in_plan_execute_is_a_keyboard_interrupt(props, monkeypatch, reuse):
    """ctypes reads an argument's ``_as_parameter_``, Python code, and turns what it raises into ArgumentError: a
    Ctrl-C landing there came out as ``ArgumentError: argument 1: KeyboardInterrupt:``. Plan.execute passed the
    handle object so, where every other cuDNN call goes through ``call()``, which reads the pointer itself.
    cudnnBackendExecute is a C no-op declared as it is (ctypes converts the arguments as it would for cuDNN's);
    every place of the call where CPython runs a signal handler is tried, and only KeyboardInterrupt may come out."""
    from .interrupts import interrupt_at_check

    op_graph = graph.operation_graph(conv_problem("fwd", GEOMETRIES["2d"]))
    (name, _), *_ = ranked_names(graph, op_graph, "float32", properties=props)
    plan = graph.execution_plan(graph.engine_config(op_graph, name, properties=props), properties=props)
    plan.reuse_variant_packs = reuse
    real = cudnn.function("cudnnBackendExecute")
    no_op = ctypes.CDLL(None).pthread_equal  # returns 0 (SUCCESS) for two different values, touches nothing
    no_op.restype, no_op.argtypes = real.restype, real.argtypes
    monkeypatch.setitem(_prototypes._bound, "cudnnBackendExecute", no_op)
    handle = _Handle()
    plan.execute(handle, 0x1000, 0x2000, 0x3000, 0x4000)  # a kept pack, if any, is made before the runs below
    n = 1
    while interrupt_at_check(n, plan.execute, handle, 0x1000, 0x2000, 0x3000, 0x4000):
        n += 1
    assert n > 3  # the call's own checks were reached
    plan.close()
