"""A convolution pass through cuDNN's backend (graph) API: operation graph, engine configurations, execution plans.

For one pass and geometry (:class:`ConvProblem`): three tensors with unique ids (:data:`UIDS`: x 1, w 2, y 3 by
their role in the forward convolution, so dx has x's id and dw has w's), a convolution descriptor, the operation,
and the operation graph holding it (:func:`operation_graph`). cuDNN's heuristics rank engine configurations for the
graph (:func:`engine_configs`); :func:`execution_plan` finalizes one into a :class:`Plan` with its exact workspace
size, and :meth:`Plan.execute` runs it with a variant pack of device pointers.

An engine configuration has a stable readable name (:func:`config_name`): the engine's global index and its knob
choices, ``"eng28"`` or ``"eng0:tile_size=3,use_tex=0"``; :func:`engine_config` builds the configuration back from
a name.

Every function takes either a cuDNN handle (a GPU: the plans run there) or device properties (a finalized
``DEVICEPROP`` descriptor, :func:`device_properties`, from JSON captured on a GPU): with the latter the graph,
heuristics and plans are built without a device (docs/deviceless.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from collections import OrderedDict
from typing import Any

from .._pass import Pass
from .._sizes import short_repr
from ._deviceprops import DevicePropertiesError, device_properties, device_properties_json
from ._enums import BackendAttributeName, BackendAttributeType, BackendDescriptorType, BackendKnobType, DataType
from ._enums import BackendHeurMode as Heur
from ._errors import CudnnError, check
from ._prototypes import call, function
from ._status_errors import CudnnNotInitializedError
from .backend import BackendDescriptor, has_attribute, plan_workspace_size

__all__ = [
    "UIDS", "ConvProblem", "DevicePropertiesError", "Plan", "config_name", "config_workspace", "device_properties",
    "device_properties_json", "engine_config", "engine_configs", "engine_notes", "execution_plan", "operation_graph",
    "parse_name",
]

A, T, D = BackendAttributeName, BackendAttributeType, BackendDescriptorType
UIDS = {"x": 1, "w": 2, "y": 3}

# pass -> (operation kind, attribute names of alpha, beta, conv, x, w, y)
_OPERATIONS = {
    Pass.FWD: (D.OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, A.OPERATION_CONVOLUTION_FORWARD_ALPHA,
               A.OPERATION_CONVOLUTION_FORWARD_BETA, A.OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
               A.OPERATION_CONVOLUTION_FORWARD_X, A.OPERATION_CONVOLUTION_FORWARD_W, A.OPERATION_CONVOLUTION_FORWARD_Y),
    Pass.BWD_DATA: (D.OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, A.OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                    A.OPERATION_CONVOLUTION_BWD_DATA_BETA, A.OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                    A.OPERATION_CONVOLUTION_BWD_DATA_DX, A.OPERATION_CONVOLUTION_BWD_DATA_W,
                    A.OPERATION_CONVOLUTION_BWD_DATA_DY),
    Pass.BWD_FILTER: (D.OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, A.OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                      A.OPERATION_CONVOLUTION_BWD_FILTER_BETA, A.OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                      A.OPERATION_CONVOLUTION_BWD_FILTER_X, A.OPERATION_CONVOLUTION_BWD_FILTER_DW,
                      A.OPERATION_CONVOLUTION_BWD_FILTER_DY),
}


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """One convolution pass as the graph API sees it (no array library involved).

    Dims and strides are in cuDNN's logical order ``(N, C, *spatial)`` / ``(K, C/groups, *kernel)``, strides in
    elements (channels-last data has C's stride 1). ``alignments`` are the byte alignments of the x, w and y
    pointers the plans will be given.
    """

    pass_: Pass
    data_type: DataType
    compute_type: DataType
    dims: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # x, w, y
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    alignments: tuple[int, int, int] = (16, 16, 16)

    def describe(self) -> str:
        return (f"{self.pass_}: x {self.dims[0]}, w {self.dims[1]}, y {self.dims[2]}, padding {self.padding}, "
                f"stride {self.stride}, dilation {self.dilation}, {self.data_type.name}")


def _tensor(uid: int, problem: ConvProblem, index: int) -> BackendDescriptor:
    t = BackendDescriptor(D.TENSOR_DESCRIPTOR)
    t.set(A.TENSOR_DATA_TYPE, T.DATA_TYPE, problem.data_type).set(A.TENSOR_UNIQUE_ID, T.INT64, uid)
    t.set(A.TENSOR_DIMENSIONS, T.INT64, problem.dims[index]).set(A.TENSOR_STRIDES, T.INT64, problem.strides[index])
    return t.set(A.TENSOR_BYTE_ALIGNMENT, T.INT64, problem.alignments[index]).finalize()


def operation_graph(problem: ConvProblem, *, handle: Any = None, properties: Any = None) -> BackendDescriptor:
    """The finalized operation graph of ``problem``'s one convolution operation.

    ``handle`` (a :class:`~wsarena.cudnn.Handle`) ties it to that handle's device; without one, cuDNN needs
    ``properties`` later (heuristics and plans) to know the device.
    """
    nd = len(problem.padding)
    conv = BackendDescriptor(D.CONVOLUTION_DESCRIPTOR)
    conv.set(A.CONVOLUTION_COMP_TYPE, T.DATA_TYPE, problem.compute_type)
    conv.set(A.CONVOLUTION_CONV_MODE, T.CONVOLUTION_MODE, 1)  # CUDNN_CROSS_CORRELATION
    conv.set(A.CONVOLUTION_SPATIAL_DIMS, T.INT64, nd).set(A.CONVOLUTION_DILATIONS, T.INT64, problem.dilation)
    conv.set(A.CONVOLUTION_FILTER_STRIDES, T.INT64, problem.stride)
    conv.set(A.CONVOLUTION_PRE_PADDINGS, T.INT64, problem.padding)
    conv.set(A.CONVOLUTION_POST_PADDINGS, T.INT64, problem.padding).finalize()
    kind, alpha, beta, conv_attr, x_attr, w_attr, y_attr = _OPERATIONS[Pass(problem.pass_)]
    scale = T.DOUBLE if problem.data_type == DataType.DOUBLE else T.FLOAT  # cuDNN reads them as the data's width
    op = BackendDescriptor(kind).set(alpha, scale, 1.0).set(beta, scale, 0.0).set(conv_attr, T.BACKEND_DESCRIPTOR, conv)
    for attr, (role, index) in zip((x_attr, w_attr, y_attr), (("x", 0), ("w", 1), ("y", 2))):
        op.set(attr, T.BACKEND_DESCRIPTOR, _tensor(UIDS[role], problem, index))
    op.finalize()
    graph = BackendDescriptor(D.OPERATIONGRAPH_DESCRIPTOR).set(A.OPERATIONGRAPH_OPS, T.BACKEND_DESCRIPTOR, op)
    if handle is not None:
        graph.set(A.OPERATIONGRAPH_HANDLE, T.HANDLE, handle)
    return graph.finalize()


def engine_configs(graph: BackendDescriptor, mode: Heur | int = Heur.MODE_INSTANT, *,
                   properties: Any = None) -> list[BackendDescriptor]:
    """cuDNN's engine configurations for ``graph``, ranked by the heuristics ``mode`` (expected fastest first)."""
    heur = BackendDescriptor(D.ENGINEHEUR_DESCRIPTOR).set(A.ENGINEHEUR_OPERATION_GRAPH, T.BACKEND_DESCRIPTOR, graph)
    heur.set(A.ENGINEHEUR_MODE, T.HEUR_MODE, Heur(mode))
    if properties is not None:
        heur.set(A.ENGINEHEUR_DEVICEPROP, T.BACKEND_DESCRIPTOR, properties)
    heur.finalize()
    return heur.get_descriptors(A.ENGINEHEUR_RESULTS, D.ENGINECFG_DESCRIPTOR)


def _engine(cfg: BackendDescriptor) -> BackendDescriptor:
    return cfg.get_descriptors(A.ENGINECFG_ENGINE, D.ENGINE_DESCRIPTOR, 1)[0]


def config_name(cfg: BackendDescriptor) -> str:
    """``"eng<global index>"``, then ``":knob=value,..."`` for its knob choices in knob-type order."""
    index = _engine(cfg).get_one(A.ENGINE_GLOBAL_INDEX, T.INT64)
    knobs = []
    # Asked for how many it holds, cuDNN answers 0 for this attribute: ask for as many as there are knob types.
    for choice in cfg.get_descriptors(A.ENGINECFG_KNOB_CHOICES, D.KNOB_CHOICE_DESCRIPTOR, BackendKnobType.COUNTS):
        kind = choice.get_one(A.KNOB_CHOICE_KNOB_TYPE, T.KNOB_TYPE)
        knobs.append((int(kind), choice.get_one(A.KNOB_CHOICE_KNOB_VALUE, T.INT64)))
    return _name(index, knobs)


def _name(index: int, knobs: list[tuple[int, int]]) -> str:
    parts = [f"{_knob_label(kind)}={value}" for kind, value in sorted(knobs)]
    return f"eng{index}" + (":" + ",".join(parts) if parts else "")


def _knob_label(kind: int) -> str:
    try:
        return BackendKnobType(kind).name.lower()
    except ValueError:
        return f"k{kind}"  # a knob this wsarena's headers do not name


_NAME = re.compile(r"eng(\d+)(?::((?:[a-z0-9_]+=-?\d+)(?:,[a-z0-9_]+=-?\d+)*))?")


def parse_name(name: str) -> tuple[int, list[tuple[int, int]]]:
    """``(engine index, [(knob type, value), ...])`` of a name :func:`config_name` made.

    Raises
    ------
    ValueError
        ``name`` is not such a name.
    """
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"{short_repr(name)} is not an engine configuration name such as 'eng28' or "
                         "'eng0:tile_size=3'")
    knobs = []
    for item in filter(None, (match.group(2) or "").split(",")):
        label, value = item.split("=")
        if re.fullmatch(r"k\d+", label):
            kind = int(label[1:])
        elif label.upper() in BackendKnobType.__members__:
            kind = BackendKnobType[label.upper()].value
        else:
            raise ValueError(f"{short_repr(name)} is not an engine configuration name: no knob {short_repr(label)}")
        knobs.append((kind, int(value)))
    return int(match.group(1)), knobs


def engine_config(graph: BackendDescriptor, name: str, *, properties: Any = None) -> BackendDescriptor:
    """The finalized engine configuration ``name`` (as :func:`config_name` gives it) for ``graph``."""
    index, knobs = parse_name(name)
    engine = BackendDescriptor(D.ENGINE_DESCRIPTOR).set(A.ENGINE_OPERATION_GRAPH, T.BACKEND_DESCRIPTOR, graph)
    engine.set(A.ENGINE_GLOBAL_INDEX, T.INT64, index)
    if properties is not None:
        engine.set(A.ENGINE_DEVICEPROP, T.BACKEND_DESCRIPTOR, properties)
    engine.finalize()
    choices = []
    for kind, value in knobs:
        choice = BackendDescriptor(D.KNOB_CHOICE_DESCRIPTOR).set(A.KNOB_CHOICE_KNOB_TYPE, T.KNOB_TYPE, kind)
        choices.append(choice.set(A.KNOB_CHOICE_KNOB_VALUE, T.INT64, value).finalize())
    cfg = BackendDescriptor(D.ENGINECFG_DESCRIPTOR).set(A.ENGINECFG_ENGINE, T.BACKEND_DESCRIPTOR, engine)
    if choices:
        cfg.set(A.ENGINECFG_KNOB_CHOICES, T.BACKEND_DESCRIPTOR, choices)
    return cfg.finalize()


def config_workspace(cfg: BackendDescriptor, *, handle: Any = None, properties: Any = None) -> int | None:
    """Workspace bytes an engine configuration needs: its ``ENGINECFG_WORKSPACE_SIZE``, without finalizing a plan.

    cuDNN 9.0 and 9.1 lack that attribute: there, a plan is finalized from ``cfg`` (for ``handle``'s device, or
    that of ``properties``), its ``EXECUTION_PLAN_WORKSPACE_SIZE`` read, and the plan destroyed. ``None``: cuDNN
    refused to finalize it, so the configuration cannot run.

    Raises
    ------
    CudnnNotInitializedError
        On cuDNN 9.0 and 9.1, the handle or the library, not the configuration, failed.
    MemoryError
        On cuDNN 9.0 and 9.1, cuDNN could not allocate what finalizing the plan takes (host or device memory): no
        verdict on the configuration either.
    CudnnError
        Reading the attribute failed (9.2 and later): no configuration's size can be trusted then.
    """
    if has_attribute(A.ENGINECFG_WORKSPACE_SIZE):
        return int(cfg.get_one(A.ENGINECFG_WORKSPACE_SIZE, T.INT64))
    with BackendDescriptor(D.EXECUTION_PLAN_DESCRIPTOR) as plan:  # destroyed however this ends
        try:
            _finalize_plan(plan, cfg, handle, properties)
        except CudnnError as exc:
            if isinstance(exc, (CudnnNotInitializedError, MemoryError)):
                raise
            return None
        return plan_workspace_size(plan)


def engine_notes(cfg: BackendDescriptor) -> tuple[frozenset[int], frozenset[int]]:
    """The configuration's engine's numerical and behaviour notes (``BackendNumericalNote``/``BehaviorNote``)."""
    engine = _engine(cfg)
    behaviour = engine.get(A.ENGINE_BEHAVIOR_NOTE, T.BEHAVIOR_NOTE)
    return _numerical_notes(engine), frozenset(map(int, behaviour))


def _numerical_notes(engine: BackendDescriptor) -> frozenset[int]:
    return frozenset(map(int, engine.get(A.ENGINE_NUMERICAL_NOTE, T.NUMERICAL_NOTE)))


def execution_plan(cfg: BackendDescriptor, name: str | None = None, *, handle: Any = None,
                   properties: Any = None) -> Plan:
    """Finalize ``cfg`` into a :class:`Plan` (for ``handle``'s device, or the device of ``properties``)."""
    plan = BackendDescriptor(D.EXECUTION_PLAN_DESCRIPTOR)
    try:
        _finalize_plan(plan, cfg, handle, properties)
        return Plan(plan, name if name is not None else config_name(cfg), plan_workspace_size(plan),
                    _numerical_notes(_engine(cfg)))
    except BaseException:
        plan.close()  # now: the error's traceback would keep it until the error is dropped
        raise


def _finalize_plan(plan: BackendDescriptor, cfg: BackendDescriptor, handle: Any, properties: Any) -> BackendDescriptor:
    """Give the new execution plan ``plan`` its configuration and device, and finalize it (the caller destroys it
    if this fails)."""
    plan.set(A.EXECUTION_PLAN_ENGINE_CONFIG, T.BACKEND_DESCRIPTOR, cfg)
    if handle is not None:
        plan.set(A.EXECUTION_PLAN_HANDLE, T.HANDLE, handle)
    if properties is not None:
        plan.set(A.EXECUTION_PLAN_DEVICEPROP, T.BACKEND_DESCRIPTOR, properties)
    return plan.finalize()


_VARIANT_PACKS_KEPT = 8  # finalized variant packs a plan keeps, by pointers, in the "reused" mode
# How new plans give cuDNN their pointers (Plan.reuse_variant_packs). Reusing is the default until
# bench/bench_gpu_host.py measures both on a GPU: a cached call with unchanged pointers then makes one ctypes call
# (cudnnBackendExecute) instead of six. Measured without a GPU (the backend's run() with cudnnBackendExecute
# replaced by a no-op, one CPU core of the 2-core development machine): 4.8 us kept, 12.7 us built per call.
REUSE_VARIANT_PACKS = True


class Plan:
    """A finalized execution plan: its configuration's name, its workspace size, its engine's numerical notes
    (``BackendNumericalNote`` values), and how to run it.

    ``reuse_variant_packs`` chooses how :meth:`execute` gives cuDNN the pointers. cuDNN refuses to change a
    finalized variant pack (``BAD_PARAM``), so either every call builds, finalizes and destroys one (``False``,
    as PyTorch does: five more ctypes calls per call), or the plan keeps the last few finalized packs by their
    pointers (``True``): a call whose operands and workspace are where they were last time, as in a training loop
    with ``out=``, then makes one ctypes call.
    """

    __slots__ = (
        "_finalizer", "_packs", "descriptor", "name", "numerical_notes", "reuse_variant_packs", "workspace_bytes",
    )

    def __init__(
        self, descriptor: BackendDescriptor, name: str, workspace_bytes: int,
        numerical_notes: frozenset[int] = frozenset(),
    ) -> None:
        self.descriptor = descriptor
        self._finalizer = descriptor._finalizer  # the descriptor's, dead once it is destroyed: see closed
        self.name = name
        self.workspace_bytes = int(workspace_bytes)
        self.numerical_notes = numerical_notes
        self.reuse_variant_packs = REUSE_VARIANT_PACKS
        self._packs: OrderedDict[tuple[int, int, int, int], BackendDescriptor] = OrderedDict()

    @property
    def closed(self) -> bool:
        # The descriptor's Owned.closed, asked of its finalizer directly: the plan cache asks on every hit.
        return not self._finalizer.alive

    def execute(self, handle: Any, x: int, w: int, y: int, workspace: int) -> None:
        """Enqueue the plan on the handle's stream: device pointers of x, w, y (by role) and of the workspace.

        ``ValueError`` once the plan is closed."""
        # The plan and its pack go to cuDNN as raw pointers: ctypes would convert a descriptor through its
        # _as_parameter_ (two properties and a c_void_p, some 0.3 us apiece on every call). The plan's is read
        # through the property that refuses a closed one; a kept pack is open as long as it is kept (close() and
        # eviction let go of it first). The handle's is read by call(), as for every cuDNN call.
        plan = self.descriptor.handle
        key = (x, w, y, workspace)
        if self.reuse_variant_packs:
            pack = self._packs.get(key)
            if pack is None:
                pack = self._packs[key] = _variant_pack(key)
                if len(self._packs) > _VARIANT_PACKS_KEPT:
                    self._packs.popitem(last=False)[1].close()
            call("cudnnBackendExecute", handle, plan, ctypes.c_void_p(pack._handle), context=self._context)
            return
        _execute_with_new_pack(handle, plan, key, self._context)

    def _context(self) -> str:
        return f"plan {self.name}, workspace {self.workspace_bytes} bytes"

    def close(self) -> None:
        """Destroy the plan and the variant packs it keeps; later calls do nothing."""
        packs = list(self._packs.values())
        self._packs.clear()  # before any is destroyed: execute() passes a kept pack's pointer unchecked
        for pack in packs:
            pack.close()
        self.descriptor.close()

    def __repr__(self) -> str:
        return f"<Plan {self.name} workspace={self.workspace_bytes}{' closed' if self.closed else ''}>"


_UID_ARRAY = (ctypes.c_int64 * 3)(UIDS["x"], UIDS["w"], UIDS["y"])
_raw_fns: tuple[Any, ...] = ()  # create, set, finalize, destroy: the per-call pack's calls, declared on first use


def _execute_with_new_pack(handle: Any, plan: int, key: tuple[int, int, int, int], context: Any) -> None:
    """Build a variant pack, execute, destroy the pack: straight ctypes calls, since this runs on every call of a
    plan that keeps no packs (a BackendDescriptor's bookkeeping would cost it some 40 us)."""
    global _raw_fns
    if not _raw_fns:
        _raw_fns = tuple(function(f"cudnnBackend{n}") for n in ("CreateDescriptor", "SetAttribute", "Finalize",
                                                                 "DestroyDescriptor"))
    create, set_attr, finalize, destroy = _raw_fns
    pack = ctypes.c_void_p()
    check(create(D.VARIANT_PACK_DESCRIPTOR, ctypes.byref(pack)), "cudnnBackendCreateDescriptor", context)
    try:
        x, w, y, workspace = key
        pointers, scratch = (ctypes.c_void_p * 3)(x, w, y), ctypes.c_void_p(workspace)
        check(set_attr(pack, A.VARIANT_PACK_UNIQUE_IDS, T.INT64, 3, _UID_ARRAY), "cudnnBackendSetAttribute", context)
        check(set_attr(pack, A.VARIANT_PACK_DATA_POINTERS, T.VOID_PTR, 3, pointers), "cudnnBackendSetAttribute",
              context)
        check(set_attr(pack, A.VARIANT_PACK_WORKSPACE, T.VOID_PTR, 1, ctypes.byref(scratch)),
              "cudnnBackendSetAttribute", context)
        check(finalize(pack), "cudnnBackendFinalize", context)
        call("cudnnBackendExecute", handle, plan, pack, context=context)
    finally:
        destroy(pack)


def _variant_pack(key: tuple[int, int, int, int]) -> BackendDescriptor:
    x, w, y, workspace = key
    pack = BackendDescriptor(D.VARIANT_PACK_DESCRIPTOR)
    pack.set(A.VARIANT_PACK_UNIQUE_IDS, T.INT64, list(_UID_ARRAY))
    pack.set(A.VARIANT_PACK_DATA_POINTERS, T.VOID_PTR, [x, w, y])
    return pack.set(A.VARIANT_PACK_WORKSPACE, T.VOID_PTR, workspace).finalize()
