"""Independent float64 reference convolutions, for checking the backends.

Written from the definition and sharing no code with :mod:`wsarena.backends`: the input is zero-padded
explicitly with ``np.pad``, and each output is the sum over groups and kernel offsets of the weights times a
strided slice of the padded input (a sliding window), contracted with ``einsum``. No im2col, no GEMM
reshaping. The backward passes are the same sums read the other way round:

- ``y[n, k, o]   = sum_{c, r} w[k, c, r] * xpad[n, c, o*stride + r*dilation]`` (within a group)
- ``dx = crop(sum_r scatter(w[:, :, r]^T dy))`` (the adjoint of the forward map in ``x``)
- ``dw[k, c, r]  = sum_{n, o} dy[n, k, o] * xpad[n, c, o*stride + r*dilation]`` (its adjoint in ``w``)

Layouts: ``"NCHW"`` (channels first, filters ``K x C/g x *k``) or ``"NHWC"`` (channels last, filters
``K x *k x C/g``); 1-, 2- and 3-D from the array rank. Results are float64 in the requested layout.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["error_for_sums", "ref_conv_backward_data", "ref_conv_backward_filter", "ref_conv_forward"]


def _tuple(value, nd):
    if isinstance(value, int):
        return (value,) * nd
    value = tuple(int(v) for v in value)
    assert len(value) == nd, value
    return value


def _to_first(a, layout):
    """Activation or filter in ``layout`` -> channels-first float64 copy."""
    a = np.asarray(a, dtype=np.float64)
    return np.moveaxis(a, -1, 1) if layout == "NHWC" else a


def _from_first(a, layout):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1) if layout == "NHWC" else a)


def _params(nd, stride, padding, dilation):
    return _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd)


def _window(offset, out_size, stride, dilation):
    """Slices of the padded input read by kernel ``offset`` for every output position."""
    return tuple(
        slice(r * d, r * d + (o - 1) * s + 1, s) for r, o, s, d in zip(offset, out_size, stride, dilation)
    )


def _out_size(in_size, kernel, stride, padding, dilation):
    return tuple(
        (i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in zip(in_size, kernel, stride, padding, dilation)
    )


def ref_conv_forward(x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW"):
    """Direct convolution ``y = conv(x, w)`` in float64."""
    x, w = _to_first(x, layout), _to_first(w, layout)
    nd = x.ndim - 2
    stride, padding, dilation = _params(nd, stride, padding, dilation)
    n, c = x.shape[:2]
    k, kernel = w.shape[0], w.shape[2:]
    cg, kg = c // groups, k // groups
    assert w.shape[1] == cg
    out_size = _out_size(x.shape[2:], kernel, stride, padding, dilation)
    xpad = np.pad(x, [(0, 0), (0, 0), *((p, p) for p in padding)])
    y = np.zeros((n, k, *out_size))
    for g in range(groups):
        xs, ks = slice(g * cg, (g + 1) * cg), slice(g * kg, (g + 1) * kg)
        for offset in itertools.product(*map(range, kernel)):
            window = xpad[(slice(None), xs, *_window(offset, out_size, stride, dilation))]
            y[:, ks] += np.einsum("kc,nc...->nk...", w[(ks, slice(None), *offset)], window)
    return _from_first(y, layout)


def ref_conv_backward_data(dy, w, input_shape, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW"):
    """Gradient of the forward convolution with respect to ``x`` (shape ``input_shape``), in float64."""
    dy, w = _to_first(dy, layout), _to_first(w, layout)
    nd = dy.ndim - 2
    stride, padding, dilation = _params(nd, stride, padding, dilation)
    input_shape = tuple(input_shape)
    n, c = input_shape[0], input_shape[-1] if layout == "NHWC" else input_shape[1]
    in_size = input_shape[1:-1] if layout == "NHWC" else input_shape[2:]
    k, kernel = w.shape[0], w.shape[2:]
    cg, kg = c // groups, k // groups
    out_size = dy.shape[2:]
    dxpad = np.zeros((n, c, *(i + 2 * p for i, p in zip(in_size, padding))))
    for g in range(groups):
        xs, ks = slice(g * cg, (g + 1) * cg), slice(g * kg, (g + 1) * kg)
        for offset in itertools.product(*map(range, kernel)):
            target = (slice(None), xs, *_window(offset, out_size, stride, dilation))
            dxpad[target] += np.einsum("kc,nk...->nc...", w[(ks, slice(None), *offset)], dy[:, ks])
    crop = tuple(slice(p, p + i) for p, i in zip(padding, in_size))
    return _from_first(dxpad[(slice(None), slice(None), *crop)], layout)


def ref_conv_backward_filter(x, dy, weight_shape, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW"):
    """Gradient of the forward convolution with respect to ``w`` (shape ``weight_shape``), in float64."""
    x, dy = _to_first(x, layout), _to_first(dy, layout)
    nd = x.ndim - 2
    stride, padding, dilation = _params(nd, stride, padding, dilation)
    weight_shape = tuple(weight_shape)
    kernel = weight_shape[1:-1] if layout == "NHWC" else weight_shape[2:]
    c, k = x.shape[1], dy.shape[1]
    cg, kg = c // groups, k // groups
    out_size = dy.shape[2:]
    xpad = np.pad(x, [(0, 0), (0, 0), *((p, p) for p in padding)])
    dw = np.zeros((k, cg, *kernel))
    for g in range(groups):
        xs, ks = slice(g * cg, (g + 1) * cg), slice(g * kg, (g + 1) * kg)
        for offset in itertools.product(*map(range, kernel)):
            window = xpad[(slice(None), xs, *_window(offset, out_size, stride, dilation))]
            sp = "xyz"[:nd]  # spatial subscripts, summed over with the images
            dw[(ks, slice(None), *offset)] = np.einsum(f"nk{sp},nc{sp}->kc", dy[:, ks], window)
    return _from_first(dw, layout)


def error_for_sums(got, ref, magnitude):
    """``max|got - ref|`` relative to the sums' magnitude: ``magnitude`` is the same pass run on the operands'
    absolute values, which bounds every partial sum, so a rounding error scales with it. Relative to ``ref`` alone,
    an output whose terms cancel (0.0004 out of sums of terms of 0.35, in one small case) reads as a large error
    for a rounding of a few ulps of its terms."""
    if not np.size(ref):
        return 0.0
    err = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - ref)))
    scale = float(np.max(np.abs(magnitude)))
    return err / scale if scale > 0 else err
