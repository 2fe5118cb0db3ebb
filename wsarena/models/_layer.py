"""The :class:`ConvLayer` record and :class:`ModelError`.

A ``ConvLayer`` is one convolution of a network at batch 1, in NCHW, independent of any backend. The planner
turns it into a :class:`~wsarena._geometry.ConvGeometry` for a batch, dtype and layout with
:meth:`ConvLayer.geometry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._geometry import ConvGeometry, conv_geometry, dtype_name
from .._sizes import as_int, is_choice, is_sequence, positive_batch, short_repr
from ..errors import WsarenaError

__all__ = ["ConvLayer", "LayerList", "ModelError"]

# Keys of one layer in the JSON schema; the first three are required.
_REQUIRED_KEYS = ("name", "input_shape", "weight_shape")
_OPTIONAL_KEYS = ("stride", "padding", "dilation", "groups", "transposed")
# Keys ignored when a layer list is read, whatever their value: the per-pass results a `wsarena report --format json`
# layer carries, so that a report can be re-planned with another batch, dtype or cap, and values derived from the
# layer (output_shape, macs) or its plan (stream), which the report does not write.
_REPORT_KEYS = frozenset({"fwd", "bwd_data", "bwd_filter", "output_shape", "macs", "stream"})


class ModelError(WsarenaError, ValueError):
    """A model could not be loaded: unknown zoo name, unreadable or malformed file, impossible layer.

    The message is one line naming the problem (and the layer or ONNX node, where there is one).
    """


def _int(where: str, value: Any) -> int:
    # JSON gives floats and bools where a careless writer put 3.0 or true; neither is a size.
    n = as_int(value)  # None: no __index__, or one that refuses (a NumPy array of one element)
    if n is None:
        raise ModelError(f"{where} must be an integer, not {short_repr(value)}")
    return n


def _ints(where: str, value: Any) -> tuple[int, ...]:
    if not is_sequence(value):
        raise ModelError(f"{where} must be a list of integers, not {short_repr(value)}")
    # an entry that is none named by its index (stride[0]), as one entry of the list is refused, not the list
    return tuple(_int(f"{where}[{i}]", v) for i, v in enumerate(value))


def _per_dim(where: str, value: Any, nd: int) -> tuple[int, ...]:
    if not is_sequence(value):
        return (_int(where, value),) * nd
    values = _ints(where, value)
    if len(values) != nd:
        raise ModelError(f"{where}={short_repr(list(values))} must have one entry per spatial dimension ({nd})")
    return values


@dataclasses.dataclass(frozen=True)
class ConvLayer:
    """One convolution of a network, at batch 1, channels first.

    Parameters
    ----------
    name : str
        A descriptive name, e.g. ``"layer1.0.conv2"`` (the zoo uses torchvision's module paths).
    input_shape : tuple of int
        ``(1, C, *spatial)``: the input of the convolution, NCHW (or NCW, NCDHW for 1-D and 3-D). The leading
        batch entry is stored as 1 whatever is given; the batch comes from :meth:`geometry`.
    weight_shape : tuple of int
        ``(K, C // groups, *kernel)``.
    stride, padding, dilation : int or tuple of int
        One entry per spatial dimension (an int is repeated). Padding is symmetric: ``padding[i]`` zeros on each
        side of dimension ``i``.
    groups : int
        Convolution groups; ``groups == C`` with ``K == C`` is a depthwise convolution.
    transposed : bool
        ``True`` for a transposed convolution (``ConvTranspose``, "up-convolution", "deconvolution").

    Notes
    -----
    **Transposed convolutions are stored as their forward-equivalent convolution.** A ``ConvTranspose`` from
    ``C_in`` to ``C_out`` channels, with weight ``(C_in, C_out // groups, *kernel)``, computes exactly the
    backward-data pass of the ordinary convolution that maps its *output* back to its *input*. So a transposed
    layer stores that ordinary convolution:

    * ``input_shape`` is the ConvTranspose's **output** shape ``(1, C_out, *out_spatial)``;
    * ``weight_shape`` is the ConvTranspose's weight shape ``(C_in, C_out // groups, *kernel)``, read as a
      convolution weight ``(K=C_in, C=C_out // groups, *kernel)``;
    * ``stride``, ``padding``, ``dilation``, ``groups`` are the ConvTranspose's own;
    * the equivalent convolution's output, ``geometry().output_shape``, is the ConvTranspose's **input**.

    The ConvTranspose's forward pass is then this convolution's ``bwd_data``, its backward-data pass is this
    convolution's ``fwd``, and its backward-filter pass is this convolution's ``bwd_filter``: the same three
    cuDNN calls, with the same workspaces, under other names. ``output_padding`` simply makes ``input_shape``
    larger (the extra positions get no contribution), as PyTorch does when it calls cuDNN.

    Construction checks the geometry and raises :class:`ModelError` naming the layer when it is impossible.
    """

    name: str
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, ...] = 1  # type: ignore[assignment]  # normalized to a tuple in __post_init__
    padding: tuple[int, ...] = 0  # type: ignore[assignment]
    dilation: tuple[int, ...] = 1  # type: ignore[assignment]
    groups: int = 1
    transposed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ModelError(f"a layer's name must be a non-empty string, not {short_repr(self.name)}")
        where = f"layer {short_repr(self.name)}"
        input_shape = _ints(f"{where}: input_shape", self.input_shape)
        weight_shape = _ints(f"{where}: weight_shape", self.weight_shape)
        if len(input_shape) not in (3, 4, 5):
            raise ModelError(
                f"{where}: input_shape={short_repr(list(input_shape))} must have 3, 4 or 5 entries (N, C, *spatial)"
            )
        nd = len(input_shape) - 2
        if not isinstance(self.transposed, bool):
            raise ModelError(f"{where}: transposed must be true or false, not {short_repr(self.transposed)}")
        values = {
            "input_shape": (1, *input_shape[1:]),
            "weight_shape": weight_shape,
            "stride": _per_dim(f"{where}: stride", self.stride, nd),
            "padding": _per_dim(f"{where}: padding", self.padding, nd),
            "dilation": _per_dim(f"{where}: dilation", self.dilation, nd),
            "groups": _int(f"{where}: groups", self.groups),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.geometry()  # raises ModelError naming the layer if the geometry is impossible

    def geometry(self, *, batch: int = 1, dtype: Any = "float32", layout: str = "NCHW") -> ConvGeometry:
        """The checked geometry of this convolution for a batch size, dtype and memory layout.

        Parameters
        ----------
        batch : int
            Batch size, 1 to 2**31 - 1 (``ValueError`` outside; ``TypeError`` for a float, a bool or another
            non-integer).
        dtype : str or dtype
            Element type: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"float64"``, or its NumPy or PyTorch dtype
            (``ValueError`` for another).
        layout : {"NCHW", "NHWC"}
            ``"NHWC"`` permutes the shapes to channels last (``x`` is ``(N, *spatial, C)``, ``w`` is
            ``(K, *kernel, C/groups)``); the convolution is the same.

        Returns
        -------
        ConvGeometry
            For a transposed layer, the forward-equivalent convolution (see the class notes).
        """
        n = positive_batch(batch)  # numpy.int64 too, as the shapes take it
        dtype = dtype_name(dtype)  # as the planner takes it: "int8", or None, was the geometry's dtype
        x = (n, *self.input_shape[1:])
        w = self.weight_shape
        if not is_choice(layout, ("NCHW", "NHWC")):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', not {short_repr(layout)}")
        if layout == "NHWC":
            x = (x[0], *x[2:], x[1])
            w = (w[0], *w[2:], w[1])
        try:
            return conv_geometry(
                x,
                w,
                stride=self.stride,
                padding=self.padding,
                dilation=self.dilation,
                groups=self.groups,
                layout=layout,
                dtype=dtype,
            )
        except (ValueError, TypeError) as exc:
            raise ModelError(f"layer {short_repr(self.name)}: {exc}") from None

    @property
    def macs(self) -> int:
        """Multiply-accumulates of one pass at batch 1 (forward, or a ConvTranspose's forward)."""
        return self.geometry().macs

    @property
    def depthwise(self) -> bool:
        """True for a depthwise convolution: one input and at least one output channel per group, groups > 1."""
        return self.groups > 1 and self.weight_shape[1] == 1 and self.input_shape[1] == self.groups

    def to_dict(self) -> dict[str, Any]:
        """This layer as one entry of the JSON layer list (plain lists and ints, ready for ``json.dumps``)."""
        return {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "weight_shape": list(self.weight_shape),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "groups": self.groups,
            "transposed": self.transposed,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "layer") -> ConvLayer:
        """Build a layer from one entry of the JSON layer list, checking every field.

        ``stride``, ``padding``, ``dilation`` (an int or one int per spatial dimension), ``groups`` and
        ``transposed`` are optional (1, 0, 1, 1, false). The per-pass keys a ``wsarena report`` layer carries
        (``fwd``, ``bwd_data``, ``bwd_filter``) and ``output_shape``, ``macs`` and ``stream`` are ignored, whatever
        their value; any other key is an error, so that a misspelt ``"strides"`` is not silently dropped.

        Raises
        ------
        ModelError
            Naming ``where`` (e.g. ``"layers[3]"``) and the bad field.
        """
        if not isinstance(data, Mapping):
            raise ModelError(f"{where} must be an object with name, input_shape and weight_shape, "
                             f"not {short_repr(data)}")
        missing = [k for k in _REQUIRED_KEYS if k not in data]
        if missing:
            raise ModelError(f"{where} lacks {', '.join(repr(k) for k in missing)}")
        # sorted as text: a mapping given in Python may mix keys that do not compare (1 and "a")
        unknown = sorted(set(data) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS) - _REPORT_KEYS, key=str)
        if unknown:
            more = f", and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ModelError(
                f"{where} has unknown key(s) {', '.join(map(short_repr, unknown[:5]))}{more}; "
                f"known: {', '.join(_REQUIRED_KEYS + _OPTIONAL_KEYS)}"
            )
        name = data["name"]
        if not isinstance(name, str) or not name:
            raise ModelError(f"{where}: name must be a non-empty string, not {short_repr(name)}")
        kwargs = {k: data[k] for k in _OPTIONAL_KEYS if k in data}
        try:
            return cls(name=name, input_shape=data["input_shape"], weight_shape=data["weight_shape"], **kwargs)
        except ModelError as exc:
            raise ModelError(f"{where}: {exc}") from None


class LayerList(list[ConvLayer]):
    """The list :func:`wsarena.load_model` returns for an ONNX model: its :class:`ConvLayer` s, and in ``skipped``
    the ``(name, why)`` of each convolution left out (``skip_unknown=True``), which :func:`wsarena.plan` reports."""

    skipped: tuple[tuple[str, str], ...] = ()
