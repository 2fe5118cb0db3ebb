"""Descriptors through the real libcudnn: output shapes, round trips, errors, ownership (no GPU needed)."""

from __future__ import annotations

import gc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsarena import cudnn
from wsarena.cudnn import descriptors

_info = cudnn.library_info()
pytestmark = pytest.mark.skipif(not _info["found"], reason=f"libcudnn not loadable: {_info['error']}")

F32 = cudnn.DataType.FLOAT
NCHW = cudnn.TensorFormat.NCHW


def formula(i: int, k: int, s: int, p: int, d: int) -> int:
    """Output length of one dimension, written out independently of wsarena."""
    return (i + 2 * p - d * (k - 1) - 1) // s + 1


@st.composite
def conv_cases(draw):
    nd = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 4))
    c_in = groups * draw(st.integers(1, 3))
    c_out = groups * draw(st.integers(1, 3))
    dims = []
    for _ in range(nd):
        k = draw(st.integers(1, 5))
        d = draw(st.integers(1, 3))
        p = draw(st.integers(0, 4))
        s = draw(st.integers(1, 4))
        i = draw(st.integers(max(1, d * (k - 1) + 1 - 2 * p), 24))
        dims.append((i, k, s, p, d))
    return nd, groups, batch, c_in, c_out, dims


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_cases())
def test_output_shape_matches_the_formula(case):
    nd, groups, batch, c_in, c_out, dims = case
    sizes, kernels, strides, pads, dilations = (tuple(d[j] for d in dims) for j in range(5))
    with (
        cudnn.TensorDescriptor(F32, (batch, c_in, *sizes)) as x,
        cudnn.FilterDescriptor(F32, NCHW, (c_out, c_in // groups, *kernels)) as w,
        cudnn.ConvolutionDescriptor(pads, strides, dilations, groups=groups) as conv,
    ):
        out = conv.output_shape(x, w)
    assert out == (batch, c_out, *(formula(*d) for d in dims))
    assert len(out) == nd + 2


@pytest.mark.parametrize(
    ("x", "w", "pad", "stride", "dil", "groups", "expected"),
    [
        ((32, 3, 224, 224), (64, 3, 7, 7), (3, 3), (2, 2), (1, 1), 1, (32, 64, 112, 112)),  # ResNet stem
        ((8, 256, 14, 14), (256, 8, 3, 3), (1, 1), (1, 1), (1, 1), 32, (8, 256, 14, 14)),  # ResNeXt grouped
        ((8, 32, 56, 56), (32, 1, 3, 3), (1, 1), (2, 2), (1, 1), 32, (8, 32, 28, 28)),  # depthwise
        ((4, 64, 33, 33), (64, 64, 3, 3), (2, 2), (1, 1), (2, 2), 1, (4, 64, 33, 33)),  # dilated
        ((2, 16, 100), (32, 16, 5), (2,), (2,), (1,), 1, (2, 32, 50)),  # 1-D
        ((2, 4, 8, 16, 16), (8, 4, 3, 3, 3), (1, 1, 1), (1, 2, 2), (1, 1, 1), 1, (2, 8, 8, 8, 8)),  # 3-D
    ],
)
def test_output_shape_known_layers(x, w, pad, stride, dil, groups, expected):
    conv = cudnn.ConvolutionDescriptor(pad, stride, dil, groups)
    assert conv.output_shape(cudnn.TensorDescriptor(F32, x), cudnn.FilterDescriptor(F32, NCHW, w)) == expected


def test_one_d_is_two_d_with_unit_height():
    x = cudnn.TensorDescriptor(F32, (2, 4, 10))
    assert x.shape == (2, 4, 10) and x.cudnn_shape == (2, 4, 1, 10)
    assert x.query() == (F32, (2, 4, 1, 10), (40, 10, 10, 1))
    nlc = cudnn.TensorDescriptor(F32, (2, 4, 10), strides=(40, 1, 4))  # channels last
    assert nlc.query()[2] == (40, 1, 40, 4)
    w = cudnn.FilterDescriptor(F32, NCHW, (3, 4, 5))
    assert w.query() == (F32, NCHW, (3, 4, 1, 5))
    conv = cudnn.ConvolutionDescriptor((2,), (3,), (2,))
    got = conv.query()
    assert (got["padding"], got["stride"], got["dilation"]) == ((0, 2), (1, 3), (1, 2))
    assert conv.output_shape(x, w) == (2, 3, formula(10, 5, 3, 2, 2))


def test_tensor_round_trip_and_size():
    x = cudnn.TensorDescriptor("float16", (2, 3, 4, 5), strides=(60, 1, 15, 3))  # NHWC in memory
    assert x.query() == (cudnn.DataType.HALF, (2, 3, 4, 5), (60, 1, 15, 3))
    assert x.size_in_bytes == 2 * 3 * 4 * 5 * 2
    assert cudnn.TensorDescriptor(cudnn.DataType.DOUBLE, (1, 2, 3, 4)).size_in_bytes == 24 * 8


def test_convolution_round_trip():
    conv = cudnn.ConvolutionDescriptor(
        (1, 2, 3), (2, 2, 1), (1, 2, 1), groups=4, compute_type="float64", math_type=cudnn.MathType.FMA_MATH
    )
    assert conv.query() == {
        "padding": (1, 2, 3),
        "stride": (2, 2, 1),
        "dilation": (1, 2, 1),
        "mode": cudnn.ConvolutionMode.CROSS_CORRELATION,
        "compute_type": cudnn.DataType.DOUBLE,
        "groups": 4,
        "math_type": cudnn.MathType.FMA_MATH,
    }


def test_filter_nhwc_round_trip():
    w = cudnn.FilterDescriptor(cudnn.DataType.BFLOAT16, cudnn.TensorFormat.NHWC, (8, 3, 3, 3))
    assert w.query() == (cudnn.DataType.BFLOAT16, cudnn.TensorFormat.NHWC, (8, 3, 3, 3))


def test_negative_dimension_is_bad_param():
    with pytest.raises(cudnn.CudnnBadParamError) as info:
        cudnn.TensorDescriptor(F32, (2, -3, 8, 8))
    err = info.value
    assert err.status is cudnn.Status.BAD_PARAM
    assert isinstance(err, cudnn.CudnnError) and isinstance(err, RuntimeError)
    text = str(err)
    assert "cudnnSetTensorNdDescriptor" in text and "CUDNN_STATUS_BAD_PARAM" in text and "(2, -3, 8, 8)" in text
    with pytest.raises(cudnn.CudnnBadParamError):
        cudnn.FilterDescriptor(F32, NCHW, (4, 3, -1, 3))
    with pytest.raises(cudnn.CudnnBadParamError, match="cudnnSetConvolutionNdDescriptor"):
        cudnn.ConvolutionDescriptor((-1, 0), (1, 1), (1, 1))


def test_values_beyond_32_bits_are_refused_not_truncated():
    from wsarena.errors import UnsupportedConvolutionError

    # ctypes would keep the low 32 bits: 2**32 + 5 would become a valid-looking 5.
    with pytest.raises(UnsupportedConvolutionError, match="4294967301"):
        cudnn.TensorDescriptor(F32, (1, 1, 1, 2**32 + 5))
    with pytest.raises(UnsupportedConvolutionError, match="32-bit"):
        cudnn.ConvolutionDescriptor((0, 0), (1, 2**32 + 1), (1, 1))
    # Within 32 bits but over 2**31 elements in all: cuDNN's own limit, its own status.
    with pytest.raises(cudnn.CudnnNotSupportedError):
        cudnn.TensorDescriptor(F32, (2, 1, 32768, 32768))


def test_nine_dimensions_are_not_supported():
    with pytest.raises(cudnn.CudnnNotSupportedError) as info:
        cudnn.TensorDescriptor(F32, (1,) * 9)
    assert info.value.status is cudnn.Status.NOT_SUPPORTED
    assert "CUDNN_STATUS_NOT_SUPPORTED" in str(info.value)


def test_filter_channels_inconsistent_with_groups():
    x = cudnn.TensorDescriptor(F32, (2, 4, 8, 8))
    w = cudnn.FilterDescriptor(F32, NCHW, (6, 3, 3, 3))  # needs 4 / 2 = 2 input channels per group
    conv = cudnn.ConvolutionDescriptor((1, 1), (1, 1), (1, 1), groups=2)
    with pytest.raises(cudnn.CudnnBadParamError, match="cudnnGetConvolutionNdForwardOutputDim") as info:
        conv.output_shape(x, w)
    assert "groups=2" in str(info.value)  # the context names the convolution


def test_zero_groups_is_bad_param():
    with pytest.raises(cudnn.CudnnBadParamError, match="cudnnSetConvolutionGroupCount"):
        cudnn.ConvolutionDescriptor((0, 0), (1, 1), (1, 1), groups=0)


def test_our_own_argument_checks():
    with pytest.raises(ValueError, match="same length"):
        cudnn.ConvolutionDescriptor((1, 1), (1,), (1, 1))
    with pytest.raises(ValueError, match="one entry per dimension"):
        cudnn.TensorDescriptor(F32, (1, 2, 3, 4), strides=(1, 2))
    with pytest.raises(TypeError):
        cudnn.TensorDescriptor(F32, (1, 2, 3.5, 4))
    with pytest.raises(ValueError, match="no cuDNN data type"):
        cudnn.data_type("complex256")


def test_data_type_names():
    assert cudnn.data_type("float32") is cudnn.DataType.FLOAT
    assert cudnn.data_type("bfloat16") is cudnn.DataType.BFLOAT16
    assert cudnn.data_type("HALF") is cudnn.DataType.HALF
    assert cudnn.data_type("bool") is cudnn.DataType.BYTE_BOOLEAN  # NumPy's bool takes a byte per element
    assert cudnn.data_type(1) is cudnn.DataType.DOUBLE


class _CountDestroys:
    def __init__(self, monkeypatch):
        gc.collect()  # let descriptors left over by earlier tests go first; their addresses get reused
        self.calls: list[tuple[str, int]] = []
        real = descriptors.call

        def counting(name, *args, **kwargs):
            if name.startswith("cudnnDestroy"):
                self.calls.append((name, int(args[0])))
            return real(name, *args, **kwargs)

        monkeypatch.setattr(descriptors, "call", counting)


def test_close_destroys_exactly_once(monkeypatch):
    destroys = _CountDestroys(monkeypatch)
    for make in (
        lambda: cudnn.TensorDescriptor(F32, (1, 2, 3, 4)),
        lambda: cudnn.FilterDescriptor(F32, NCHW, (1, 2, 3, 4)),
        lambda: cudnn.ConvolutionDescriptor((0, 0), (1, 1), (1, 1)),
    ):
        before = len(destroys.calls)
        desc = make()
        raw = desc.handle
        desc.close()
        desc.close()
        assert desc.closed
        with pytest.raises(ValueError, match="closed"):
            _ = desc.handle
        del desc
        gc.collect()
        assert [h for _, h in destroys.calls[before:]] == [raw]  # cuDNN may reuse addresses: count per object


def test_context_manager_and_garbage_collection_destroy_once(monkeypatch):
    destroys = _CountDestroys(monkeypatch)
    with cudnn.TensorDescriptor(F32, (1, 2, 3, 4)) as desc:
        raw = desc.handle
    assert desc.closed and destroys.calls == [("cudnnDestroyTensorDescriptor", raw)]
    forgotten = cudnn.FilterDescriptor(F32, NCHW, (1, 2, 3, 4))
    raw = forgotten.handle
    del forgotten
    gc.collect()
    assert destroys.calls[-1] == ("cudnnDestroyFilterDescriptor", raw) and len(destroys.calls) == 2


def test_failed_set_destroys_the_new_handle(monkeypatch):
    destroys = _CountDestroys(monkeypatch)
    with pytest.raises(cudnn.CudnnBadParamError):
        cudnn.TensorDescriptor(F32, (1, -2, 3, 4))
    assert [name for name, _ in destroys.calls] == ["cudnnDestroyTensorDescriptor"]
    gc.collect()
    assert len(destroys.calls) == 1


def test_descriptor_passes_as_a_ctypes_argument():
    x = cudnn.TensorDescriptor(F32, (1, 2, 3, 4))
    assert x._as_parameter_.value == x.handle
    assert "TensorDescriptor FLOAT" in repr(x)
