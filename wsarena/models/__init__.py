"""Layer tables: the convolutions of a network, from the built-in zoo, an ONNX file or a JSON layer list.

>>> import wsarena
>>> layers = wsarena.load_model("resnet50")
>>> len(layers), layers[0].name, layers[0].weight_shape
(53, 'conv1', (64, 3, 7, 7))

Every source gives a list of :class:`ConvLayer` at batch 1, NCHW, in execution order; the planner scales them
to its batch, dtype and layout with :meth:`ConvLayer.geometry`.

Sources
-------
zoo name
    One of :func:`zoo_names`: ``resnet50``, ``vgg16``, ``inception_v3``, ``googlenet``, ``mobilenet_v2``,
    ``unet``. See :mod:`wsarena.models._zoo` for the reference each one follows.
``*.onnx``
    Every ``Conv`` and ``ConvTranspose`` node of the main graph, with shapes from ONNX shape inference. See
    :mod:`wsarena.models._onnx` for batch, ``auto_pad``, asymmetric padding, unknown shapes and subgraphs.
``*.json``
    A layer list in the schema below, for any network the other two cannot describe.

JSON schema
-----------
Either an object with a ``"layers"`` list or a bare list. An object may say ``"layout": "NHWC"``: its shapes are
then channels last (``[N, *spatial, C]``, ``[K, *kernel, C / groups]``) and are read back as the channels-first
shapes below; other top-level keys are ignored, so the output of ``wsarena report --format json`` in either
layout reads back as its model. Each layer is an object::

    {
      "name":         "layer1.0.conv2",     # required, non-empty string
      "input_shape":  [1, 64, 56, 56],      # required, [N, C, *spatial] with 1-3 spatial dims; N is read as 1
      "weight_shape": [64, 64, 3, 3],       # required, [K, C / groups, *kernel]
      "stride":       [1, 1],               # optional, an int or one per spatial dim, default 1
      "padding":      [1, 1],               # optional, symmetric (each side), default 0
      "dilation":     [1, 1],               # optional, default 1
      "groups":       1,                    # optional, default 1
      "transposed":   false                 # optional, default false; see below
    }

Numbers must be JSON integers. A layer with ``"transposed": true`` is a transposed convolution stored as its
forward-equivalent convolution: ``input_shape`` is the ConvTranspose's *output* shape and ``weight_shape`` its
weight ``(C_in, C_out / groups, *kernel)``, so that the ConvTranspose's forward pass is this convolution's
backward-data pass (details in :class:`ConvLayer`). Unknown keys are an error (a misspelt ``"strides"`` would
otherwise be ignored), except keys ignored whatever their value: the per-pass keys a report adds (``fwd``,
``bwd_data``, ``bwd_filter``) and the derived ``output_shape``, ``macs`` and ``stream`` (not written by
wsarena's report, and not checked against the layer). Every layer's geometry is checked when it is read.
:func:`layers_to_json` writes this schema.

Errors
------
Everything that is wrong with the model, rather than with the call, raises :class:`ModelError` (a
``ValueError`` and a :class:`~wsarena.errors.WsarenaError`) with one line naming the problem: an unknown zoo
name (the message lists the zoo), an unreadable file, a path that is neither a regular file nor a pipe (a device,
a socket, a folder: refused before it is read), a pipe that gave nothing (a FIFO is read from the writers it has,
not waited on until one comes), a file that is not ONNX or not JSON, an ONNX model with no convolution,
convolutions whose shapes stay unknown, malformed layers, impossible geometry, an unknown file extension.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from .._sizes import is_sequence, short_path, short_repr
from ._json import layers_from_json, layers_to_json, load_json
from ._layer import ConvLayer, ModelError
from ._onnx import check_asymmetric_pads, check_skip_unknown, load_onnx
from ._zoo import total_macs, zoo_model, zoo_names

__all__ = ["ConvLayer", "ModelError", "layers_from_json", "layers_to_json", "load_model", "total_macs", "zoo_names"]


def check_model_named(source: str | os.PathLike[str]) -> None:
    """Raise the :class:`ModelError` of a name or path that names no model: neither a zoo model (a str) nor, by its
    extension, a .onnx or .json file (which its reader then reads, or says why it cannot); a hint to the zoo name
    closest to an unknown one. A model's flags are checked after it (the CLI's ONNX-only ones), so that an unknown
    name's error is the one given."""
    text = os.fspath(source)
    ext = os.path.splitext(text)[1].lower()
    if ext in (".onnx", ".json") or (isinstance(source, str) and zoo_model(text) is not None):
        return
    _refuse_unnamed(source)


def _refuse_unnamed(source: str | os.PathLike[str]) -> NoReturn:
    """:func:`check_model_named`'s error, for a ``source`` already known to name no zoo model nor, by its extension,
    a .onnx or .json file."""
    text = os.fspath(source)
    ext = os.path.splitext(text)[1].lower()
    if os.path.isdir(text):
        raise ModelError(f"{short_path(text)} is a folder: expected a .onnx or .json file")
    if not ext and os.path.basename(text).lower().endswith((".onnx", ".json")):
        # ".json" has no extension, as ".bashrc" has none (os.path.splitext, pathlib): said "unknown model file
        # extension (none)", or, missing, "not ... a .onnx or .json file", of a name that ends in one
        raise ModelError(f"{short_path(text)}: unknown model file extension (none: a name's leading dots begin no "
                         "extension, as in .bashrc); expected .onnx or .json after a name, as in model.json")
    if os.path.exists(text):
        unknown = short_repr(ext) if ext else "(none)"
        raise ModelError(f"{short_path(text)}: unknown model file extension {unknown}; expected .onnx or .json")
    if not isinstance(source, str):  # a path names a file, never a zoo model
        named = zoo_model(text) is not None
        hint = f"; the zoo model {short_path(text)} is named by a str, not a path" if named else ""
        raise ModelError(f"no model file {short_path(text)}: expected a .onnx or .json file{hint}")
    close = difflib.get_close_matches(text.lower(), zoo_names(), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    zoo = ", ".join(zoo_names())
    raise ModelError(f"unknown model {short_path(text)}: not a zoo model ({zoo}) nor a .onnx or .json file{hint}")


def load_model(
    source: str | os.PathLike[str] | Sequence[ConvLayer | dict[str, Any]],
    *,
    skip_unknown: bool = False,
    asymmetric_pads: str = "widen",
    input_shapes: Mapping[str, Sequence[int]] | Sequence[int] | None = None,
) -> list[ConvLayer]:
    """The convolution layers of a model, at batch 1, in execution order.

    Parameters
    ----------
    source : str, path-like or sequence
        A zoo name (see :func:`zoo_names`; case and ``-``/``_`` do not matter), a path to a ``.onnx`` model or
        a ``.json`` layer list, or a sequence of :class:`ConvLayer` and layer dicts in the JSON schema (either, or
        both in any mix). A zoo name is a str: a path-like object names a file. A path is read as written, as
        ``open()`` reads it: ``~`` is not expanded (``os.path.expanduser()`` it), and where one not found begins
        with ``~`` that names a file once expanded, the error suggests that file.
    skip_unknown : bool
        ONNX only: leave out, with a warning, convolutions whose shapes stay unknown after shape inference or
        are impossible (a negative size that an earlier node gives), empty ones (a zero in a weight's or input's
        dims), those whose operands are of a type the operator refuses
        (an integer weight; a float16 weight beside a float input), or those that cannot be expressed (see
        ``asymmetric_pads``), instead of raising.
    asymmetric_pads : {"widen", "error"}
        ONNX only: how to treat asymmetric padding, which cuDNN cannot take. ``"widen"`` models the convolution
        onnxruntime's CUDA provider runs (see :mod:`wsarena.models._onnx`); ``"error"`` treats such nodes like
        unknown shapes.
    input_shapes : mapping or sequence, optional
        ONNX only: fix graph input shapes before shape inference, ``{name: (N, C, H, W)}`` or one shape for a
        model with a single input; for models with symbolic spatial sizes.

    Returns
    -------
    list of ConvLayer
        A new list; the caller may change it. For an ONNX model it is a list whose ``skipped`` holds the
        ``(name, why)`` of each convolution ``skip_unknown`` left out; :func:`wsarena.plan` reports them.

    Raises
    ------
    ModelError
        One line naming the problem (see the module docstring).
    ValueError
        ``asymmetric_pads`` other than ``"widen"`` or ``"error"``, whatever the source (a zoo name or a layer
        list too, though only an ONNX model reads it).
    TypeError
        ``skip_unknown`` other than ``True`` or ``False``, whatever the source, as ``asymmetric_pads``.
    """
    check_asymmetric_pads(asymmetric_pads)  # an option of ONNX models, checked for any, as a typo would be missed
    check_skip_unknown(skip_unknown)  # so is this one
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        ext = os.path.splitext(text)[1].lower()
        layers = zoo_model(text) if isinstance(source, str) else None
        if layers is None and ext not in (".onnx", ".json"):  # check_model_named(), the zoo asked once, above
            _refuse_unnamed(source)
        # after the name's own error, the user's real problem: "input_shapes applies to .onnx models only, not
        # 'resnt50'" lost the name's typo and its hint
        if input_shapes is not None and ext != ".onnx":
            # input_shapes alone, as for a layer list below: the command refuses its --input-shape before this
            raise ValueError(f"input_shapes applies to .onnx models only, not {short_path(text)}")
        if layers is not None:
            return layers
        if ext == ".onnx":
            return load_onnx(
                text, skip_unknown=skip_unknown, asymmetric_pads=asymmetric_pads, input_shapes=input_shapes
            )
        return load_json(text)
    if input_shapes is not None:
        raise ValueError("input_shapes applies to .onnx models only, not to a layer list")
    if is_sequence(source):  # not binary data (a memoryview's entries, ints, were each refused as no layer)
        if not source:
            raise ModelError("the layer list is empty")
        # Layers and layer dicts in any mix (a layer made by hand added to those read from dicts): a layer as it is
        entries: Sequence[Any] = source  # from_dict names an entry that is neither
        try:
            return [layer if isinstance(layer, ConvLayer) else ConvLayer.from_dict(layer, where=f"layers[{i}]")
                    for i, layer in enumerate(entries)]
        except ModelError as exc:
            raise ModelError(f"layer list: {exc}") from None
    raise TypeError(f"source must be a zoo name, a path or a list of layers, not {type(source).__name__}")
