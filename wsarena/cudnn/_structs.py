"""The three ``cudnnConvolution*AlgoPerf_t`` structures, and the frozen :class:`AlgoPerf` users see instead.

The ctypes layouts mirror ``cudnn_cnn.h`` field for field, ``reserved`` included; a test compiles the header and
compares ``sizeof``/``offsetof`` of every field.
"""

from __future__ import annotations

import ctypes
import dataclasses
from enum import IntEnum
from typing import Any, TypeVar

from ._enums import ConvolutionBwdDataAlgo, ConvolutionBwdFilterAlgo, ConvolutionFwdAlgo, Determinism, MathType, Status

__all__ = [
    "AlgoPerf",
    "ConvolutionBwdDataAlgoPerfStruct",
    "ConvolutionBwdFilterAlgoPerfStruct",
    "ConvolutionFwdAlgoPerfStruct",
]

# Every field after ``algo`` is common to the three structures.
_COMMON_FIELDS: list[tuple[str, Any]] = [
    ("status", ctypes.c_int),  # cudnnStatus_t
    ("time", ctypes.c_float),  # milliseconds; -1 or garbage for heuristic results
    ("memory", ctypes.c_size_t),  # workspace bytes
    ("determinism", ctypes.c_int),  # cudnnDeterminism_t
    ("mathType", ctypes.c_int),  # cudnnMathType_t
    ("reserved", ctypes.c_int * 3),
]


class ConvolutionFwdAlgoPerfStruct(ctypes.Structure):
    """C: ``cudnnConvolutionFwdAlgoPerf_t`` (``struct cudnnConvolutionFwdAlgoPerfStruct``)."""

    _fields_ = [("algo", ctypes.c_int), *_COMMON_FIELDS]  # cudnnConvolutionFwdAlgo_t


class ConvolutionBwdDataAlgoPerfStruct(ctypes.Structure):
    """C: ``cudnnConvolutionBwdDataAlgoPerf_t`` (``struct cudnnConvolutionBwdDataAlgoPerfStruct``)."""

    _fields_ = [("algo", ctypes.c_int), *_COMMON_FIELDS]  # cudnnConvolutionBwdDataAlgo_t


class ConvolutionBwdFilterAlgoPerfStruct(ctypes.Structure):
    """C: ``cudnnConvolutionBwdFilterAlgoPerf_t`` (``struct cudnnConvolutionBwdFilterAlgoPerfStruct``)."""

    _fields_ = [("algo", ctypes.c_int), *_COMMON_FIELDS]  # cudnnConvolutionBwdFilterAlgo_t


_E = TypeVar("_E", bound=IntEnum)


def _member(enum: type[_E], value: int) -> _E | int:
    # A newer cuDNN may report a value this enum does not know yet; keep the int rather than fail.
    try:
        return enum(value)
    except ValueError:
        return int(value)


@dataclasses.dataclass(frozen=True)
class AlgoPerf:
    """One algorithm as cuDNN ranks it (a heuristic guess or a timed trial).

    Attributes
    ----------
    algo : ConvolutionFwdAlgo, ConvolutionBwdDataAlgo or ConvolutionBwdFilterAlgo
        The algorithm, a member of the pass's enum.
    status : Status
        ``Status.SUCCESS`` when the algorithm can run this convolution; anything else means it cannot.
    time_ms : float
        Measured time in milliseconds (timed searches only; heuristic results carry no meaningful time).
    memory : int
        Workspace bytes the algorithm needs.
    determinism : Determinism
        Whether its results are bitwise reproducible.
    math_type : MathType
        The math type it uses (tensor cores or not).
    """

    algo: IntEnum | int
    status: Status | int
    time_ms: float
    memory: int
    determinism: Determinism | int
    math_type: MathType | int

    @property
    def ok(self) -> bool:
        """``True`` when :attr:`status` is ``SUCCESS``, i.e. the algorithm can run."""
        return self.status == Status.SUCCESS

    @classmethod
    def from_struct(
        cls,
        struct: ctypes.Structure,  # one of the three perf structs: the fields read are common to them
    ) -> AlgoPerf:
        """Copy a ctypes perf structure into an :class:`AlgoPerf` (its algo enum follows the structure type)."""
        algo_enum = _ALGO_ENUM_OF_STRUCT[type(struct)]
        return cls(
            algo=_member(algo_enum, struct.algo),
            status=_member(Status, struct.status),
            time_ms=float(struct.time),
            memory=int(struct.memory),
            determinism=_member(Determinism, struct.determinism),
            math_type=_member(MathType, struct.mathType),
        )


_ALGO_ENUM_OF_STRUCT: dict[type[ctypes.Structure], type[IntEnum]] = {
    ConvolutionFwdAlgoPerfStruct: ConvolutionFwdAlgo,
    ConvolutionBwdDataAlgoPerfStruct: ConvolutionBwdDataAlgo,
    ConvolutionBwdFilterAlgoPerfStruct: ConvolutionBwdFilterAlgo,
}
