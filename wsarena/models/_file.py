"""Reading a model file: only a regular file is read, as :func:`read_model_file` says."""

from __future__ import annotations

from .._files import NotRegularFile, read_regular_file
from .._sizes import short_path
from ._layer import ModelError

__all__ = ["read_model_file"]


def read_model_file(path: str) -> bytes:
    """The bytes of the model file ``path`` (a link is followed), which must be a regular file: a FIFO would be
    waited on until a writer came, for good where none comes, and a character device (``/dev/zero``) has no end.
    :func:`wsarena._files.read_regular_file` reads it.

    Raises
    ------
    ModelError
        Naming the path and what it is where it is no regular file, or why it cannot be read.
    """
    where = short_path(path)
    try:
        return read_regular_file(path)[0]
    except NotRegularFile as exc:
        raise ModelError(f"{where} is {exc.kind}, not a regular file: a model is read from a .onnx or .json "
                         "file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ModelError(f"cannot read {where}: {why}") from None
