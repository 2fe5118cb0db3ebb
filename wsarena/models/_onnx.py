"""Convolutions of an ONNX model, through the ``onnx`` package and its shape inference.

Every ``Conv`` and ``ConvTranspose`` node of the main graph (default domain) becomes a :class:`ConvLayer`, in
node order, named after the node (its first output when the node has no name). Calls to model-local functions
(``model.functions``) are inlined first (``onnx.inliner``), so the convolutions inside them count as main-graph
nodes, under the unique names the inliner gives each call's copy (``conv__1``, ``conv__2``, ...).

* Attributes: ``kernel_shape``, ``strides``, ``dilations``, ``group``, ``pads``, ``auto_pad``
  (``NOTSET``, ``VALID``, ``SAME_UPPER``, ``SAME_LOWER``), and for ``ConvTranspose`` ``output_padding`` and
  ``output_shape``, with the defaults and formulas of the ONNX operator specification. A ConvTranspose output
  (``output_shape``, or ``SAME_*``'s input size times stride) past the full one by less than a stride, as a kernel
  narrower than its stride gives, is output padding: onnxruntime pads nothing and leaves those positions without
  contribution.
* Shapes: the weight shape from an initializer or a ``Constant`` (sparse ones too) or the inferred value info; the
  input shape from the graph inputs or ``onnx.shape_inference.infer_shapes`` (with data propagation; of the tensors
  kept in external data files, those of at most 64 elements are read for it, a ``Reshape``'s shape, never a weight).
  Before inference, the tensors of at most 64 elements computed from constants alone are evaluated (onnx's
  reference evaluator, for the ops of shape arithmetic), so inference reads their values: PyTorch's exporter
  computes the pads of ``padding_mode="reflect"`` and ``"replicate"`` with a ``Reshape``, a reversing ``Slice`` and
  a ``Transpose``, which data propagation does not follow. A sparse tensor of at most 64 elements is read with its
  values, a larger one (a pruned weight) as its dims. A negative dim in the file (some writers' -1 for a dynamic one)
  is unknown, as a symbolic one. A symbolic or missing batch dimension is taken as 1, and any batch in the file is
  replaced by 1: the planner applies its own batch.
* Channels: where inference leaves a conv's input channel count unknown (a U-Net's skip connection through a
  ``Pad`` whose pads are computed, then a ``Concat``: ``[N, ?, H, W]``), it follows from the weight, as
  ``W.shape[1] * group`` for a ``Conv`` and ``W.shape[0]`` for a ``ConvTranspose``. Spatial sizes still come from
  inference.
* A convolution whose input or weight shape is still unknown after inference is an error naming the nodes, or, with
  ``skip_unknown=True``, is left out with a warning and listed in the returned list's ``skipped``, which
  :func:`wsarena.plan` carries into its report. Each reason names the node where the shape was lost, when it was not
  a graph input: the first, going back, whose inputs' shapes are known and whose output's is not (a ``Pad`` whose
  pads are computed at run time). Symbolic spatial sizes (a detector's ``H`` and ``W``) can be fixed with
  ``input_shapes`` (``--input-shape`` on the command line) before inference; the error suggests it only when a graph
  input's shape is not fixed. An input that inference gives a negative size (past a pool whose kernel, or a
  ConvTranspose whose pads, leave no output) cannot be planned either, and its reason names the node that gave that
  size.
* A convolution with a zero in its weight's or its input's dims (the batch aside), an empty one, which ONNX allows,
  is refused by wsarena's ops as by PyTorch's: it is treated like an unknown shape (a ``Conv`` whose kernel is past
  the input and its pads, an output of negative size, is an error, as for an input that is not empty). So is one
  whose input, weight or bias is of an element type its operator does not take at the model's opset, as the
  installed onnx's schema of that version says (an integer, a bool, a string; bfloat16 before opset 22), or whose
  input, weight and bias are not of one type (a float input, a float16 weight), which the operator's one type ``T``
  forbids; onnxruntime refuses such a model. A type is a graph input's or an initializer's, or the one inference
  gives a node's output from theirs (a Cast's, a Constant's, a QuantizeLinear's); a value_info's type is an
  annotation, and is not read.
* Asymmetric padding (explicit ``pads`` or ``SAME_*`` with an odd total) cannot be given to cuDNN. With
  ``asymmetric_pads="widen"`` (the default) a ``Conv`` is modelled the way onnxruntime's CUDA provider runs it:
  the larger of the two pads on both sides, then the extra output row or column sliced off; a
  ``ConvTranspose`` gets the smaller pad, its backward-data computes the larger output and the extra is sliced
  off. Either way the layer is the convolution cuDNN actually runs. With ``asymmetric_pads="error"`` such nodes
  are treated like unknown shapes (an error naming them, or skipped with a warning under ``skip_unknown``). In
  either mode, pads that leave no output as written are refused as symmetric ones are, whatever the pads modelled.
* Nested subgraphs (the bodies of ``If``, ``Loop``, ``Scan``) are not searched; a warning says how many convs
  they hold. Quantized convolutions (``QLinearConv``, ``ConvInteger``) are not planned either, and a warning counts
  them too. Ops of other domains (e.g. ``com.microsoft.FusedConv``) are not convolutions here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import numbers
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from .._files import OPENS_BENEATH, NotRegularFile, read_regular_part
from .._geometry import conv_transpose_geometry
from .._sizes import is_choice, is_sequence, short_path, short_repr
from ._file import read_model_file
from ._layer import ConvLayer, LayerList, ModelError
from ._onnx_values import SMALL, densify_sparse_tensors, fold_small_constants

__all__ = ["load_onnx"]

_CONV_OPS = ("Conv", "ConvTranspose")
_DEFAULT_DOMAINS = ("", "ai.onnx")


class _Unsupported(Exception):
    """One node cannot become a layer; the message says why (collected, then raised or warned). ``kind`` is
    ``"pads"`` for asymmetric padding under ``asymmetric_pads="error"``, else ``"geometry"``."""

    def __init__(self, message: str, kind: str = "geometry") -> None:
        super().__init__(message)
        self.kind = kind


# What the error about nodes that cannot be planned suggests, per kind of reason.
_HINTS = {
    "shape": "fix the model's input shapes (input_shapes= / --input-shape)",
    "pads": "model asymmetric pads as onnxruntime runs them (asymmetric_pads='widen' / --asymmetric-pads widen)",
}


def _dims(type_proto: Any) -> tuple[int | None, ...] | None:
    """The shape in a TypeProto as ints (``None`` for a symbolic dim), or ``None`` when there is no shape."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in type_proto.tensor_type.shape.dim)


def _shape_table(graph: Any) -> dict[str, tuple[int | None, ...]]:
    shapes: dict[str, tuple[int | None, ...]] = {}
    for vi in [*graph.value_info, *graph.output, *graph.input]:  # graph inputs last: they win
        dims = _dims(vi.type)
        if dims is not None:
            shapes[vi.name] = dims
    for init in graph.initializer:  # an initializer's dims are authoritative, data or not
        shapes[init.name] = tuple(init.dims)
    return shapes


def _type_table(model: Any) -> dict[str, int]:
    """The element type (TensorProto.DataType) of each graph input, initializer and node output that has one (not
    UNDEFINED). A node output's is inferred afresh, from the inputs' and initializers' types alone (no data): a
    value_info's type is an annotation, a writer's mistake at worst, which inference keeps over its own."""
    import onnx
    from onnx import helper

    graph = model.graph
    types: dict[str, int] = {}
    for vi in graph.input:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in graph.initializer:
        if init.data_type:
            types[init.name] = init.data_type
    declared = {vi.name for vi in graph.input}
    given = [*graph.input, *(helper.make_tensor_value_info(init.name, init.data_type, init.dims)
                             for init in graph.initializer if init.name not in declared)]
    bare = helper.make_model(helper.make_graph(graph.node, graph.name, given, []),
                             opset_imports=model.opset_import, ir_version=model.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - as for the shapes: any error means no types beyond the given ones
        return types
    for vi in inferred.graph.value_info:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type and vi.name not in types:
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


@functools.cache
def _conv_types(op: str, opset: int | None) -> tuple[int, ...]:
    """The element types (``TensorProto.DataType``) that ONNX's ``op`` (``Conv`` or ``ConvTranspose``) of ``opset``
    takes for its input, weight and bias, as the installed onnx's schema of that version says (Conv-22 added
    bfloat16); the newest schema's where the model's opset is unknown or none onnx has (below 1)."""
    from onnx import TensorProto, defs

    newest = defs.onnx_opset_version()
    schema = defs.get_schema(op, min(opset, newest)) if opset is not None and opset >= 1 else defs.get_schema(op)
    codes = {f"tensor({name.lower()})": code for name, code in TensorProto.DataType.items()}
    param = schema.inputs[0].type_str  # "T", which the input, the weight and the bias share
    allowed = next(c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == param)
    return tuple(codes[text] for text in allowed if text in codes)


def _opset_taking(op: str, opset: int, elem_type: int) -> int | None:
    """The first opset after ``opset`` whose ``op`` takes ``elem_type``, or ``None`` where none does."""
    from onnx import defs

    return next((v for v in range(opset + 1, defs.onnx_opset_version() + 1)
                 if elem_type in _conv_types(op, v)), None)


def _type_name(elem_type: int) -> str:
    """``float16``, ``int64``: an element type as ONNX writes it in lower case (a damaged file's number as such)."""
    from onnx import TensorProto

    try:
        return TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return f"of element type {elem_type}"


def _wrong_types(node: Any, types: Mapping[str, int], opset: int | None) -> str | None:
    """Why the conv ``node`` of a model of ``opset`` cannot run: an input, weight or bias of an element type its
    operator of that opset does not take (an integer, a string; bfloat16 before opset 22), or of different types
    (the operator's one type T), which onnxruntime refuses to load and cuDNN has no convolution of; ``None`` where
    none is known to be so. A tensor whose type is not known is not compared."""
    if opset is not None and opset < 1:
        opset = None  # none onnx has: the newest schema's types, as for a model that names no opset
    allowed = _conv_types(node.op_type, opset)
    of = f"a {node.op_type}" if opset is None else f"a {node.op_type} of opset {opset}"
    known, seen = [], set()
    for what, tensor in zip(("input", "weight", "bias"), node.input[:3]):
        found = types.get(tensor) if tensor else None
        if found is None:
            continue
        if found not in allowed:
            later = None if opset is None else _opset_taking(node.op_type, opset, found)
            since = f"; {_type_name(found)} from opset {later}" if later is not None else ""
            takes = _listed([_type_name(t) for t in allowed], "or")
            return f"{what} {short_repr(tensor)} is {_type_name(found)}: {of} takes {takes}{since}"
        known.append(f"{what} {short_repr(tensor)} is {_type_name(found)}")
        seen.add(found)
    if len(seen) > 1:
        return f"{_listed(known, 'and')}: a {node.op_type}'s input, weight and bias are of one type"
    return None


def _listed(items: Sequence[str], last: str) -> str:
    """``a, b or c``: the items in a sentence, ``last`` before the last."""
    return ", ".join(items[:-1]) + f" {last} {items[-1]}" if len(items) > 1 else "".join(items)


# The attributes a conv reads that are lists of ints, and the least each entry may be.
_INTS_ATTRS = {"kernel_shape": 1, "strides": 1, "dilations": 1, "pads": 0, "output_padding": 0, "output_shape": 1}


def _attrs(node: Any, name: str) -> dict[str, Any]:
    """The node's attributes by name; :class:`ModelError` naming the node when one a conv reads has the wrong
    type or range (a damaged file can turn a list of ints into anything)."""
    from onnx import helper

    where = f"ONNX node {short_repr(name)}"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for key, least in _INTS_ATTRS.items():
        value = attrs.get(key)
        if value is not None and not (isinstance(value, list) and all(
                isinstance(v, int) and v >= least for v in value)):
            raise ModelError(f"{where}: {key}={short_repr(value)} must be a list of ints >= {least}")
    group = attrs.get("group", 1)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ModelError(f"{where}: group={short_repr(group)} must be an int >= 1")
    if not isinstance(attrs.get("auto_pad", b""), (bytes, str)):
        raise ModelError(f"{where}: auto_pad={short_repr(attrs['auto_pad'])} must be a string")
    return attrs


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _split_pads(pads: list[int], nd: int, name: str) -> tuple[list[int], list[int]]:
    if len(pads) != 2 * nd:
        raise ModelError(f"ONNX node {short_repr(name)}: pads={short_repr(pads)} must have {2 * nd} entries (begin and "
                         "end per dim)")
    return list(pads[:nd]), list(pads[nd:])


def _same_split(total: int, upper: bool) -> tuple[int, int]:
    """Begin and end padding for a SAME_* total: SAME_UPPER puts the odd one at the end."""
    small, large = total // 2, total - total // 2
    return (small, large) if upper else (large, small)


def _empty(x: tuple[int, ...], w: tuple[int, ...]) -> str | None:
    """Why a conv of input shape ``x`` and weight shape ``w`` is an empty one, a zero in either's dims (the batch
    aside: the planner sets its own), or ``None`` where it is not."""
    for what, dims in (("input", x[1:]), ("weight", w)):
        if 0 in dims:
            shown = list(x) if what == "input" else list(w)
            return f"{what} shape {shown} has a zero dimension, which wsarena's ops refuse"
    return None


def _conv_layer(name: str, x: tuple[int, ...], w: tuple[int, ...], a: dict[str, Any], transposed: bool,
                widen: bool) -> ConvLayer:
    """The layer for the Conv or ConvTranspose node ``name`` with known input ``x`` and weight ``w`` shapes.

    Raises :class:`_Unsupported` for what ``skip_unknown`` may skip, :class:`ModelError` for a broken node.
    """
    where = f"ONNX node {short_repr(name)}"
    nd = len(x) - 2
    kernel = list(a.get("kernel_shape") or w[2:])
    if len(kernel) != nd or list(w[2:]) != kernel:
        raise ModelError(f"{where}: kernel_shape={short_repr(kernel)} does not match weight shape "
                         f"{short_repr(list(w))}")
    stride = list(a.get("strides") or [1] * nd)
    dilation = list(a.get("dilations") or [1] * nd)
    group = a.get("group", 1)
    auto_pad = _text(a.get("auto_pad", "NOTSET")) or "NOTSET"
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise ModelError(f"{where}: unknown auto_pad {short_repr(auto_pad)}")
    if len(stride) != nd or len(dilation) != nd:
        raise ModelError(f"{where}: strides={short_repr(stride)} and dilations={short_repr(dilation)} need {nd} "
                         "entries")
    eff = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]  # the dilated kernel's extent
    size = list(x[2:])
    if auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    elif auto_pad == "NOTSET":
        begin, end = _split_pads(list(a.get("pads") or [0] * (2 * nd)), nd, name)
    if not transposed:
        if auto_pad.startswith("SAME"):
            totals = [max(0, (-(-s // st) - 1) * st + e - s) for s, st, e in zip(size, stride, eff)]
            begin, end = map(list, zip(*(_same_split(t, auto_pad == "SAME_UPPER") for t in totals)))
        # The pads as written, not as widened: a kernel past them leaves no output, whose size is negative (a
        # broken model, where onnxruntime fails and the next conv's input is impossible) or, from an input that is
        # not empty, 0, which the layer refuses so where the pads are symmetric. Either is said as the layer says it.
        padded = [s + b + e for s, b, e in zip(size, begin, end)]
        out = [(p - e) // st + 1 for p, e, st in zip(padded, eff, stride)]
        empty = _empty(x, w)
        for i, o in enumerate(out):
            if o < 0 or (o == 0 and empty is None):
                raise ModelError(f"layer {short_repr(name)}: kernel {tuple(kernel)} (dilation {tuple(dilation)}) is "
                                 f"larger than the padded input {tuple(padded)} in dimension {i}")
        if empty is not None:
            raise _Unsupported(empty)
        if begin != end:
            if not widen:
                raise _Unsupported(f"asymmetric pads (begin {begin}, end {end})", "pads")
            begin = [max(b, e) for b, e in zip(begin, end)]  # onnxruntime's CUDA provider: widen, then slice
        return ConvLayer(name, (1, x[1], *size), w, stride=tuple(stride), padding=tuple(begin),
                         dilation=tuple(dilation), groups=group)

    # ConvTranspose: the forward-equivalent convolution maps the uncropped output back to the input `x`.
    empty = _empty(x, w)
    if empty is not None:
        raise _Unsupported(empty)
    if w[0] != x[1]:
        raise ModelError(f"{where}: ConvTranspose weight {list(w)} needs {w[0]} input channels, not {x[1]}")
    out_pad = list(a.get("output_padding") or [0] * nd)
    if len(out_pad) != nd:
        raise ModelError(f"{where}: output_padding={short_repr(out_pad)} needs {nd} entries")
    if a.get("output_shape") and len(a["output_shape"]) not in (nd, nd + 2):
        raise ModelError(f"{where}: output_shape={short_repr(a['output_shape'])} needs {nd} entries (or {nd + 2}, "
                         "with N and C)")
    full = [st * (s - 1) + op + e for s, st, op, e in zip(size, stride, out_pad, eff)]  # before any cropping
    out_shape = list(a["output_shape"])[-nd:] if a.get("output_shape") else None  # spatial, or N, C too
    if auto_pad.startswith("SAME") and out_shape is None:
        out_shape = [s * st for s, st in zip(size, stride)]
    if out_shape is not None:
        totals = [f - o for f, o in zip(full, out_shape)]
        # An output past the full one (SAME with a kernel narrower than the stride): onnxruntime pads nothing, and
        # the extra positions get no contribution, as output padding's do; within a stride it is output padding.
        grown = [op - min(t, 0) for op, t in zip(out_pad, totals)]
        if any(t < 0 and g >= st for t, g, st in zip(totals, grown, stride)):
            raise _Unsupported(f"output_shape {out_shape} larger than the full output {full} by a stride or more")
        full = [f - min(t, 0) for f, t in zip(full, totals)]
        out_pad, totals = grown, [max(t, 0) for t in totals]
        # The spec: output_shape overrides pads; SAME_UPPER puts the odd one at the end, anything else at the start.
        begin, end = map(list, zip(*(_same_split(t, auto_pad == "SAME_UPPER") for t in totals)))
    # The pads as written, not the smaller one modelled: what they crop off leaves the output, whatever the mode
    if any(f - b - e < 1 for f, b, e in zip(full, begin, end)):
        raise _Unsupported(f"padding {begin}/{end} leaves no output")
    if begin != end and not widen:
        raise _Unsupported(f"asymmetric pads (begin {begin}, end {end})", "pads")
    pad = [min(b, e) for b, e in zip(begin, end)]
    if any(op >= st for op, st in zip(out_pad, stride)):
        raise _Unsupported(f"output_padding {out_pad} with strides {stride} has no equivalent convolution")
    # The equivalent convolution's input is the (uncropped-by-widening) output; the ConvTranspose weight
    # (C_in, C_out/group, *k) is that convolution's (K, C/group, *k): the same tensor.
    try:
        geom = conv_transpose_geometry((1, *x[1:]), w, stride=stride, padding=pad, output_padding=out_pad,
                                       dilation=dilation, groups=group)
    except ValueError as exc:  # what ConvLayer would say of the equivalent convolution, for the ConvTranspose's shapes
        raise ModelError(f"{where}: {exc}") from None
    return ConvLayer(name, geom.input_shape, w, stride=tuple(stride), padding=tuple(pad), dilation=tuple(dilation),
                     groups=group, transposed=True)


# Quantized convolutions (integer operands): cuDNN's floating-point convolutions, which wsarena plans, run none of them
_QUANTIZED_CONV_OPS = ("QLinearConv", "ConvInteger")


def _quantized(n: int) -> str:
    return f"its {n} QLinearConv or ConvInteger node(s) are quantized convolutions, which wsarena does not plan"


def _count_subgraph_convs(graph: Any) -> int:
    from onnx import AttributeProto

    n = 0
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                n += sum(1 for m in sub.node if m.op_type in _CONV_OPS) + _count_subgraph_convs(sub)
    return n


def _names(items: list[tuple[str, str, str]], limit: int = 5) -> str:
    shown = "; ".join(f"{short_repr(n)} ({why})" for n, why, _ in items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def _hint(items: list[tuple[str, str, str]]) -> str:
    """What to do about the nodes ``items`` (name, why, kind) that cannot be planned."""
    fixes = [hint for kind, hint in _HINTS.items() if any(k == kind for _, _, k in items)]
    return ", or ".join([*fixes, "skip them with skip_unknown=True / --skip-unknown"])


def _with_channels(x: tuple[int | None, ...] | None, w: tuple[int | None, ...] | None, group: int,
                   transposed: bool) -> tuple[int | None, ...] | None:
    """``x`` with an unknown channel count taken from the weight ``w`` (see the module docstring)."""
    if x is None or w is None or len(x) < 2 or x[1] is not None or len(w) != len(x) or None in w[:2]:
        return x
    channels = w[0] if transposed else cast(int, w[1]) * group
    return (x[0], channels, *x[2:])


def _lost(dims: tuple[int | None, ...] | None) -> bool:
    """Whether a shape is unknown beyond its batch (the first dim, which the planner sets)."""
    return dims is None or None in dims[1:]


def _unknown_shape(what: str, dims: tuple[int | None, ...] | None, tensor: str, producers: Mapping[str, Any],
                   shapes: Mapping[str, tuple[int | None, ...]], found: dict[str, str | None]) -> str:
    """Why a conv's ``what`` (input or weight) shape ``dims`` is unknown: the node where it was lost, going back from
    ``tensor`` to the first node whose inputs have known shapes but whose output has not (a ``Pad`` whose pads are
    computed at run time, a ``Reshape`` to a runtime shape); nothing more where it goes back to a graph input.
    ``found`` as for :func:`_first_node`."""
    where = _first_node(tensor, _lost, producers, shapes, found)
    if where is None:
        return f"{what} shape {_show(dims)} unknown"
    return f"{what} shape {_show(dims)} unknown: shape inference cannot work out the output of {where}"


def _first_node(tensor: str, bad: Callable[[tuple[int | None, ...] | None], bool], producers: Mapping[str, Any],
                shapes: Mapping[str, tuple[int | None, ...]], found: dict[str, str | None]) -> str | None:
    """The node whose output's shape is the first ``bad`` one (unknown, or of a negative size) on the way back from
    ``tensor``: the first whose inputs' shapes are none of them bad, named as :func:`_node_named` names it, or None
    where the way goes back to a graph input. ``found``: that node for each tensor passed before, by every call for
    one graph and one ``bad``, so that the convs of a long chain do not each go back over it."""
    passed: list[str] = []
    where = None
    while tensor in producers:
        if tensor in found:
            where = found[tensor]
            break
        found[tensor] = None  # passed: a cycle ends here
        passed.append(tensor)
        node = producers[tensor]
        inputs = [name for name in node.input if name and bad(shapes.get(name))]
        if not inputs:
            where = _node_named(node, tensor)
            break
        tensor = inputs[0]
    found.update(dict.fromkeys(passed, where))
    return where


def _node_named(node: Any, tensor: str) -> str:
    """``Pad 'pad1'``: the node that gives ``tensor``, by its op type and name (the tensor's where it has none)."""
    kind = node.op_type  # a damaged file's (text of any characters, or bytes not UTF-8) as a repr
    kind = kind if isinstance(kind, str) and kind.isidentifier() else short_repr(kind)
    return f"{kind} {short_repr(node.name or tensor)}"


def _negative(dims: tuple[int | None, ...] | None) -> bool:
    """Whether a shape has a negative dim beyond its batch (which the planner sets)."""
    return dims is not None and any(d is not None and d < 0 for d in dims[1:])


def _negative_shape(dims: tuple[int | None, ...], tensor: str, producers: Mapping[str, Any],
                    shapes: Mapping[str, tuple[int | None, ...]], found: dict[str, str | None]) -> str:
    """Why a conv's input shape ``dims`` has a negative dim: the node that gave it one, going back from ``tensor`` to
    the first node whose inputs have none but whose output has (a pool, or a ConvTranspose whose pads crop more than
    its output, past which shape inference carries the size on). ``found`` as for :func:`_first_node`."""
    where = _first_node(tensor, _negative, producers, shapes, found)
    if where is None:
        return f"input shape {_show(dims)} impossible: a negative size"
    return f"input shape {_show(dims)} impossible: shape inference gives the output of {where} a negative size"


# The most bytes protobuf parses as one message, an ONNX model (onnx.checker.MAXIMUM_PROTOBUF): a file larger is
# refused before it is read, where protobuf refused it only once all of it was read ("Wire format was corrupt"), and
# a pipe once it gives a byte more, where one without end was read until memory ran out
_PROTOBUF_MAX = 2**31 - 1
_BEYOND_PROTOBUF = ("the most protobuf reads as one ONNX model (2 GiB less a byte): weights that large belong in ONNX "
                    "external data, files beside the model (onnx.save_model(model, path, save_as_external_data=True)), "
                    "whose weights wsarena does not read")


def check_asymmetric_pads(value: Any) -> None:
    """``asymmetric_pads`` must be ``"widen"`` or ``"error"`` (``ValueError``), whatever model it comes with."""
    if not is_choice(value, ("widen", "error")):
        raise ValueError(f"asymmetric_pads must be 'widen' or 'error', not {short_repr(value)}")


def check_skip_unknown(value: Any) -> None:
    """``skip_unknown`` must be ``True`` or ``False`` (``TypeError``), whatever model it comes with: ``"no"``, or
    ``"false"`` from a config file, is true, and would skip what cannot be planned with a warning."""
    if not isinstance(value, bool):
        raise TypeError(f"skip_unknown must be True or False, not {short_repr(value)}")


def load_onnx(path: str | os.PathLike[str], *, skip_unknown: bool = False,
              asymmetric_pads: str = "widen",
              input_shapes: Mapping[str, Sequence[int]] | Sequence[int] | None = None) -> LayerList:
    """The convolutions of the ONNX model at ``path``; see the module docstring for the rules.

    ``input_shapes`` fixes the shapes of graph inputs before shape inference, for models whose spatial
    sizes are symbolic: ``{input name: shape}``, or one shape for a model with a single input. The batch entry
    is kept only for inference; layers are at batch 1 as always.

    Raises
    ------
    ModelError
        Unreadable file, not an ONNX model, no convolution, an ``input_shapes`` entry that names no graph input
        or does not match its rank, or (without ``skip_unknown``) convs whose shapes stay unknown, naming them.
    ValueError
        ``asymmetric_pads`` other than ``"widen"`` or ``"error"``.
    TypeError
        ``skip_unknown`` other than ``True`` or ``False``.
    """
    check_asymmetric_pads(asymmetric_pads)
    check_skip_unknown(skip_unknown)
    try:
        import onnx
        from google.protobuf.message import DecodeError
    except ImportError as exc:  # pragma: no cover - onnx is a dependency
        raise ModelError(f"reading ONNX models needs the onnx package ({exc})") from None
    path = os.fspath(path)
    where = short_path(path)  # as errors and warnings name it: shortened
    data = read_model_file(path, limit=_PROTOBUF_MAX, beyond=_BEYOND_PROTOBUF)
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(f"{where} is not an ONNX model ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    # Protobuf parses many byte strings (an empty file, for one) as an empty message: no graph means not ONNX.
    if not model.HasField("graph") or not model.graph.node:
        raise ModelError(f"{where} is not an ONNX model (no graph nodes)")
    if model.functions:
        model = _inline_functions(model, where)
    _load_small_external_data(model.graph, os.path.dirname(path))
    convs = [(i, n) for i, n in enumerate(model.graph.node)
             if n.op_type in _CONV_OPS and n.domain in _DEFAULT_DOMAINS]
    nested = _count_subgraph_convs(model.graph)
    if nested:
        warnings.warn(f"{where}: {nested} conv node(s) inside subgraphs (If/Loop/Scan bodies) are not included",
                      stacklevel=3)
    quantized = sum(1 for n in model.graph.node if n.op_type in _QUANTIZED_CONV_OPS and n.domain in _DEFAULT_DOMAINS)
    if not convs:
        raise ModelError(f"{where}: the ONNX model has no Conv or ConvTranspose node in its main graph"
                         + (f" ({_quantized(quantized)})" if quantized else ""))
    if quantized:
        warnings.warn(f"{where}: {_quantized(quantized)}, and are not included", stacklevel=3)
    _unknown_negative_dims(model.graph)
    densify_sparse_tensors(model.graph)
    opset = next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), None)
    if opset is not None:
        fold_small_constants(model.graph, opset)
    if input_shapes is not None:
        _fix_input_shapes(model.graph, input_shapes, where)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference errors come in several types; any means no shapes
        raise ModelError(f"{where}: ONNX shape inference failed: {exc}".splitlines()[0]) from None
    shapes = _shape_table(inferred.graph)
    types = _type_table(model)
    producers = {out: n for n in model.graph.node for out in n.output if out}
    # input_shapes can help only where a graph input's shape is not fixed; else a lost shape is computed at run time
    lost_kind = "shape" if any(_lost(shapes.get(name)) for name in _inputs(model.graph)) else "computed"

    layers = LayerList()
    unknown: list[tuple[str, str, str]] = []  # (name, why, kind)
    found: dict[str, str | None] = {}  # where each tensor's shape was lost, for _unknown_shape
    negative_found: dict[str, str | None] = {}  # where each tensor's size became negative, for _negative_shape
    for index, node in convs:
        name = node.name or (node.output[0] if node.output and node.output[0] else f"{node.op_type}_{index}")
        x, w = (shapes.get(node.input[i]) if len(node.input) > i else None for i in (0, 1))
        try:
            attrs = _attrs(node, name)
        except ModelError as exc:
            raise ModelError(f"{where}: {exc}") from None
        if x is not None and len(x) >= 1:
            x = (1, *x[1:])  # symbolic or fixed batch: the planner sets its own
        x = _with_channels(x, w, attrs.get("group", 1), node.op_type == "ConvTranspose")
        if x is None or None in x:
            unknown.append((name, _unknown_shape("input", x, node.input[0], producers, shapes, found), lost_kind))
            continue
        if w is None or None in w:
            tensor = node.input[1] if len(node.input) > 1 else ""
            unknown.append((name, _unknown_shape("weight", w, tensor, producers, shapes, found), lost_kind))
            continue
        if len(x) not in (3, 4, 5) or len(w) != len(x):
            why = f"input {_show(x)} and weight {_show(w)} are not a 1-, 2- or 3-D convolution"
            unknown.append((name, why, "geometry"))
            continue
        if _negative(x):  # what an earlier node gave, which no conv can take (this one's own output is checked)
            unknown.append((name, _negative_shape(x, node.input[0], producers, shapes, negative_found), "geometry"))
            continue
        why_not = _wrong_types(node, types, opset)
        if why_not is not None:
            unknown.append((name, why_not, "geometry"))
            continue
        try:
            known_x, known_w = cast(tuple[int, ...], x), cast(tuple[int, ...], w)  # no None left: checked above
            layers.append(_conv_layer(name, known_x, known_w, attrs, node.op_type == "ConvTranspose",
                                      asymmetric_pads == "widen"))
        except _Unsupported as exc:
            unknown.append((name, str(exc), exc.kind))
        except ModelError as exc:
            raise ModelError(f"{where}: {exc}") from None
    if unknown and not skip_unknown:
        raise ModelError(
            f"{where}: {len(unknown)} conv node(s) cannot be planned: {_names(unknown)} ({_hint(unknown)})"
        )
    if unknown:
        warnings.warn(f"{where}: skipped {len(unknown)} conv node(s): {_names(unknown)}", stacklevel=3)
    if not layers:
        raise ModelError(f"{where}: none of the model's {len(convs)} conv node(s) could be planned")
    layers.skipped = tuple((name, why) for name, why, _ in unknown)
    return layers


def _inline_functions(model: Any, where: str) -> Any:
    """``model`` with every call to a model-local function replaced by the function's body; ``where`` names the file
    in an error."""
    from onnx.inliner import inline_local_functions

    try:
        return inline_local_functions(model)
    except Exception as exc:  # noqa: BLE001 - the inliner raises several types; any means the calls are unreadable
        raise ModelError(f"{where}: cannot inline the model's local functions: {exc}".splitlines()[0]) from None


# The bytes of an element of each type a shape or a scale comes in, as an external file holds it
_ITEM_SIZES = {"BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FLOAT16": 2, "BFLOAT16": 2, "INT32": 4,
               "UINT32": 4, "FLOAT": 4, "INT64": 8, "UINT64": 8, "DOUBLE": 8}


def _load_small_external_data(graph: Any, base_dir: str) -> None:
    """Read into the model the small tensors of the main graph kept in external data files, as ``onnx.load`` does,
    for the shape inference that reads their values (a ``Reshape``'s shape); one that cannot be read stays without
    its data. Each read takes the tensor's own bytes, from a regular file inside ``base_dir``, and refuses what onnx
    refuses (:func:`wsarena._files.read_regular_part`): an absolute ``location`` or one with ``..``, a link on the
    way (even one to a file inside the folder), a file of several hard links.
    A FIFO, or a ``length`` that is not the tensor's, is not read either: the file is opened without blocking, where
    onnx opened it as ``open()`` does, and a FIFO put in the file's place after it was looked at was waited on until
    a writer came, for good where none came. Where a file cannot be opened beneath a folder so (Windows), onnx's own
    loader reads it (no FIFO there is a file's name)."""
    from onnx import TensorProto
    from onnx.external_data_helper import uses_external_data

    folder = base_dir or os.curdir
    item_sizes = {getattr(TensorProto, name): size for name, size in _ITEM_SIZES.items()}
    tensors = [*graph.initializer, *(a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute
                                     if a.HasField("t"))]
    for tensor in tensors:
        size = item_sizes.get(tensor.data_type)
        if not uses_external_data(tensor) or size is None or min(tensor.dims, default=0) < 0:
            continue
        nbytes = math.prod(tensor.dims) * size
        fields = {entry.key: entry.value for entry in tensor.external_data}
        if nbytes > SMALL * size or fields.get("length", str(nbytes)).strip() != str(nbytes):
            continue
        if nbytes:
            if OPENS_BENEATH:
                data = _read_external_part(fields, folder, nbytes)
            else:  # Windows
                data = _read_external_by_onnx(tensor, fields, folder, nbytes)
            if len(data) != nbytes:  # not read, or from a file shorter than that
                continue
            tensor.raw_data = data
        else:
            tensor.raw_data = b""
        # as onnx.load leaves it: the data in the model (onnx 1.16 leaves that to load's caller)
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


def _read_external_part(fields: dict[str, str], folder: str, nbytes: int) -> bytes:
    """The ``nbytes`` that the external data ``fields`` of a tensor locate beneath ``folder``, fewer where they cannot
    be read (:func:`wsarena._files.read_regular_part` refuses the file, or the offset is no number, or negative)."""
    try:
        offset = int(fields.get("offset", "0"))  # as onnx reads it: " 8", "+8" and "0_8" are 8
        if offset < 0:
            return b""
        return read_regular_part(folder, fields.get("location", ""), offset, nbytes)
    except (NotRegularFile, OSError, ValueError, OverflowError):  # a link, a FIFO, gone; not a number, not inside
        return b""


def _read_external_by_onnx(tensor: Any, fields: dict[str, str], folder: str, nbytes: int) -> bytes:
    """The ``nbytes`` of ``tensor`` read by onnx's own loader, which makes its own checks, from its external data
    ``fields`` beneath ``folder``; nothing where it refuses them."""
    from onnx import TensorProto
    from onnx.external_data_helper import load_external_data_for_tensor

    copy = TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                       data_location=TensorProto.EXTERNAL)
    for key, value in {**fields, "length": str(nbytes)}.items():
        copy.external_data.add(key=key, value=value)
    with contextlib.suppress(Exception):  # a bad field or file: onnx raises several types
        load_external_data_for_tensor(copy, folder)
    return bytes(copy.raw_data)


def _unknown_negative_dims(graph: Any) -> None:
    """Make each negative dim of the graph's declared shapes unknown: some writers put -1 for a dynamic dim, which
    shape inference would carry on as a size (-3, -5, ... or a positive one after a ConvTranspose)."""
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.HasField("tensor_type"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_value") and d.dim_value < 0:
                    d.ClearField("dim_value")


def _inputs(graph: Any) -> dict[str, Any]:
    """The graph's inputs by name, those that are initializers too aside (older exporters list every weight as an
    input)."""
    initializers = {init.name for init in graph.initializer}
    return {vi.name: vi for vi in graph.input if vi.name not in initializers}


def _fix_input_shapes(graph: Any, input_shapes: Mapping[str, Sequence[int]] | Sequence[int], where: str) -> None:
    """Write fixed dims into the graph inputs named by ``input_shapes`` (see :func:`load_onnx`); ``where`` names the
    file in an error."""
    inputs = _inputs(graph)
    if not isinstance(input_shapes, Mapping):
        if len(inputs) != 1:
            raise ModelError(
                f"{where}: one input shape was given but the model has {len(inputs)} inputs "
                f"({_input_names(inputs) or 'none'}); name each, NAME=DIMS"
            )
        input_shapes = {next(iter(inputs)): input_shapes}
    for name, shape in input_shapes.items():
        if name not in inputs:
            raise ModelError(f"{where}: no graph input {short_repr(name)}; the inputs are {_input_names(inputs)}")
        # not text, nor binary data (b"abcd" was read as the dims 97, 98, 99, 100)
        dims: tuple[int, ...] = tuple(shape) if is_sequence(shape) else ()
        # a dim is an int64 in the file: 2**63 would be protobuf's ValueError, naming nothing
        if not dims or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 1 <= d < 2**63
                           for d in dims):
            raise ModelError(f"{where}: the shape of input {short_repr(name)} must be positive ints below 2**63, "
                             f"not {short_repr(shape)}")
        dims = tuple(int(d) for d in dims)
        tensor = inputs[name].type.tensor_type
        declared = _dims(inputs[name].type)
        if declared is not None and len(declared) != len(dims):
            raise ModelError(f"{where}: input {short_repr(name)} has {len(declared)} dims {_show(declared)}, "
                             f"not {len(dims)}")
        tensor.shape.ClearField("dim")
        for d in dims:
            tensor.shape.dim.add().dim_value = d


def _input_names(inputs: Mapping[str, Any], limit: int = 5) -> str:
    """The graph inputs' names, each shortened, and past ``limit`` how many more, as :func:`_names` lists nodes."""
    shown = ", ".join(map(short_repr, itertools.islice(inputs, limit)))
    return shown + (f", and {len(inputs) - limit} more" if len(inputs) > limit else "")


class _Unknown:
    """An unknown dim as :func:`_show` shows it."""

    def __repr__(self) -> str:
        return "?"


_UNKNOWN = _Unknown()


def _show(dims: Sequence[int | None] | None) -> str:
    """``[1, 3, ?, ?]``: a shape with ``?`` for each unknown dim, cut as :func:`short_repr` cuts a list."""
    return "?" if dims is None else short_repr([_UNKNOWN if d is None else d for d in dims])
