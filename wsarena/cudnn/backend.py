"""Descriptors of cuDNN's backend (graph) API: one owned class whose attributes are set and read by type.

A backend descriptor is created empty (``cudnnBackendCreateDescriptor``), given attributes
(``cudnnBackendSetAttribute``), finalized (``cudnnBackendFinalize``), after which its attributes are read-only and
readable (``cudnnBackendGetAttribute``), and destroyed once (``cudnnBackendDestroyDescriptor``). Each attribute's
values have one :class:`~wsarena.cudnn.BackendAttributeType`, and that type decides the C type of the array:
``INT64`` -> ``int64_t``, ``FLOAT`` -> ``float``, ``BACKEND_DESCRIPTOR`` -> ``cudnnBackendDescriptor_t``, every
cuDNN enumeration -> ``int``, ``CHAR`` -> ``char`` (text), ... (:data:`ATTRIBUTE_CTYPES`).

Creating and setting need only libcudnn. Finalizing needs more: cuDNN then loads its engine sub-libraries, one of
which links the NVIDIA driver library ``libcuda.so.1``. Where that library is missing, every finalize fails with
``SUBLIBRARY_LOADING_FAILED`` (1008), and cuDNN remembers the failure for the life of the process
(docs/deviceless.md). No GPU is needed for descriptors, operation graphs, heuristics or execution plans built
against device properties; executing a plan needs a handle and a GPU.
"""

from __future__ import annotations

import ctypes
import operator
import weakref
from enum import IntEnum
from typing import Any, Self

from .._sizes import short_repr
from ._enums import (
    BackendAttributeName,
    BackendAttributeType,
    BackendBehaviorNote,
    BackendDescriptorType,
    BackendHeurMode,
    BackendKnobType,
    BackendNumericalNote,
    ConvolutionMode,
    DataType,
)
from ._library import load_library
from ._owned import Owned
from ._prototypes import available, call
from .descriptors import _destroy_quietly

__all__ = ["ATTRIBUTE_CTYPES", "BackendDescriptor", "OPTIONAL_ATTRIBUTES", "execute", "has_attribute",
           "plan_workspace_size"]

T = BackendAttributeType

# Attribute type -> the ctypes type of one element. Every type not named here is a cuDNN enumeration (C int),
# except FRACTION (a struct wsarena never sets), which is refused.
ATTRIBUTE_CTYPES: dict[BackendAttributeType, Any] = {
    T.HANDLE: ctypes.c_void_p,
    T.BOOLEAN: ctypes.c_bool,
    T.INT64: ctypes.c_int64,
    T.FLOAT: ctypes.c_float,
    T.DOUBLE: ctypes.c_double,
    T.VOID_PTR: ctypes.c_void_p,
    T.BACKEND_DESCRIPTOR: ctypes.c_void_p,
    T.INT32: ctypes.c_int32,
    T.CHAR: ctypes.c_char,
}
_UNSUPPORTED = frozenset({T.FRACTION})

_A = BackendAttributeName
# Attributes wsarena uses that an older cuDNN 9 lacks (name -> the first version that has it, the headers' "@since";
# tests/test_cudnn_backend_api.py checks both ways), as _prototypes.OPTIONAL lists functions: such a cuDNN refuses
# them, so their users ask has_attribute() first.
OPTIONAL_ATTRIBUTES: dict[BackendAttributeName, int] = {
    _A.ENGINECFG_WORKSPACE_SIZE: 90200,
    _A.ENGINEHEUR_DEVICEPROP: 90800,
    _A.ENGINE_DEVICEPROP: 90800,
    _A.EXECUTION_PLAN_DEVICEPROP: 90800,
    _A.DEVICEPROP_DEVICE_ID: 90800,
    _A.DEVICEPROP_HANDLE: 90800,
    _A.DEVICEPROP_JSON_REPRESENTATION: 90800,
}


def has_attribute(name: BackendAttributeName | int) -> bool:
    """Whether the loaded cuDNN has attribute ``name``: all but those of :data:`OPTIONAL_ATTRIBUTES` newer than it."""
    since = OPTIONAL_ATTRIBUTES.get(BackendAttributeName(name))
    return since is None or load_library().version >= since


# Enumeration types read back as members of their IntEnum (a value this wsarena does not know stays an int).
_ENUM_TYPES: dict[BackendAttributeType, type[IntEnum]] = {
    T.DATA_TYPE: DataType,
    T.CONVOLUTION_MODE: ConvolutionMode,
    T.HEUR_MODE: BackendHeurMode,
    T.KNOB_TYPE: BackendKnobType,
    T.NUMERICAL_NOTE: BackendNumericalNote,
    T.BEHAVIOR_NOTE: BackendBehaviorNote,
    T.ATTRIB_NAME: BackendAttributeName,
}


def _ctype(attr_type: BackendAttributeType) -> Any:
    if attr_type in _UNSUPPORTED:
        raise TypeError(f"attributes of type {attr_type.name} are not supported by wsarena.cudnn.backend")
    return ATTRIBUTE_CTYPES.get(attr_type, ctypes.c_int)


def _enum_value(enum: type[IntEnum], value: int) -> int:
    try:
        return enum(value)
    except ValueError:
        return value  # a newer cuDNN's value


class BackendDescriptor(Owned):
    """An owned ``cudnnBackendDescriptor_t`` of one :class:`~wsarena.cudnn.BackendDescriptorType`.

    Descriptors given as attribute values (and the descriptor a :meth:`get_descriptors` result came from) are kept
    alive as long as this one. Usable as a context manager; :meth:`close` is idempotent; a forgotten descriptor is
    destroyed when collected (a finalizer that warns instead of raising, and does nothing at interpreter exit).

    Parameters
    ----------
    kind : BackendDescriptorType
        What to create (``cudnnBackendCreateDescriptor``).
    """

    __slots__ = ("__weakref__", "_finalizer", "_handle", "_keep", "finalized", "kind")

    def __init__(self, kind: BackendDescriptorType | int) -> None:
        self.kind = BackendDescriptorType(kind)
        raw = ctypes.c_void_p()
        call("cudnnBackendCreateDescriptor", self.kind, ctypes.byref(raw), context=self.kind.name)
        self._handle: int = raw.value or 0
        self._keep: list[Any] = []
        self.finalized = False
        self._finalizer = weakref.finalize(
            self, _destroy_quietly, "cudnnBackendDestroyDescriptor", self._handle, self.kind.name
        )
        self._finalizer.atexit = False  # at exit the library may be half torn down; the OS reclaims host memory

    def _context(self, name: BackendAttributeName | int) -> str:
        return f"{self.kind.name}, attribute {_attr_name(name)}"

    def set(
        self, name: BackendAttributeName | int, attr_type: BackendAttributeType | int, values: Any
    ) -> Self:
        """Set attribute ``name`` to ``values`` (``cudnnBackendSetAttribute``); returns ``self``.

        ``values`` is one value or a sequence of them: ints, floats, bools, enum members, raw pointers (ints, 0 for
        NULL), :class:`BackendDescriptor` objects (for ``BACKEND_DESCRIPTOR``), a :class:`~wsarena.cudnn.Handle`
        (for ``HANDLE``), or ``str``/``bytes`` (for ``CHAR``; a terminating NUL is added).

        Raises
        ------
        TypeError
            A value the attribute type cannot hold, naming the attribute.
        CudnnError
            cuDNN refused (a finalized descriptor, a wrong attribute type for the name, ...).
        """
        attr_type = BackendAttributeType(attr_type)
        array, count = self._array(name, attr_type, values)
        call(
            "cudnnBackendSetAttribute", self, int(name), attr_type, count, ctypes.cast(array, ctypes.c_void_p),
            context=lambda: self._context(name),
        )
        if attr_type in (T.BACKEND_DESCRIPTOR, T.HANDLE):
            self._keep.extend(v for v in (values if isinstance(values, (list, tuple)) else [values]))
        return self

    def _array(self, name: Any, attr_type: BackendAttributeType, values: Any) -> tuple[Any, int]:
        ctype = _ctype(attr_type)
        if attr_type == T.CHAR:
            if isinstance(values, str):
                values = values.encode()
            if not isinstance(values, bytes):
                raise TypeError(f"{self._context(name)}: CHAR values are str or bytes, not {type(values).__name__}")
            return ctypes.create_string_buffer(values), len(values) + 1
        items = list(values) if isinstance(values, (list, tuple)) else [values]
        try:
            converted = [_c_value(attr_type, v) for v in items]
            return (ctype * max(len(items), 1))(*converted), len(items)
        except (TypeError, ValueError, OverflowError) as exc:
            kind = TypeError if isinstance(exc, TypeError) else ValueError
            shown = short_repr(values)
            raise kind(f"{self._context(name)}: {shown} cannot be {attr_type.name} values ({exc})") from None

    def finalize(self) -> Self:
        """Check the attributes and make the descriptor read-only (``cudnnBackendFinalize``); returns ``self``."""
        call("cudnnBackendFinalize", self, context=self.kind.name)
        self.finalized = True
        return self

    def count(self, name: BackendAttributeName | int, attr_type: BackendAttributeType | int) -> int:
        """How many elements attribute ``name`` holds (a ``cudnnBackendGetAttribute`` asking for none)."""
        n = ctypes.c_int64()
        call(
            "cudnnBackendGetAttribute", self, int(name), BackendAttributeType(attr_type), 0, ctypes.byref(n), None,
            context=lambda: self._context(name),
        )
        return n.value

    def get(
        self, name: BackendAttributeName | int, attr_type: BackendAttributeType | int, count: int | None = None
    ) -> list[Any]:
        """The values of attribute ``name`` (at most ``count``; by default all of them).

        Enumerations come back as members of their ``IntEnum``, ``BOOLEAN`` as bools, pointers as ints (0 for NULL).
        Use :meth:`get_text` for ``CHAR`` and :meth:`get_descriptors` for ``BACKEND_DESCRIPTOR``.
        """
        attr_type = BackendAttributeType(attr_type)
        if attr_type in (T.CHAR, T.BACKEND_DESCRIPTOR):
            raise TypeError(f"{self._context(name)}: read {attr_type.name} with get_text() or get_descriptors()")
        if count is None:
            count = self.count(name, attr_type)
        array = (_ctype(attr_type) * max(count, 1))()
        n = ctypes.c_int64()
        call(
            "cudnnBackendGetAttribute", self, int(name), attr_type, count, ctypes.byref(n),
            ctypes.cast(array, ctypes.c_void_p), context=lambda: self._context(name),
        )
        values = list(array[: min(n.value, count)])
        enum = _ENUM_TYPES.get(attr_type)
        if enum is not None:
            return [_enum_value(enum, v) for v in values]
        if attr_type in (T.VOID_PTR, T.HANDLE):
            return [v or 0 for v in values]
        return values

    def get_one(self, name: BackendAttributeName | int, attr_type: BackendAttributeType | int) -> Any:
        """The single value of attribute ``name``."""
        values = self.get(name, attr_type, 1)
        if not values:
            raise ValueError(f"{self._context(name)} holds no value")
        return values[0]

    def get_text(self, name: BackendAttributeName | int) -> str:
        """A ``CHAR`` attribute (a JSON representation) as text."""
        size = self.count(name, T.CHAR)
        buffer = ctypes.create_string_buffer(max(size, 1))
        n = ctypes.c_int64()
        call(
            "cudnnBackendGetAttribute", self, int(name), T.CHAR, size, ctypes.byref(n),
            ctypes.cast(buffer, ctypes.c_void_p), context=lambda: self._context(name),
        )
        return buffer.value.decode()

    def get_descriptors(
        self, name: BackendAttributeName | int, kind: BackendDescriptorType | int, count: int | None = None
    ) -> list[BackendDescriptor]:
        """The descriptors attribute ``name`` holds, as new owned descriptors of ``kind`` that cuDNN fills in.

        ``count`` bounds how many are asked for; by default cuDNN is asked how many there are, which it answers
        only for some attributes holding a list (``ENGINEHEUR_RESULTS``; for ``ENGINECFG_KNOB_CHOICES`` cuDNN 9.28
        answers 0): give a bound instead, ``count=1`` for an attribute that holds a single descriptor.
        """
        if count is None:
            count = self.count(name, T.BACKEND_DESCRIPTOR)
        made = [BackendDescriptor(kind) for _ in range(count)]
        array = (ctypes.c_void_p * max(count, 1))(*(d.handle for d in made))
        n = ctypes.c_int64()
        try:
            call(
                "cudnnBackendGetAttribute", self, int(name), T.BACKEND_DESCRIPTOR, count, ctypes.byref(n),
                ctypes.cast(array, ctypes.c_void_p), context=lambda: self._context(name),
            )
        except BaseException:
            for d in made:
                d.close()
            raise
        for d in made[n.value :]:
            d.close()
        got = made[: n.value]
        for d in got:
            d.finalized = True
            d._keep.append(self)
        return got

    def close(self) -> None:
        """Destroy the descriptor now (``cudnnBackendDestroyDescriptor``); later calls do nothing."""
        if self._finalizer.detach() is not None:
            self._keep.clear()
            call("cudnnBackendDestroyDescriptor", self._handle, context=self.kind.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("finalized" if self.finalized else "open")
        return f"<BackendDescriptor {self.kind.name} {state}>"


def _attr_name(name: Any) -> str:
    try:
        return BackendAttributeName(name).name
    except ValueError:
        return str(int(name))


def _c_value(attr_type: BackendAttributeType, value: Any) -> Any:
    """One Python value as what the attribute type's ctypes array takes."""
    if attr_type in (T.BACKEND_DESCRIPTOR, T.HANDLE):
        if isinstance(value, Owned):
            return value.handle
        if attr_type == T.BACKEND_DESCRIPTOR:
            raise TypeError(f"a BackendDescriptor, not {type(value).__name__}")
    if attr_type in (T.FLOAT, T.DOUBLE):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"a float, not {type(value).__name__}")
        return float(value)
    if attr_type == T.BOOLEAN:
        if not isinstance(value, bool):
            raise TypeError(f"True or False, not {short_repr(value)}")
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"an int, not {type(value).__name__}")
    enum = _ENUM_TYPES.get(attr_type)
    if enum is not None:
        # Checked here: cuDNN 9.28 aborts the process (an illegal instruction) on some out-of-range enumerators.
        return int(enum(value))
    number = operator.index(value)
    low, high = _int_range(_ctype(attr_type))
    if not low <= number <= high:  # ctypes would wrap it silently: (c_int64 * 1)(2**64 + 1) holds 1
        raise OverflowError(f"{number} is outside [{low}, {high}]")
    return number


def _int_range(ctype: Any) -> tuple[int, int]:
    """The values an integer (or pointer) ctypes type holds without wrapping."""
    bits = 8 * ctypes.sizeof(ctype)
    if ctype is ctypes.c_void_p:
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def execute(handle: Any, plan: BackendDescriptor, variant_pack: BackendDescriptor | int) -> None:
    """Enqueue ``plan`` on the handle's stream with the pointers of ``variant_pack`` (``cudnnBackendExecute``)."""
    call("cudnnBackendExecute", handle, plan, variant_pack, context=lambda: f"plan {plan!r}")


def plan_workspace_size(
    plan: BackendDescriptor, handle: Any = None, variant_pack: BackendDescriptor | None = None
) -> int:
    """Workspace bytes a finalized execution plan needs.

    With a handle and a variant pack, and a cuDNN (9.23+) that has it, ``cudnnGetExecutionPlanWorkspaceSize``;
    otherwise the plan's ``EXECUTION_PLAN_WORKSPACE_SIZE`` attribute, which needs neither.
    """
    if handle is not None and variant_pack is not None and available("cudnnGetExecutionPlanWorkspaceSize"):
        size = ctypes.c_size_t()
        call("cudnnGetExecutionPlanWorkspaceSize", handle, plan, variant_pack, ctypes.byref(size))
        return size.value
    return int(plan.get_one(BackendAttributeName.EXECUTION_PLAN_WORKSPACE_SIZE, T.INT64))
