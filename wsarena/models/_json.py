"""Layer lists as JSON: the schema is documented in :mod:`wsarena.models`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .._sizes import is_choice, short_json, short_path, short_repr
from ._file import read_model_file
from ._layer import ConvLayer, ModelError

__all__ = ["layers_from_json", "layers_to_json", "load_json"]


def layers_to_json(layers: Iterable[ConvLayer]) -> dict[str, Any]:
    """The JSON object ``{"layers": [...]}`` for a layer list (``json.dumps`` it to write a file)."""
    return {"layers": [layer.to_dict() for layer in layers]}


def layers_from_json(data: Any, *, source: str = "JSON") -> list[ConvLayer]:
    """Layers from already-parsed JSON: ``{"layers": [...]}`` or a bare list.

    An object's ``"layout": "NHWC"`` (what ``wsarena report --layout NHWC --format json`` writes) says its
    shapes are channels last; they are read back as the schema's channels-first shapes. Other keys are ignored.

    Raises
    ------
    ModelError
        Naming ``source``, the entry (``layers[i]``) and the problem.
    """
    layout, what = "NCHW", 'a list of layers or {"layers": [...]}'
    if isinstance(data, Mapping):
        if "layers" not in data:
            # the key in JSON's quotes, as the list's error says it ('expected "layers" to be ...'), and the keys found
            # too, sorted; a mapping given in Python may hold keys that are no str, which JSON has none of (1 and
            # "a", which do not compare either): its keys in Python's words, sorted as text
            if all(type(key) is str for key in data):
                found = short_json(sorted(data))
            else:
                found = short_repr(sorted(data, key=str))
            raise ModelError(f'{source}: a JSON object needs a "layers" list (found keys: {found})')
        layout = data.get("layout", "NCHW")
        if not is_choice(layout, ("NCHW", "NHWC")):
            # in JSON's words, as the file says it, where it is what JSON gives (an array given in Python: Python's)
            raise ModelError(f'{source}: layout must be "NCHW" or "NHWC", not {short_json(layout)}')
        data, what = data["layers"], '"layers" to be a list of layers'
    if not isinstance(data, list):
        raise ModelError(f"{source}: expected {what}, not {_json_value(data)}")
    if not data:
        raise ModelError(f"{source}: the layer list is empty")
    layers = []
    try:
        for i, entry in enumerate(data):
            if not isinstance(entry, Mapping):  # said in JSON's words (null, an array), where from_dict says Python's
                raise ModelError(f"layers[{i}] must be an object with name, input_shape and weight_shape, not "
                                 f"{_json_value(entry)}")
            layers.append(ConvLayer.from_dict(_channels_first(entry) if layout == "NHWC" else entry,
                                              where=f"layers[{i}]"))
    except ModelError as exc:
        raise ModelError(f"{source}: {exc}") from None
    return layers


def _json_value(value: Any) -> str:
    """What ``value``, parsed JSON other than what was expected, is in JSON's words: ``null``, ``true``, ``a number
    (3)``, ``a string ("x")``, ``an object``, ``an array``, where its Python type's name (``NoneType``, ``int``) or
    value (``None``, ``True``) was said; a number the decoder takes beyond JSON's (``NaN``, ``-Infinity``) as the file
    writes it, not as Python does (``nan``, ``-inf``); a value that no JSON text gives (a tuple, from Python) by its
    type's name."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"a number ({json.dumps(value)})"
    if isinstance(value, (int, float)):
        return f"a number ({short_repr(value)})"
    if isinstance(value, str):
        return f"a string ({short_json(value)})"
    if isinstance(value, Mapping):
        return "an object"
    return "an array" if isinstance(value, list) else type(value).__name__


def _channels_first(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An entry of an NHWC report with its shapes permuted to the schema's ``[N, C, *S]`` and ``[K, Cg, *R]``.

    A shape that is not a list of at least three dimensions is left for :meth:`ConvLayer.from_dict` to reject with
    its usual message; an entry that is no object is refused before it comes here."""
    entry = dict(entry)
    for key in ("input_shape", "weight_shape"):
        shape = entry.get(key)
        if isinstance(shape, list) and len(shape) >= 3:
            entry[key] = [shape[0], shape[-1], *shape[1:-1]]
    return entry


def load_json(path: str | os.PathLike[str]) -> list[ConvLayer]:
    """Read a JSON layer list from ``path``."""
    path = os.fspath(path)
    try:
        text = read_model_file(path).decode("utf-8-sig")  # a byte order mark first, as Windows editors write it
    except UnicodeDecodeError:
        raise ModelError(f"{short_path(path)} is not a JSON text file (not UTF-8)") from None
    # Lines end as reading in text mode ends them, so that an error's line and column count a lone \r (an old Mac's
    # line end) as one, as the decoder counts only \n; a line end in JSON is whitespace, and stays so
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ModelError(f"{short_path(path)} is not valid JSON: {exc.msg} at {where}") from None
    except RecursionError:  # the decoder recurses per nesting level
        raise ModelError(f"{short_path(path)} is nested too deeply to be a JSON layer list") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits())
        raise ModelError(f"{short_path(path)} is not a JSON layer list: {exc}".split("; use sys.")[0]) from None
    return layers_from_json(data, source=short_path(path))
