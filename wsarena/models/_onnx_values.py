"""The values of an ONNX graph's small tensors, for the shape inference that reads them (a ``Pad``'s pads, a
``Reshape``'s shape): sparse tensors made dense, and small tensors computed from constants alone evaluated.

A tensor is small when it has at most :data:`SMALL` elements: shapes, pads, scales, never a weight, of which only
the dims are needed. Both functions change the graph in place, for inference only.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

__all__ = ["SMALL", "densify_sparse_tensors", "fold_small_constants"]

SMALL = 64

# Ops whose results, from small constant operands, are small too: the arithmetic with which exporters compute pads and
# shapes. The PyTorch exporter's reflect and replicate padding computes its pads with ConstantOfShape, Concat,
# Reshape, a reversing Slice, Transpose and Cast, which onnx's data propagation does not follow.
_FOLDABLE = frozenset({"Add", "Cast", "CastLike", "Concat", "ConstantOfShape", "Div", "Flatten", "Gather", "Identity",
                       "Max", "Min", "Mul", "Neg", "Reshape", "Shape", "Size", "Slice", "Squeeze", "Sub",
                       "Transpose", "Unsqueeze"})
_DEFAULT_DOMAINS = ("", "ai.onnx")


def _dense(sparse: Any) -> Any:
    """A dense TensorProto of ``sparse``'s dims: with its values where it is small and they can be read, else
    without data (a pruned weight, of which shape inference reads only the dims)."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    dims = list(sparse.dims)
    name = sparse.values.name
    if all(d >= 0 for d in dims) and math.prod(dims) <= SMALL:
        with contextlib.suppress(Exception):  # values kept externally, indices out of range: no data, as for a weight
            values = numpy_helper.to_array(sparse.values).reshape(-1)
            indices = numpy_helper.to_array(sparse.indices)
            flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
            data = np.zeros(math.prod(dims), values.dtype)
            if len(flat) == len(values) and all(0 <= i < data.size for i in flat):
                data[flat] = values
                return numpy_helper.from_array(data.reshape(dims), name)
    return TensorProto(name=name, data_type=sparse.values.data_type, dims=dims)


def densify_sparse_tensors(graph: Any) -> None:
    """Replace the graph's sparse initializers (a pruned weight) by dense ones, and a ``Constant``'s
    ``sparse_value`` by a dense ``value``, of their dims (see :func:`_dense`): shape inference gives a sparse
    initializer a type no operator takes, and the reference evaluator that folds constants takes no sparse one."""
    from onnx import helper

    for sparse in graph.sparse_initializer:
        graph.initializer.append(_dense(sparse))
    del graph.sparse_initializer[:]
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
            for attr in node.attribute:
                if attr.name == "sparse_value":
                    attr.CopyFrom(helper.make_attribute("value", _dense(attr.sparse_tensor)))


def _constant(node: Any) -> Any:
    """The value of a ``Constant`` node as a NumPy array, or ``None`` when it is not small or not numeric."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    value = helper.get_attribute_value(attr)
    if attr.name == "value":
        if uses_external_data(value) or math.prod(value.dims) > SMALL:
            return None
        return numpy_helper.to_array(value)
    if attr.name in ("value_int", "value_ints"):
        return np.array(value, np.int64)
    if attr.name in ("value_float", "value_floats"):
        return np.array(value, np.float32)
    return None


def fold_small_constants(graph: Any, opset: int) -> None:
    """Evaluate, with onnx's reference evaluator, the small tensors of the main graph computed from constants alone
    through the ops of :data:`_FOLDABLE`, and give each one to the nodes outside that computation that read it as an
    initializer of its own (a new name: the node that computes it stays), which shape inference reads as it reads any
    initializer. Run after :func:`densify_sparse_tensors`."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    values: dict[str, Any] = {}
    for init in graph.initializer:
        if not uses_external_data(init) and all(d >= 0 for d in init.dims) and math.prod(init.dims) <= SMALL:
            with contextlib.suppress(Exception):  # a tensor without its data, as a densified weight
                values[init.name] = numpy_helper.to_array(init)
    given = set(values)  # already constants: shape inference reads them
    folded = set()  # the nodes evaluated here
    for index, node in enumerate(graph.node):
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        if node.op_type == "Constant":
            with contextlib.suppress(Exception):  # a malformed attribute: inference says what it makes of it
                value = _constant(node)
                if value is not None and node.output:
                    values[node.output[0]] = value
                    given.add(node.output[0])
            continue
        inputs = [name for name in node.input if name]
        if node.op_type not in _FOLDABLE or not inputs or any(name not in values for name in inputs):
            continue
        if node.op_type in _BROADCAST and opset < _NUMPY_BROADCAST:
            continue  # broadcast by the rule of their attributes broadcast and axis, not the evaluator's NumPy one
        if not _small_result(node.op_type, [values[name] for name in inputs]):
            continue
        results = [np.asarray(r) for r in _evaluate(node, opset, {name: values[name] for name in inputs}) or ()]
        if len(results) == len(node.output) and all(r.size <= SMALL for r in results):
            values.update((name, r) for name, r in zip(node.output, results) if name)
            folded.add(index)
    taken = {name for n in graph.node for name in (*n.input, *n.output)} | {t.name for t in graph.initializer}
    taken |= {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    renamed: dict[str, str] = {}
    for index, node in enumerate(graph.node):
        if index in folded:
            continue
        for i, name in enumerate(node.input):
            if name not in values or name in given:
                continue
            if name not in renamed:
                new = f"{name}_folded"
                while new in taken:
                    new += "_"
                try:
                    graph.initializer.append(numpy_helper.from_array(values[name], new))
                except Exception:  # noqa: BLE001 - a value no TensorProto holds (strings): left to inference
                    given.add(name)
                    continue
                taken.add(new)
                renamed[name] = new
            node.input[i] = renamed[name]


# Elementwise ops, whose result takes the shape its operands broadcast to: several small ones broadcast to a large one
# ((64, 1, 1) by (1, 64, 1) by (1, 1, 64))
_BROADCAST = frozenset({"Add", "Div", "Max", "Min", "Mul", "Sub"})
# The opset from which they broadcast as NumPy does (Max and Min from 8; before, their operands' shapes are equal)
_NUMPY_BROADCAST = 7


def _small_result(op_type: str, operands: list[Any]) -> bool:
    """Whether ``op_type`` of these small ``operands`` can be evaluated without making a large tensor: a
    ``ConstantOfShape`` of a large shape, operands that broadcast to one, or a ``Concat`` of many, are not."""
    import numpy as np

    try:
        if op_type == "ConstantOfShape":
            return 0 <= math.prod(operands[0].reshape(-1).tolist()) <= SMALL
        if op_type == "Concat":  # its result holds them all: many small operands make a large one
            return sum(np.size(v) for v in operands) <= SMALL
        if op_type in _BROADCAST:
            return math.prod(np.broadcast_shapes(*(np.shape(v) for v in operands))) <= SMALL
    except (ValueError, TypeError, IndexError):  # shapes that do not broadcast: the evaluator would refuse them
        return False
    return True


def _evaluate(node: Any, opset: int, inputs: dict[str, Any]) -> list[Any] | None:
    """The outputs of ``node`` for ``inputs``, or ``None`` when the reference evaluator cannot compute them."""
    import numpy as np
    from onnx.reference import ReferenceEvaluator

    try:
        with np.errstate(all="ignore"):  # an integer division by zero: a value, not a warning to the caller
            return list(ReferenceEvaluator(node, opsets={"": opset}).run(None, inputs))
    except Exception:  # noqa: BLE001 - a node the evaluator refuses (bad attributes, types): left to inference
        return None
