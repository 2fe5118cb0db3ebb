"""Tensor, filter and convolution descriptors: owned cuDNN handles.

These calls need libcudnn but no GPU. Each descriptor object owns one cuDNN descriptor and destroys it exactly
once: :meth:`~_Descriptor.close` (idempotent), ``with``, or, as a safety net, when the object is garbage
collected (a ``weakref.finalize`` that warns instead of raising and does nothing at interpreter shutdown).

Shapes are in cuDNN's logical order whatever the memory layout: tensors ``(N, C, *spatial)``, filters
``(K, C / groups, *kernel)``; the layout of a tensor is in its strides, that of a filter in its
:class:`~wsarena.cudnn.TensorFormat`.

cuDNN's Nd descriptors need at least 4 dimensions, so a 1-D convolution is described as a 2-D one with a unit
height: a 3-dimensional shape ``(N, C, L)`` becomes ``(N, C, 1, L)``, a filter ``(K, C, k)`` becomes
``(K, C, 1, k)`` and one-entry padding/stride/dilation ``(p,)`` become ``(0, p)``, ``(1, s)``, ``(1, d)``.
The descriptors keep the shape they were given (``shape``) beside the one cuDNN sees (``cudnn_shape``), and
:meth:`ConvolutionDescriptor.output_shape` answers in the caller's number of dimensions.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Self

from .._sizes import short_repr
from ..errors import UnsupportedConvolutionError
from ._enums import ConvolutionMode, DataType, MathType, TensorFormat
from ._owned import Owned
from ._prototypes import call

__all__ = [
    "DATA_TYPES",
    "ConvolutionDescriptor",
    "FilterDescriptor",
    "TensorDescriptor",
    "data_type",
]

CUDNN_DIM_MAX = 8  # cudnn_graph.h: the most dimensions a tensor descriptor may have

# NumPy-style dtype names -> cuDNN data types, for callers that hold an array's dtype name (no NumPy here).
DATA_TYPES: dict[str, DataType] = {
    "float32": DataType.FLOAT,
    "float64": DataType.DOUBLE,
    "float16": DataType.HALF,
    "bfloat16": DataType.BFLOAT16,
    "int8": DataType.INT8,
    "uint8": DataType.UINT8,
    "int32": DataType.INT32,
    "int64": DataType.INT64,
    "bool": DataType.BYTE_BOOLEAN,  # one byte per element, as NumPy's; BOOLEAN is not byte-addressed
}


def data_type(value: DataType | int | str) -> DataType:
    """A :class:`DataType` from a member, its value, or a dtype name such as ``"float32"`` or ``"bfloat16"``."""
    if isinstance(value, str):
        try:
            return DATA_TYPES[value] if value in DATA_TYPES else DataType[value.upper()]
        except KeyError:
            raise ValueError(f"no cuDNN data type for {short_repr(value)}; known: {', '.join(DATA_TYPES)}") from None
    return DataType(value)


def _ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(int(v.__index__()) for v in values)
    except (AttributeError, TypeError):
        raise TypeError(f"{name} must be a sequence of ints, not {short_repr(values)}") from None


_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


def _c_ints(values: Sequence[int]) -> ctypes.Array:
    """A C ``int[]`` of ``values``; ctypes would silently keep only the low 32 bits of a larger value."""
    for v in values:
        if not _INT_MIN <= v <= _INT_MAX:
            raise UnsupportedConvolutionError(
                f"cuDNN descriptors hold 32-bit ints; {v} in {tuple(values)} does not fit"
            )
    return (ctypes.c_int * max(len(values), 1))(*values)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _destroy_quietly(destroy_name: str, handle: int, what: str) -> None:
    """Finalizer: destroy a descriptor the program forgot to close; warn, never raise (runs inside gc)."""
    try:
        call(destroy_name, handle)
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"wsarena.cudnn: destroying {what} failed: {exc}", ResourceWarning, stacklevel=1)


class _Descriptor(Owned):
    """Owns one cuDNN descriptor handle; subclasses say which Create/Destroy functions manage it."""

    __slots__ = ("__weakref__", "_finalizer", "_handle")
    _create: str = ""
    _destroy: str = ""

    def __init__(self) -> None:
        raw = ctypes.c_void_p()
        call(self._create, ctypes.byref(raw))
        self._handle: int = raw.value or 0
        self._finalizer = weakref.finalize(self, _destroy_quietly, self._destroy, self._handle, type(self).__name__)
        # At interpreter shutdown the library may already be half torn down; the OS reclaims host memory anyway.
        self._finalizer.atexit = False

    def _configure(self, configure: Callable[[], None]) -> None:
        """Run the Set* calls; on failure destroy the new handle at once, so no half-built descriptor lingers."""
        try:
            configure()
        except BaseException:
            if self._finalizer.detach() is not None:
                with contextlib.suppress(Exception):  # the Set* error is the one to report
                    call(self._destroy, self._handle)
            raise

    def close(self) -> None:
        """Destroy the cuDNN descriptor now; later calls do nothing.

        Raises
        ------
        CudnnError
            cuDNN refused to destroy it (the handle is forgotten either way).
        """
        if self._finalizer.detach() is not None:
            call(self._destroy, self._handle)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TensorDescriptor(_Descriptor):
    """``cudnnTensorDescriptor_t`` set by ``cudnnSetTensorNdDescriptor``.

    Parameters
    ----------
    dtype : DataType
        Element type.
    shape : sequence of int
        ``(N, C, *spatial)``, 3 to 8 dimensions (3 means a 1-D convolution's tensor; see the module docstring).
    strides : sequence of int, optional
        In elements, one per dimension; default C-contiguous (NCHW). Channels-last data has ``C``'s stride 1.
    """

    __slots__ = ("cudnn_shape", "cudnn_strides", "dtype", "shape", "strides")
    _create = "cudnnCreateTensorDescriptor"
    _destroy = "cudnnDestroyTensorDescriptor"

    def __init__(self, dtype: DataType, shape: Sequence[int], strides: Sequence[int] | None = None) -> None:
        self.dtype = data_type(dtype)
        self.shape = _ints("shape", shape)
        self.strides = _contiguous_strides(self.shape) if strides is None else _ints("strides", strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(f"strides {self.strides} must have one entry per dimension of shape {self.shape}")
        self.cudnn_shape, self.cudnn_strides = self.shape, self.strides
        if len(self.shape) == 3:
            n, c, length = self.shape
            sn, sc, sl = self.strides
            self.cudnn_shape = (n, c, 1, length)
            self.cudnn_strides = (sn, sc, sl * max(length, 1), sl)
        super().__init__()
        dims, strides_c = self.cudnn_shape, self.cudnn_strides
        self._configure(
            lambda: call(
                "cudnnSetTensorNdDescriptor", self._handle, self.dtype, len(dims), _c_ints(dims), _c_ints(strides_c),
                context=f"tensor {self.dtype.name} shape {self.shape} strides {self.strides}",
            )
        )

    def query(self) -> tuple[DataType, tuple[int, ...], tuple[int, ...]]:
        """Read back ``(dtype, cudnn_shape, cudnn_strides)`` with ``cudnnGetTensorNdDescriptor``."""
        dtype, nb = ctypes.c_int(), ctypes.c_int()
        dims, strides = (ctypes.c_int * CUDNN_DIM_MAX)(), (ctypes.c_int * CUDNN_DIM_MAX)()
        call("cudnnGetTensorNdDescriptor", self, CUDNN_DIM_MAX, ctypes.byref(dtype), ctypes.byref(nb), dims, strides)
        return DataType(dtype.value), tuple(dims[: nb.value]), tuple(strides[: nb.value])

    @property
    def size_in_bytes(self) -> int:
        """Bytes the tensor spans in memory (``cudnnGetTensorSizeInBytes``)."""
        size = ctypes.c_size_t()
        call("cudnnGetTensorSizeInBytes", self, ctypes.byref(size))
        return size.value

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<TensorDescriptor {self.dtype.name} shape={self.shape} strides={self.strides}{state}>"


class FilterDescriptor(_Descriptor):
    """``cudnnFilterDescriptor_t`` set by ``cudnnSetFilterNdDescriptor``.

    Parameters
    ----------
    dtype : DataType
        Element type.
    format : TensorFormat
        ``NCHW`` (``K, C, *kernel`` in memory) or ``NHWC`` (``K, *kernel, C`` in memory).
    shape : sequence of int
        ``(K, C / groups, *kernel)`` in this logical order for either format; 3 to 8 dimensions.
    """

    __slots__ = ("cudnn_shape", "dtype", "format", "shape")
    _create = "cudnnCreateFilterDescriptor"
    _destroy = "cudnnDestroyFilterDescriptor"

    def __init__(self, dtype: DataType, format: TensorFormat, shape: Sequence[int]) -> None:
        self.dtype = data_type(dtype)
        self.format = TensorFormat(format)
        self.shape = _ints("shape", shape)
        self.cudnn_shape = self.shape
        if len(self.shape) == 3:
            k, c, length = self.shape
            self.cudnn_shape = (k, c, 1, length)
        super().__init__()
        dims = self.cudnn_shape
        self._configure(
            lambda: call(
                "cudnnSetFilterNdDescriptor", self._handle, self.dtype, self.format, len(dims), _c_ints(dims),
                context=f"filter {self.dtype.name} {self.format.name} shape {self.shape}",
            )
        )

    def query(self) -> tuple[DataType, TensorFormat, tuple[int, ...]]:
        """Read back ``(dtype, format, cudnn_shape)`` with ``cudnnGetFilterNdDescriptor``."""
        dtype, fmt, nb = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        dims = (ctypes.c_int * CUDNN_DIM_MAX)()
        call(
            "cudnnGetFilterNdDescriptor", self, CUDNN_DIM_MAX, ctypes.byref(dtype), ctypes.byref(fmt),
            ctypes.byref(nb), dims,
        )
        return DataType(dtype.value), TensorFormat(fmt.value), tuple(dims[: nb.value])

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<FilterDescriptor {self.dtype.name} {self.format.name} shape={self.shape}{state}>"


class ConvolutionDescriptor(_Descriptor):
    """``cudnnConvolutionDescriptor_t``: padding, stride, dilation, groups, compute type and math type.

    Parameters
    ----------
    padding, stride, dilation : sequence of int
        One entry per spatial dimension (1 to 6 of them); padding is symmetric.
    groups : int
        Group count (``cudnnSetConvolutionGroupCount``).
    compute_type : DataType
        Accumulation type: ``FLOAT`` for float, half and bfloat16 data (``HALF`` is allowed for half data),
        ``DOUBLE`` for double data.
    math_type : MathType
        Whether tensor cores may be used (``cudnnSetConvolutionMathType``).
    mode : ConvolutionMode
        ``CROSS_CORRELATION`` (default; what frameworks call convolution) or ``CONVOLUTION``.
    """

    __slots__ = ("compute_type", "dilation", "groups", "math_type", "mode", "padding", "spatial_dims", "stride")
    _create = "cudnnCreateConvolutionDescriptor"
    _destroy = "cudnnDestroyConvolutionDescriptor"

    def __init__(
        self,
        padding: Sequence[int],
        stride: Sequence[int],
        dilation: Sequence[int],
        groups: int = 1,
        compute_type: DataType = DataType.FLOAT,
        math_type: MathType = MathType.DEFAULT_MATH,
        mode: ConvolutionMode = ConvolutionMode.CROSS_CORRELATION,
    ) -> None:
        self.padding = _ints("padding", padding)
        self.stride = _ints("stride", stride)
        self.dilation = _ints("dilation", dilation)
        if not len(self.padding) == len(self.stride) == len(self.dilation):
            raise ValueError(
                f"padding {self.padding}, stride {self.stride} and dilation {self.dilation} must have the same length"
            )
        self.spatial_dims = len(self.padding)
        self.groups = _ints("groups", [groups])[0]
        self.compute_type = data_type(compute_type)
        self.math_type = MathType(math_type)
        self.mode = ConvolutionMode(mode)
        pad, strd, dil = self.padding, self.stride, self.dilation
        if self.spatial_dims == 1:
            pad, strd, dil = (0, *pad), (1, *strd), (1, *dil)
        super().__init__()
        context = (
            f"convolution padding {self.padding} stride {self.stride} dilation {self.dilation} "
            f"groups {self.groups} compute {self.compute_type.name} math {self.math_type.name}"
        )

        def configure() -> None:
            call(
                "cudnnSetConvolutionNdDescriptor", self._handle, len(pad), _c_ints(pad), _c_ints(strd), _c_ints(dil),
                self.mode, self.compute_type, context=context,
            )
            call("cudnnSetConvolutionGroupCount", self._handle, self.groups, context=context)
            call("cudnnSetConvolutionMathType", self._handle, self.math_type, context=context)

        self._configure(configure)

    def query(self) -> dict[str, Any]:
        """Read everything back from cuDNN (``cudnnGetConvolutionNdDescriptor``, group count, math type).

        Returns a dict with ``padding``, ``stride``, ``dilation`` (as cuDNN holds them, 1-D promoted to 2-D),
        ``mode``, ``compute_type``, ``groups`` and ``math_type``.
        """
        n = ctypes.c_int()
        pad, strd, dil = ((ctypes.c_int * CUDNN_DIM_MAX)() for _ in range(3))
        mode, compute, groups, math = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        call(
            "cudnnGetConvolutionNdDescriptor", self, CUDNN_DIM_MAX - 2, ctypes.byref(n), pad, strd, dil,
            ctypes.byref(mode), ctypes.byref(compute),
        )
        call("cudnnGetConvolutionGroupCount", self, ctypes.byref(groups))
        call("cudnnGetConvolutionMathType", self, ctypes.byref(math))
        return {
            "padding": tuple(pad[: n.value]),
            "stride": tuple(strd[: n.value]),
            "dilation": tuple(dil[: n.value]),
            "mode": ConvolutionMode(mode.value),
            "compute_type": DataType(compute.value),
            "groups": groups.value,
            "math_type": MathType(math.value),
        }

    def output_shape(self, x_desc: TensorDescriptor, w_desc: FilterDescriptor) -> tuple[int, ...]:
        """Shape of the forward output for input ``x_desc`` and filter ``w_desc``.

        Calls ``cudnnGetConvolutionNdForwardOutputDim``; the result has as many dimensions as ``x_desc.shape``
        (the unit height of a 1-D convolution is dropped again).
        """
        nb = len(x_desc.cudnn_shape)
        dims = (ctypes.c_int * nb)()
        call(
            "cudnnGetConvolutionNdForwardOutputDim", self, x_desc, w_desc, nb, dims,
            context=f"input {x_desc.shape}, filter {w_desc.shape}, {self!r}",
        )
        out = tuple(dims)
        if len(x_desc.shape) == 3 and len(out) == 4:
            out = (out[0], out[1], out[3])
        return out

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return (
            f"<ConvolutionDescriptor padding={self.padding} stride={self.stride} dilation={self.dilation} "
            f"groups={self.groups} compute={self.compute_type.name} math={self.math_type.name}{state}>"
        )
