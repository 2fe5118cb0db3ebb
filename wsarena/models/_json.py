"""Layer lists as JSON: the schema is documented in :mod:`wsarena.models`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ._layer import ConvLayer, ModelError

__all__ = ["layers_from_json", "layers_to_json", "load_json"]


def layers_to_json(layers: Iterable[ConvLayer]) -> dict[str, Any]:
    """The JSON object ``{"layers": [...]}`` for a layer list (``json.dumps`` it to write a file)."""
    return {"layers": [layer.to_dict() for layer in layers]}


def layers_from_json(data: Any, *, source: str = "JSON") -> list[ConvLayer]:
    """Layers from already-parsed JSON: ``{"layers": [...]}`` (other keys ignored) or a bare list.

    Raises
    ------
    ModelError
        Naming ``source``, the entry (``layers[i]``) and the problem.
    """
    if isinstance(data, Mapping):
        if "layers" not in data:
            raise ModelError(f"{source}: a JSON object needs a 'layers' list (found keys: {sorted(data)[:8]})")
        data = data["layers"]
    if not isinstance(data, list):
        raise ModelError(f"{source}: expected a list of layers or {{\"layers\": [...]}}, not {type(data).__name__}")
    if not data:
        raise ModelError(f"{source}: the layer list is empty")
    try:
        return [ConvLayer.from_dict(entry, where=f"layers[{i}]") for i, entry in enumerate(data)]
    except ModelError as exc:
        raise ModelError(f"{source}: {exc}") from None


def load_json(path: str | os.PathLike[str]) -> list[ConvLayer]:
    """Read a JSON layer list from ``path``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ModelError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ModelError(f"{path!r} is not a JSON text file (not UTF-8)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return layers_from_json(data, source=repr(path))
