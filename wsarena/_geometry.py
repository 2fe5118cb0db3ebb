"""The shape of one convolution, checked once, shared by every backend, the planner and the reports.

Layouts: ``"NCHW"`` means channels first, ``x`` is ``(N, C, *spatial)`` and ``w`` is ``(K, C/groups, *kernel)``;
``"NHWC"`` means channels last, ``x`` is ``(N, *spatial, C)`` and ``w`` is ``(K, *kernel, C/groups)``. The same two
names serve 1-D and 3-D convolutions. Padding is symmetric: ``padding[i]`` zeros on each side of dimension ``i``.

Sizes. Every dimension, stride, padding, dilation and group count, and every output dimension, is at most
``2**31 - 1``: cuDNN's descriptors hold 32-bit ints, and a geometry that only the CPU could run is not planned for
a GPU. Each operand (input, weight, output) must also fit in an array: at most ``sys.maxsize`` bytes. A geometry
beyond either limit is a ``ValueError`` naming the argument, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from ._pass import Pass
from ._sizes import INT32_MAX, as_int, is_choice, is_sequence, short_repr

__all__ = [
    "DTYPES", "INT32_MAX", "ITEMSIZES", "LAYOUTS", "ConvGeometry", "array_dtype_name", "byte_order_note",
    "conv_geometry", "conv_transpose_geometry", "describe_geometry", "dtype_name", "output_size",
    "transposed_output_size",
]

LAYOUTS = ("NCHW", "NHWC")
DTYPES = ("float32", "float16", "bfloat16", "float64")  # what some backend computes in
ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}  # bytes per element


def dtype_name(dtype: Any) -> str:
    """``dtype`` as one of :data:`DTYPES`' names: a name given as it is, or a NumPy or PyTorch dtype (``np.float32``,
    ``np.dtype("float16")``, ``torch.bfloat16``) by its name. A string must be the name itself: NumPy's own
    spellings (``"f4"``, and ``"float"``, which is float64) would read as a guess. A NumPy dtype in the other byte
    order (``np.dtype(">f4")`` on a little-endian machine) is none of them, as the ops refuse an array of it
    (:func:`array_dtype_name`). Only a str is compared with the names: another object's ``==`` may raise, or answer
    an array."""
    name: Any = None
    if isinstance(dtype, str):
        name = str.__str__(dtype)  # a str subclass (an enum's member) as the plain str it holds
    elif type(dtype).__module__ == "torch":
        name = str(dtype).removeprefix("torch.")
    elif dtype is not None:  # which NumPy would read as float64
        import numpy as np

        try:
            name = array_dtype_name(np.dtype(dtype))
        except Exception:  # noqa: BLE001 - no dtype NumPy knows (an object's own dtype attribute may raise anything)
            name = None
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(
            f"dtype must be one of {', '.join(DTYPES)}, or their NumPy or PyTorch dtype, not {short_repr(dtype)}"
            f"{byte_order_note(dtype)}"
        )
    return name


def array_dtype_name(dtype: Any) -> str:
    """The name an array's ``dtype`` goes by against :data:`DTYPES`: a NumPy dtype in the machine's byte order by its
    name (``float32``, ``bfloat16``), one in the other byte order as NumPy writes it (``>f4`` on a little-endian
    machine), which names none: cuDNN and the CPU backend compute in the machine's order, and NumPy's name
    (``float32``) would hide the order. Another object by its str."""
    import numpy as np

    if isinstance(dtype, np.dtype):
        return dtype.name if dtype.isnative else str(dtype)
    return str(dtype)


def byte_order_note(dtype: Any) -> str:
    """For an error that refuses ``dtype``: where it is one of :data:`DTYPES` in the other byte order, what it is and
    that no backend computes in it (" (float32 in the other byte order from this machine's, ...)"), else nothing."""
    import numpy as np

    if not isinstance(dtype, np.dtype) or dtype.isnative or dtype.name not in DTYPES:
        return ""  # a class (np.float32) is in the machine's order
    return f" ({dtype.name} in the other byte order from this machine's, which no backend computes in)"


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Output length of one spatial dimension (may be < 1 for an impossible geometry)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def transposed_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int,
                           output_padding: int) -> int:
    """Output length of one spatial dimension of a transposed convolution (may be < 1 for an impossible one)."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """A checked convolution geometry. Build it with :func:`conv_geometry`."""

    batch: int
    in_channels: int
    out_channels: int
    groups: int
    input_size: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    layout: str = "NCHW"
    dtype: str = "float32"

    # Every call hashes its geometry to find its algorithm; the generated __hash__ would rebuild the field tuple.
    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)  # str hashes differ between processes: an unpickled copy hashes afresh
        return state

    @property
    def nd(self) -> int:
        """Number of spatial dimensions (1, 2 or 3)."""
        return len(self.input_size)

    # Shapes are derived once per geometry (cached_property writes the instance dict, which the frozen dataclass
    # allows): every convolution call asks for them, and geometries are reused across calls.
    @functools.cached_property
    def output_size(self) -> tuple[int, ...]:
        return tuple(
            output_size(i, k, s, p, d)
            for i, k, s, p, d in zip(self.input_size, self.kernel_size, self.stride, self.padding, self.dilation)
        )

    def _shape(self, n: int, c: int, spatial: tuple[int, ...]) -> tuple[int, ...]:
        return (n, c, *spatial) if self.layout == "NCHW" else (n, *spatial, c)

    @functools.cached_property
    def input_shape(self) -> tuple[int, ...]:
        return self._shape(self.batch, self.in_channels, self.input_size)

    @functools.cached_property
    def weight_shape(self) -> tuple[int, ...]:
        return self._shape(self.out_channels, self.in_channels // self.groups, self.kernel_size)

    @functools.cached_property
    def output_shape(self) -> tuple[int, ...]:
        return self._shape(self.batch, self.out_channels, self.output_size)

    def operand_shapes(self, pass_: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Shapes of a pass's ``(a, b, out)``: fwd ``(x, w, y)``, bwd_data ``(dy, w, dx)``, bwd_filter
        ``(x, dy, dw)`` (see :class:`~wsarena._pass.Pass`)."""
        shapes = {"x": self.input_shape, "w": self.weight_shape, "y": self.output_shape}
        a, b, out = Pass(pass_).roles
        return shapes[a], shapes[b], shapes[out]

    @property
    def macs(self) -> int:
        """Multiply-accumulates of one forward pass (the same count for each backward pass)."""
        return (
            self.batch
            * self.out_channels
            * math.prod(self.output_size)
            * (self.in_channels // self.groups)
            * math.prod(self.kernel_size)
        )

    def with_batch(self, batch: int) -> ConvGeometry:
        geom = dataclasses.replace(self, batch=_bounded("batch", _positive_or_zero("batch", batch)))
        shapes = {"input_shape": geom.input_shape, "weight_shape": geom.weight_shape,
                  "the output shape": geom.output_shape}
        _check_sizes(shapes, geom.output_size, geom.padding, geom.dtype)
        return geom

    def with_dtype(self, dtype: Any) -> ConvGeometry:
        """This geometry in ``dtype``: a name of :data:`DTYPES`, or its NumPy or PyTorch dtype (:func:`dtype_name`)."""
        return dataclasses.replace(self, dtype=dtype_name(dtype))


def describe_geometry(geom: ConvGeometry) -> str:
    """The whole geometry in one line, for messages: two convolutions that differ only in stride read differently."""
    return (
        f"input {geom.input_shape} weight {geom.weight_shape} stride {geom.stride} padding {geom.padding} "
        f"dilation {geom.dilation} groups {geom.groups} {geom.dtype} {geom.layout}"
    )


def _int(name: str, value: Any, accepted: str = "an int") -> int:
    """``value`` as an ``int``; else a ``TypeError`` that says ``name`` must be ``accepted``, and what it was."""
    n = as_int(value)
    if n is None:  # e.g. a float, or a NumPy array (whose own message would not name the argument)
        raise TypeError(f"{name} must be {accepted}, not {short_repr(value)}")
    return n


def _ints(name: str, values: Any) -> tuple[int, ...]:
    """Each entry of the sequence ``values`` as an ``int``; else a ``TypeError`` that names the entry (``stride[1]``)
    and what it was, as one entry of the sequence is refused, not the sequence."""
    out = []
    for i, value in enumerate(values):
        n = as_int(value)
        if n is None:
            raise TypeError(f"{name}[{i}] must be an int, not {short_repr(value)}")
        out.append(n)
    return tuple(out)


def _positive_or_zero(name: str, value: Any) -> int:
    v = _int(name, value)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, not {short_repr(v)}")
    return v


def _shape(name: str, shape: Any, *, batch: bool) -> tuple[int, ...]:
    """``shape``'s dims as ints. A negative dim is a ``ValueError`` that says what that dim takes: an input's batch
    (its first dim, with ``batch``) may be 0, an empty batch; any other dim is 1 or more (a zero there is refused
    after, with the whole shape, as a channel, element or kernel dim missing)."""
    dims = _ints(name, shape)
    for i, d in enumerate(dims):
        if d < 0:
            least, what = (0, f"{name}[0], the batch,") if batch and i == 0 else (1, f"{name}[{i}]")
            raise ValueError(f"{what} must be >= {least}, not {short_repr(d)}")
    return dims


_Bounded = TypeVar("_Bounded", int, tuple[int, ...])


def _bounded(name: str, value: _Bounded, shown: Any = None) -> _Bounded:
    """``value`` (an int or a tuple of ints) when no entry is above :data:`INT32_MAX`; ``shown`` is what the
    message quotes (by default ``value``)."""
    largest = max(value if isinstance(value, tuple) else (value,), default=0)
    if largest > INT32_MAX:
        shown = value if shown is None else shown
        which = f"{name}={short_repr(shown)}" + ("" if shown == largest else f": {short_repr(largest)}")
        raise ValueError(f"{which} is above 2**31 - 1 = {INT32_MAX}, the largest value a cuDNN descriptor holds")
    return value


def _per_dim(name: str, value: Any, nd: int, *, minimum: int) -> tuple[int, ...]:
    if is_sequence(value):
        if len(value) != nd:
            raise ValueError(f"{name}={short_repr(value)} must have one entry per spatial dimension ({nd})")
        values = _ints(name, value)
    else:
        values = (_int(name, value, f"an int or a sequence of {nd} ints (one per spatial dimension)"),) * nd
    if any(v < minimum for v in values):
        raise ValueError(f"{name}={short_repr(value)} must be >= {minimum} in every dimension")
    return _bounded(name, values, value)


def _padding(
    value: Any, nd: int, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> tuple[int, ...]:
    if isinstance(value, str):
        if value == "valid":
            return (0,) * nd
        if value == "same":
            total = [d * (k - 1) for k, d in zip(kernel, dilation)]
            if any(s != 1 for s in stride):
                raise ValueError(f"padding='same' needs stride 1, not stride={stride}")
            if any(t % 2 for t in total):
                raise ValueError(
                    f"padding='same' with kernel {kernel} and dilation {dilation} needs asymmetric padding "
                    f"(total {tuple(total)}); pass explicit symmetric padding instead"
                )
            return tuple(t // 2 for t in total)
        raise ValueError(f"padding must be an int, a sequence, 'valid' or 'same', not {short_repr(value)}")
    if is_sequence(value):
        if len(value) != nd:
            raise ValueError(f"padding={short_repr(value)} must have one entry per spatial dimension ({nd})")
        out = []
        for i, entry in enumerate(value):
            if is_sequence(entry):
                if len(entry) != 2:
                    raise ValueError(f"padding={short_repr(value)}: each pair must be (before, after)")
                lo, hi = _ints(f"padding[{i}]", entry)
                if lo != hi:
                    raise ValueError(f"padding={short_repr(value)} is asymmetric; only symmetric padding is supported")
                out.append(lo)
            else:
                n = as_int(entry)
                if n is None:
                    raise TypeError(f"padding[{i}] must be an int or a (before, after) pair, not {short_repr(entry)}")
                out.append(n)
        values = tuple(out)
    else:
        values = (_int("padding", value, f"an int, a sequence of {nd} ints (one per spatial dimension), 'valid' or "
                       "'same'"),) * nd
    if any(v < 0 for v in values):
        raise ValueError(f"padding={short_repr(value)} must be >= 0")
    return _bounded("padding", values, value)


def _check_sizes(
    shapes: dict[str, tuple[int, ...]], out_size: tuple[int, ...], padding: tuple[int, ...], dtype: str
) -> None:
    """Raise ``ValueError`` when an output dimension is above :data:`INT32_MAX` or an operand is larger than an
    array can be (``sys.maxsize`` bytes). Plain values, not a ConvGeometry's cached properties: this also runs
    inside ``torch.compile``'s tracing, which cannot enter the lock Python 3.11's cached_property takes."""
    for i, size in enumerate(out_size):
        if size > INT32_MAX:  # only padding makes an output longer than its input
            raise ValueError(
                f"padding={padding} makes the output {size} long in dimension {i}, above 2**31 - 1 = "
                f"{INT32_MAX}, the largest value a cuDNN descriptor holds"
            )
    itemsize = ITEMSIZES.get(dtype, 8)
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if nbytes > sys.maxsize:
            raise ValueError(
                f"{name} {short_repr(shape)} of {dtype} is {nbytes} bytes, more than an array can hold ({sys.maxsize})"
                + ("" if name != "the output shape" else f" (input_shape {short_repr(shapes['input_shape'])}, "
                   f"weight_shape {short_repr(shapes['weight_shape'])}, padding {padding})")
            )


def conv_geometry(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    *,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    layout: str = "NCHW",
    dtype: Any = "float32",
) -> ConvGeometry:
    """Check a convolution's shapes and parameters and return its :class:`ConvGeometry`; ``dtype`` is a name of
    :data:`DTYPES` or a NumPy or PyTorch dtype (:func:`dtype_name`), kept by its name.

    Raises ``ValueError`` or ``TypeError`` naming the offending argument and its value.
    """
    if not is_choice(layout, LAYOUTS):
        raise ValueError(f"layout must be one of {LAYOUTS}, not {short_repr(layout)}")
    # the one check of a dtype, whose ValueError the public paths give: the callers give names, a str's quick case;
    # nor does a cached call get here, as the ops and wsarena.torch remember each call signature's geometry
    dtype = dtype_name(dtype)
    input_shape = _bounded("input_shape", _shape("input_shape", input_shape, batch=True))
    weight_shape = _bounded("weight_shape", _shape("weight_shape", weight_shape, batch=False))
    if len(input_shape) not in (3, 4, 5):
        raise ValueError(f"input_shape={short_repr(input_shape)} must have 3, 4 or 5 dimensions (1-, 2- or 3-D "
                         "convolution)")
    if len(weight_shape) != len(input_shape):
        raise ValueError(
            f"weight_shape={short_repr(weight_shape)} must have as many dimensions as "
            f"input_shape={short_repr(input_shape)}"
        )
    nd = len(input_shape) - 2
    if layout == "NCHW":
        batch, in_channels, size = input_shape[0], input_shape[1], input_shape[2:]
        out_channels, w_channels, kernel = weight_shape[0], weight_shape[1], weight_shape[2:]
    else:
        batch, in_channels, size = input_shape[0], input_shape[-1], input_shape[1:-1]
        out_channels, w_channels, kernel = weight_shape[0], weight_shape[-1], weight_shape[1:-1]
    if in_channels < 1 or any(s < 1 for s in size):
        raise ValueError(f"input_shape={short_repr(input_shape)} needs at least one channel and one element per "
                         "dimension")
    if out_channels < 1 or w_channels < 1 or any(k < 1 for k in kernel):
        raise ValueError(f"weight_shape={short_repr(weight_shape)} has a zero dimension")
    groups = _int("groups", groups)
    if groups < 1:
        raise ValueError(f"groups must be >= 1, not {short_repr(groups)}")
    _bounded("groups", groups)
    if in_channels % groups or out_channels % groups:
        raise ValueError(
            f"groups={groups} must divide the input channels ({in_channels}) and output channels ({out_channels})"
        )
    if w_channels * groups != in_channels:
        raise ValueError(
            f"weight_shape={short_repr(weight_shape)} has {w_channels} input channels per group; "
            f"input_shape={short_repr(input_shape)} "
            f"with groups={groups} needs {in_channels // groups}"
        )
    stride_t = _per_dim("stride", stride, nd, minimum=1)
    dilation_t = _per_dim("dilation", dilation, nd, minimum=1)
    padding_t = _padding(padding, nd, kernel, stride_t, dilation_t)
    for i, (s, k, p, d) in enumerate(zip(size, kernel, padding_t, dilation_t)):
        if d * (k - 1) + 1 > s + 2 * p:
            raise ValueError(
                f"kernel {tuple(kernel)} (dilation {dilation_t}) is larger than the padded input "
                f"{tuple(x + 2 * q for x, q in zip(size, padding_t))} in dimension {i}"
            )
    out_size = tuple(output_size(*dim) for dim in zip(size, kernel, stride_t, padding_t, dilation_t))
    out_shape = (batch, out_channels, *out_size) if layout == "NCHW" else (batch, *out_size, out_channels)
    shapes = {"input_shape": input_shape, "weight_shape": weight_shape, "the output shape": out_shape}
    _check_sizes(shapes, out_size, padding_t, dtype)
    return ConvGeometry(
        batch=batch,
        in_channels=in_channels,
        out_channels=out_channels,
        groups=groups,
        input_size=tuple(size),
        kernel_size=tuple(kernel),
        stride=stride_t,
        padding=padding_t,
        dilation=dilation_t,
        layout=LAYOUTS[LAYOUTS.index(layout)],  # the plain name, where a str subclass (numpy.str_) was given
        dtype=dtype,
    )


def conv_transpose_geometry(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    *,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    dtype: Any = "float32",
) -> ConvGeometry:
    """Check a transposed convolution's shapes and parameters (channels first, as PyTorch's ``conv_transpose2d``
    takes them) and return the geometry of the convolution whose input gradient it is.

    The transposed convolution of ``x`` ``(N, C_in, *size)`` by ``w`` ``(C_in, C_out/groups, *kernel)`` is that
    convolution's backward-data: its input ``(N, C_out, *out)`` is the transposed convolution's output, its output
    is ``x``, its weight is ``w``, where ``out = (size - 1) * stride - 2 * padding + dilation * (kernel - 1) +
    output_padding + 1``. ``output_padding`` must be below ``stride`` in every dimension: more would give the
    convolution more outputs than ``x`` has (PyTorch also takes ``output_padding`` below ``dilation``).

    Raises ``ValueError`` or ``TypeError`` naming the offending argument and its value.
    """
    input_shape = _shape("input_shape", input_shape, batch=True)
    weight_shape = _shape("weight_shape", weight_shape, batch=False)
    if len(input_shape) not in (3, 4, 5) or len(weight_shape) != len(input_shape):
        raise ValueError(f"input_shape={short_repr(input_shape)} and weight_shape={short_repr(weight_shape)} must "
                         "both have 3, 4 or 5 dimensions (1-, 2- or 3-D transposed convolution)")
    nd = len(input_shape) - 2
    channels, kernel = input_shape[1], weight_shape[2:]
    if channels != weight_shape[0]:
        raise ValueError(f"input_shape={short_repr(input_shape)} has {channels} channels; "
                         f"weight_shape={short_repr(weight_shape)} takes "
                         f"{weight_shape[0]}")
    groups = _int("groups", groups)
    if groups < 1 or channels % groups:
        raise ValueError(f"groups={groups} must be >= 1 and divide the input channels ({channels})")
    stride_t = _per_dim("stride", stride, nd, minimum=1)
    padding_t = _per_dim("padding", padding, nd, minimum=0)
    extra = _per_dim("output_padding", output_padding, nd, minimum=0)
    dilation_t = _per_dim("dilation", dilation, nd, minimum=1)
    if any(e >= s for e, s in zip(extra, stride_t)):
        raise ValueError(f"output_padding={extra} must be smaller than stride={stride_t} in every dimension")
    out = tuple(
        transposed_output_size(*dims) for dims in zip(input_shape[2:], kernel, stride_t, padding_t, dilation_t, extra)
    )
    if any(o < 1 for o in out):
        raise ValueError(f"padding={padding_t} leaves an output of size {out} for "
                         f"input_shape={short_repr(input_shape)}")
    return conv_geometry(
        (input_shape[0], weight_shape[1] * groups, *out), weight_shape, stride=stride_t, padding=padding_t,
        dilation=dilation_t, groups=groups, dtype=dtype,
    )
