"""DLPack exports read, checked and retyped between producer and importer.

NumPy and CuPy import DLPack capsules themselves; :class:`Export` stands between an operand and the importer, so
that the importer's own ``__dlpack__`` call (its stream, ``max_version`` and ``copy``) reaches the producer
unchanged, and the capsule the producer returns can be looked at before it is consumed:

- ``writable=True``: an export that is read-only is refused with :class:`ReadOnlyExport`. Read-only means the
  DLPack 1.0 ``DLPACK_FLAG_BITMASK_READ_ONLY`` flag, or a legacy (pre-1.0) capsule, which has no flags and so
  makes no promise that the memory may be written (NumPy imports those read-only too; CuPy would write them).
  JAX exports legacy capsules only: its arrays are immutable.
- ``retype=(old, new)``: a tensor of DLPack dtype ``old`` is relabelled ``new`` in place (both as
  :func:`dtype_word` gives them; the bits stay as they are), and
  :attr:`Export.retyped` says that it was. Neither NumPy nor CuPy imports ``bfloat16`` (DLPack's ``kDLBfloat``),
  so it travels as ``int16`` and is viewed as ``ml_dtypes.bfloat16`` on arrival; the way back is the reverse.

The structures mirror dlpack.h (DLPack 1.0).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["BFLOAT16", "INT16", "Export", "ReadOnlyExport", "dtype_word"]


class DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class DLPackVersion(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = (
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    )


# Where the fields read here lie: DLManagedTensor (legacy) starts with its DLTensor; a DLDataType is read and
# written as the one 32-bit word it is in memory.
_FLAGS = DLManagedTensorVersioned.flags.offset
_VERSIONED_TENSOR = DLManagedTensorVersioned.dl_tensor.offset
_DTYPE = DLTensor.dtype.offset
READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"


def dtype_word(code: int, bits: int, lanes: int) -> int:
    """A DLDataType as the 32-bit word it is in memory."""
    return int.from_bytes(bytes(DLDataType(code, bits, lanes)), sys.byteorder)


INT16 = dtype_word(0, 16, 1)  # kDLInt
BFLOAT16 = dtype_word(4, 16, 1)  # kDLBfloat

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = (ctypes.py_object,)
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)


class ReadOnlyExport(BufferError):
    """An export that may not be written, where writing it was asked for."""


class Export:
    """``obj`` as an importer sees it through DLPack, checked (``writable``) or retyped (``retype``) on the way."""

    __slots__ = ("obj", "retype", "retyped", "writable")

    def __init__(
        self, obj: Any, *, writable: bool = False, retype: tuple[int, int] | None = None
    ) -> None:
        self.obj = obj
        self.writable = writable
        self.retype = retype
        self.retyped = False

    def __dlpack_device__(self) -> Any:
        return self.obj.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        capsule = self.obj.__dlpack__(**kwargs)
        name = _get_name(capsule)
        if name == _VERSIONED:
            managed = _get_pointer(capsule, name)
            if ctypes.c_uint32.from_address(managed).value != 1:  # version.major: another layout may follow
                if self.writable:
                    raise ReadOnlyExport("its DLPack export is of a major version other than 1, whose flags "
                                         "wsarena cannot read")
                return capsule
            flags: int | None = ctypes.c_uint64.from_address(managed + _FLAGS).value
            tensor = managed + _VERSIONED_TENSOR
        elif name == _LEGACY:
            flags, tensor = None, _get_pointer(capsule, name)
        else:  # not a capsule this module knows: the importer says what it makes of it
            return capsule
        if self.writable and (flags is None or flags & READ_ONLY):
            why = "a legacy capsule, which promises no writes, as JAX's are" if flags is None else "flagged so"
            raise ReadOnlyExport(f"its DLPack export is read-only ({why})")
        if self.retype is not None:
            dtype = ctypes.c_uint32.from_address(tensor + _DTYPE)
            old, new = self.retype
            if dtype.value == old:
                dtype.value = new
                self.retyped = True
        return capsule
