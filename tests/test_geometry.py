import dataclasses
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsarena._geometry import _check_sizes, conv_geometry, conv_transpose_geometry, describe_geometry, output_size


def test_nchw_shapes_and_output():
    g = conv_geometry((2, 6, 9, 10), (4, 3, 3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    assert g.nd == 2
    assert g.input_size == (9, 10) and g.kernel_size == (3, 2)
    assert g.output_size == ((9 + 2 - 2 - 1) // 2 + 1, (10 + 2 - 2 - 1) // 1 + 1)
    assert g.output_shape == (2, 4, *g.output_size)
    assert g.weight_shape == (4, 3, 3, 2)
    assert g.macs == 2 * 4 * g.output_size[0] * g.output_size[1] * 3 * 6
    # ints, as an array's shape must be and a count is: 3.0 compares equal to 3
    assert all(type(n) is int for n in (*g.input_shape, *g.weight_shape, *g.output_shape, g.macs))


def test_each_pass_has_its_operands_shapes():
    """fwd (x, w, y), bwd_data (dy, w, dx), bwd_filter (x, dy, dw): x (2, 6, 9, 10), w (4, 3, 3, 2), y (2, 4, 5, 11)."""
    g = conv_geometry((2, 6, 9, 10), (4, 3, 3, 2), stride=(2, 1), padding=1, groups=2)
    x, w, y = (2, 6, 9, 10), (4, 3, 3, 2), (2, 4, 5, 11)
    assert g.operand_shapes("fwd") == (x, w, y)
    assert g.operand_shapes("bwd_data") == (y, w, x)
    assert g.operand_shapes("bwd_filter") == (x, y, w)


def test_with_batch_takes_a_batch_of_0_or_more():
    g = conv_geometry((2, 4, 9, 9), (8, 4, 3, 3), padding=1)
    assert g.with_batch(5).input_shape == (5, 4, 9, 9) and g.with_batch(5).output_shape == (5, 8, 9, 9)
    assert g.with_batch(0).output_shape == (0, 8, 9, 9)
    for bad in (-1, -6):
        with pytest.raises(ValueError) as info:
            g.with_batch(bad)
        assert str(info.value) == f"batch must be >= 0, not {bad}"
    with pytest.raises(ValueError, match="^batch=2147483648 is above 2"):
        g.with_batch(2**31)
    # a batch that each descriptor holds, of operands no array can: 2**31 elements a sample, 4 bytes each
    big = conv_geometry((1, 1, 2**16, 2**15), (1, 1, 1, 1))
    with pytest.raises(ValueError) as info:
        big.with_batch(2**31 - 1)
    nbytes = 4 * 2**31 * (2**31 - 1)
    assert str(info.value).startswith(f"input_shape (2147483647, 1, 65536, 32768) of float32 is {nbytes} bytes")


def test_a_geometry_is_described_whole_in_one_line():
    """Two convolutions that differ in stride alone read differently in a message."""
    g = conv_geometry((2, 9, 10, 6), (4, 3, 2, 3), stride=(2, 1), padding=1, dilation=(1, 2), groups=2,
                      layout="NHWC", dtype="float16")
    assert describe_geometry(g) == ("input (2, 9, 10, 6) weight (4, 3, 2, 3) stride (2, 1) padding (1, 1) "
                                    "dilation (1, 2) groups 2 float16 NHWC")


def test_nhwc_shapes():
    g = conv_geometry((1, 8, 8, 6), (4, 3, 3, 3), padding=1, groups=2, layout="NHWC")
    assert (g.in_channels, g.out_channels, g.groups) == (6, 4, 2)
    assert g.input_shape == (1, 8, 8, 6) and g.weight_shape == (4, 3, 3, 3) and g.output_shape == (1, 8, 8, 4)


@settings(max_examples=200, deadline=None)
@given(
    nd=st.integers(1, 3), size=st.integers(1, 12), k=st.integers(1, 5), s=st.integers(1, 3),
    p=st.integers(0, 3), d=st.integers(1, 3),
)
def test_output_size_counts_windows(nd, size, k, s, p, d):
    """The output length equals the number of window positions, counted one by one."""
    span = d * (k - 1) + 1
    if span > size + 2 * p:
        with pytest.raises(ValueError, match="larger than the padded input"):
            conv_geometry((1, 1, *(size,) * nd), (1, 1, *(k,) * nd), stride=s, padding=p, dilation=d)
        return
    counted = len(range(0, size + 2 * p - span + 1, s))
    assert output_size(size, k, s, p, d) == counted
    g = conv_geometry((1, 1, *(size,) * nd), (1, 1, *(k,) * nd), stride=s, padding=p, dilation=d)
    assert g.output_size == (counted,) * nd


@settings(max_examples=200, deadline=None)
@given(
    nd=st.integers(1, 3), size=st.integers(1, 8), k=st.integers(1, 4), s=st.integers(1, 3), p=st.integers(0, 3),
    d=st.integers(1, 3), extra=st.integers(0, 2), groups=st.sampled_from([1, 2]),
)
def test_a_transposed_convolution_is_the_convolution_whose_input_gradient_it_is(nd, size, k, s, p, d, extra, groups):
    """Its output length is the shortest input whose windows, counted one by one, number ``size``, plus
    output_padding; the convolution of that input gives back ``size``. Its channels swap: x (2, 4, ...) by w (4, 3,
    ...) is the convolution of an input of 3 * groups channels to 4."""
    extra %= s  # output_padding must be below stride
    span = d * (k - 1) + 1
    shortest = next(n for n in range(1 - 2 * p, 100) if len(range(0, n + 2 * p - span + 1, s)) == size)
    expected = shortest + extra
    args = ((2, 4, *(size,) * nd), (4, 3, *(k,) * nd))
    kwargs = {"stride": s, "padding": p, "dilation": d, "output_padding": extra, "groups": groups}
    if expected < 1:
        with pytest.raises(ValueError, match="leaves an output of size"):
            conv_transpose_geometry(*args, **kwargs)
        return
    g = conv_transpose_geometry(*args, **kwargs)
    assert g.input_size == (expected,) * nd and g.output_size == (size,) * nd
    assert (g.batch, g.in_channels, g.out_channels, g.groups) == (2, 3 * groups, 4, groups)
    assert g.weight_shape == (4, 3, *(k,) * nd) and g.output_shape == (2, 4, *(size,) * nd)


def test_an_output_dim_may_be_as_long_as_a_descriptor_holds():
    """A 1-wide kernel over an input of n with padding 2**30 - 1 gives n + 2**31 - 2 outputs: 2**31 - 1 for n = 1,
    and 2**31, one past it, for n = 2."""
    assert conv_geometry((1, 1, 1), (1, 1, 1), padding=2**30 - 1).output_size == (2**31 - 1,)
    with pytest.raises(ValueError) as info:
        conv_geometry((1, 1, 2), (1, 1, 1), padding=2**30 - 1)
    assert str(info.value) == ("padding=(1073741823,) makes the output 2147483648 long in dimension 0, above 2**31 - 1 "
                               "= 2147483647, the largest value a cuDNN descriptor holds")


@pytest.mark.parametrize(("dtype", "itemsize"), [("float16", 2), ("bfloat16", 2), ("float32", 4), ("float64", 8)])
def test_an_operand_may_hold_as_many_elements_as_sys_maxsize_bytes_hold_in_its_dtype(dtype, itemsize):
    """The limit is sys.maxsize bytes at the dtype's bytes per element: NumPy's, and 2 for bfloat16's 16 bits."""
    if dtype != "bfloat16":
        assert np.dtype(dtype).itemsize == itemsize
    most = sys.maxsize // itemsize
    fits = {"input_shape": (most,), "weight_shape": (1,), "the output shape": (1,)}
    _check_sizes(fits, (1,), (0,), dtype)
    with pytest.raises(ValueError) as info:
        _check_sizes({**fits, "input_shape": (most + 1,)}, (1,), (0,), dtype)
    # an input's size says itself: only the output's names the shapes that make it
    assert str(info.value) == (f"input_shape ({most + 1},) of {dtype} is {(most + 1) * itemsize} bytes, more than an "
                               f"array can hold ({sys.maxsize})")


def test_same_and_valid_padding():
    assert conv_geometry((1, 1, 7, 7), (1, 1, 3, 5), padding="same").padding == (1, 2)
    assert all(type(p) is int for p in conv_geometry((1, 1, 7, 7), (1, 1, 3, 5), padding="same").padding)
    assert conv_geometry((1, 1, 7, 7), (1, 1, 3, 3), padding="same", dilation=2).output_size == (7, 7)
    assert conv_geometry((1, 1, 7, 7), (1, 1, 3, 3), padding="valid").padding == (0, 0)
    assert conv_geometry((1, 1, 7, 7), (1, 1, 3, 3), padding=((1, 1), (2, 2))).padding == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"padding": "same", "stride": 2}, "stride 1"),
        ({"padding": "same", "kernel": (2, 2)}, "asymmetric"),
        ({"padding": ((1, 0), (1, 1))}, "asymmetric"),
        ({"padding": "full"}, "padding"),
        ({"padding": -1}, "padding"),
        ({"stride": 0}, "stride"),
        ({"stride": (1, 1, 1)}, "stride"),
        ({"dilation": 0}, "dilation"),
        ({"groups": 0}, "groups"),
        ({"groups": 3}, "groups=3"),
        ({"groups": 2, "weight_channels": 2, "out_channels": 5}, r"groups=2 .* output channels \(5\)"),
        ({"layout": "NCWH"}, "layout"),
        ({"kernel": (9, 9)}, "larger than the padded input"),
        ({"weight_channels": 2}, "input channels per group"),
    ],
)
def test_bad_parameters_name_the_argument(kwargs, match):
    kernel = kwargs.pop("kernel", (3, 3))
    wc = kwargs.pop("weight_channels", 4)
    k = kwargs.pop("out_channels", 6)
    with pytest.raises(ValueError, match=match):
        conv_geometry((2, 4, 8, 8), (k, wc, *kernel), **kwargs)


@pytest.mark.parametrize(
    ("shapes", "says"),
    [
        (((1, 0, 5, 5), (2, 1, 3, 3)),
         "input_shape=(1, 0, 5, 5) needs at least one channel and one element per dimension"),
        (((1, 1, 0, 5), (2, 1, 3, 3)),
         "input_shape=(1, 1, 0, 5) needs at least one channel and one element per dimension"),
        (((1, 1, 5, 5), (0, 1, 3, 3)), "weight_shape=(0, 1, 3, 3) has a zero dimension"),
        (((1, 1, 5, 5), (2, 0, 3, 3)), "weight_shape=(2, 0, 3, 3) has a zero dimension"),
        (((1, 1, 5, 5), (2, 1, 0, 3)), "weight_shape=(2, 1, 0, 3) has a zero dimension"),
    ],
)
def test_a_zero_channel_or_dimension_is_told_in_its_own_shape(shapes, says):
    """Where the other shape is whole: no check after (the channels per group) speaks for it."""
    with pytest.raises(ValueError) as info:
        conv_geometry(*shapes)
    assert str(info.value) == says


def test_an_output_too_large_for_an_array_is_shown_in_the_layouts_order():
    """NHWC: the output (N, H, W, K) of x (1, 2**20, 2**20, 1) by w (2**31 - 1, 1, 1, 1), 4 bytes each."""
    with pytest.raises(ValueError) as info:
        conv_geometry((1, 2**20, 2**20, 1), (2**31 - 1, 1, 1, 1), layout="NHWC")
    nbytes = 4 * 2**20 * 2**20 * (2**31 - 1)
    assert str(info.value) == (
        f"the output shape (1, 1048576, 1048576, 2147483647) of float32 is {nbytes} bytes, more than an array can "
        f"hold ({sys.maxsize}) (input_shape (1, 1048576, 1048576, 1), weight_shape (2147483647, 1, 1, 1), padding "
        "(0, 0))"
    )


def test_a_transposed_convolutions_defaults_are_stride_1_no_padding_dilation_1_one_group():
    """x (1, 4, 5, 5) by w (4, 2, 3, 3): out = (5 - 1) * 1 - 0 + 1 * (3 - 1) + 0 + 1 = 7, of 2 channels."""
    g = conv_transpose_geometry((1, 4, 5, 5), (4, 2, 3, 3))
    assert g == conv_geometry((1, 2, 7, 7), (4, 2, 3, 3))
    assert (g.stride, g.padding, g.dilation, g.groups) == ((1, 1), (0, 0), (1, 1), 1)


@pytest.mark.parametrize(
    ("shapes", "kwargs", "says"),
    [
        (((1, 1, 5, 5, 5, 5), (1, 1, 3, 3, 3, 3)), {},
         ("input_shape=(1, 1, 5, 5, 5, 5) and weight_shape=(1, 1, 3, 3, 3, 3) must both have 3, 4 or 5 dimensions "
          "(1-, 2- or 3-D transposed convolution)")),
        (((1, 1, 5, 5), (1, 1, 3)), {},
         ("input_shape=(1, 1, 5, 5) and weight_shape=(1, 1, 3) must both have 3, 4 or 5 dimensions (1-, 2- or 3-D "
          "transposed convolution)")),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"groups": 0}, "groups=0 must be >= 1 and divide the input channels (4)"),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"groups": 3}, "groups=3 must be >= 1 and divide the input channels (4)"),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"stride": 0}, "stride=0 must be >= 1 in every dimension"),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"padding": -1}, "padding=-1 must be >= 0 in every dimension"),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"output_padding": -1}, "output_padding=-1 must be >= 0 in every dimension"),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"dilation": 0}, "dilation=0 must be >= 1 in every dimension"),
        (((1, 4, 5, 5), (4, 2, 3, 3)), {"stride": 2, "output_padding": (1, 2)},
         "output_padding=(1, 2) must be smaller than stride=(2, 2) in every dimension"),
    ],
)
def test_a_transposed_convolutions_bad_parameters_name_the_argument(shapes, kwargs, says):
    """Each told as the transposed convolution's, not the convolution's that it becomes."""
    with pytest.raises(ValueError) as info:
        conv_transpose_geometry(*shapes, **kwargs)
    assert str(info.value) == says


@pytest.mark.parametrize("bad", [1.5, "2", True, None, b"\x02\x02", np.array([2, 2]), np.float64(2)])
@pytest.mark.parametrize("name", ["stride", "padding", "dilation"])
def test_non_integer_parameters_are_type_errors_naming_the_argument(name, bad):
    if name == "padding" and isinstance(bad, str):  # text is a padding mode: its own ValueError
        with pytest.raises(ValueError, match="padding must be an int, a sequence, 'valid' or 'same'"):
            conv_geometry((1, 1, 5, 5), (1, 1, 3, 3), padding=bad)
        return
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        conv_geometry((1, 1, 5, 5), (1, 1, 3, 3), **{name: bad})


def test_numpy_integers_are_integers():
    g = conv_geometry((1, 1, 5, 5), (1, 1, 3, 3), stride=np.int64(2), padding=(np.int32(1), 1), dilation=np.array(1))
    assert (g.stride, g.padding, g.dilation) == ((2, 2), (1, 1), (1, 1))


def test_rank_mismatch_and_unsupported_rank():
    with pytest.raises(ValueError, match="3, 4 or 5"):
        conv_geometry((1, 1, 5, 5, 5, 5), (1, 1, 3, 3, 3, 3))
    with pytest.raises(ValueError, match="as many dimensions"):
        conv_geometry((1, 1, 5, 5), (1, 1, 3))


@pytest.mark.parametrize(("make", "says"), [
    (lambda: conv_geometry(tuple(range(1, 3001)), (1, 1, 1)),
     "input_shape=(1, 2, 3, 4, 5, 6, ... 2994 more) must have 3, 4 or 5 dimensions (1-, 2- or 3-D convolution)"),
    (lambda: conv_geometry((1, 1, 5, 5), (1,) * 3000),
     "weight_shape=(1, 1, 1, 1, 1, 1, ... 2994 more) must have as many dimensions as input_shape=(1, 1, 5, 5)"),
    (lambda: conv_transpose_geometry((1,) * 3000, (1, 1, 1)),
     ("input_shape=(1, 1, 1, 1, 1, 1, ... 2994 more) and weight_shape=(1, 1, 1) must both have 3, 4 or 5 dimensions "
      "(1-, 2- or 3-D transposed convolution)")),
    (lambda: conv_geometry((1, 1, 5, 5, 5, 5), (1, 1, 3, 3, 3, 3)),  # a short shape, as it always read
     "input_shape=(1, 1, 5, 5, 5, 5) must have 3, 4 or 5 dimensions (1-, 2- or 3-D convolution)"),
    (lambda: conv_geometry((1, 10**5000, 4), (1, 1, 1)),  # a number repr() refuses
     ("input_shape=(1, an integer of 16610 bits, 4): an integer of 16610 bits is above 2**31 - 1 = 2147483647, the "
      "largest value a cuDNN descriptor holds")),
])
def test_a_shape_of_many_dimensions_is_quoted_cut(make, says):
    """A shape of thousands of dimensions was quoted whole, an error of thousands of characters; it is cut as
    short_repr cuts a value, and a short one reads as before."""
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == says


def test_zero_batch_is_legal_and_empty_channel_is_not():
    assert conv_geometry((0, 3, 5, 5), (2, 3, 3, 3)).output_shape == (0, 2, 3, 3)
    with pytest.raises(ValueError):
        conv_geometry((1, 0, 5, 5), (2, 0, 3, 3))


@pytest.mark.parametrize(("make", "layout"), [(conv_geometry, "NCHW"), (conv_geometry, "NHWC"),
                                              (conv_transpose_geometry, None)], ids=["NCHW", "NHWC", "transposed"])
def test_a_negative_dim_is_told_what_that_dim_takes(make, layout):
    """Every dim but the batch must be 1 or more, the batch 0 or more (an empty batch): a negative dim was told
    "input_shape must be >= 0", whatever the dim, and the 0 that suggests was then refused for all but the batch."""
    kwargs = {} if layout is None else {"layout": layout}
    x, w = ((2, 6, 6, 4), (4, 3, 3, 4)) if layout == "NHWC" else ((2, 4, 6, 6), (4, 4, 3, 3))
    assert make((0, *x[1:]), w, **kwargs).batch == 0  # as it says: 0 taken for the batch...
    for i in range(4):
        for negative in (-6, -1):  # -1 too: the one below the least a batch takes
            with pytest.raises(ValueError) as info:
                make(x[:i] + (negative,) + x[i + 1:], w, **kwargs)
            assert str(info.value) == (f"input_shape[0], the batch, must be >= 0, not {negative}" if i == 0 else
                                       f"input_shape[{i}] must be >= 1, not {negative}")
        if i:
            with pytest.raises(ValueError):  # ... and refused for any other dim
                make(x[:i] + (0,) + x[i + 1:], w, **kwargs)
        with pytest.raises(ValueError) as info:
            make(x, w[:i] + (-3,) + w[i + 1:], **kwargs)
        assert str(info.value) == f"weight_shape[{i}] must be >= 1, not -3"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"stride": [2.0, 2]}, "stride[0] must be an int, not 2.0"),
        ({"dilation": (1, "2")}, "dilation[1] must be an int, not '2'"),
        ({"padding": [1, None]}, "padding[1] must be an int or a (before, after) pair, not None"),
        ({"padding": [(1, 1), (1, 1.5)]}, "padding[1][1] must be an int, not 1.5"),
        ({"stride": [[1, 1], 1]}, "stride[0] must be an int, not [1, 1]"),
        ({"input_shape": (2, 4.0, 9, 9)}, "input_shape[1] must be an int, not 4.0"),
        ({"weight_shape": (8, 4, 3, True)}, "weight_shape[3] must be an int, not True"),
    ],
)
def test_an_entry_of_a_sequence_that_is_no_int_is_named_by_its_index(kwargs, says):
    """stride=[2.0, 2] was told "stride must be an int, not 2.0", as if stride had been 2.0, not one entry of it."""
    shapes = {"input_shape": kwargs.pop("input_shape", (2, 4, 9, 9)),
              "weight_shape": kwargs.pop("weight_shape", (8, 4, 3, 3))}
    with pytest.raises(TypeError) as info:
        conv_geometry(shapes["input_shape"], shapes["weight_shape"], **kwargs)
    assert str(info.value) == says


@pytest.mark.parametrize("name", ["stride", "padding", "output_padding", "dilation"])
def test_an_entry_of_a_transposed_convolutions_sequence_that_is_no_int_is_named_by_its_index(name):
    with pytest.raises(TypeError) as info:
        conv_transpose_geometry((2, 4, 9, 9), (4, 8, 3, 3), **{"stride": 2, name: [1, 1.0]})
    assert str(info.value) == f"{name}[1] must be an int, not 1.0"


def test_with_dtype_takes_a_dtype_by_its_name_and_refuses_what_is_none():
    """with_dtype(np.float32) kept str(np.float32), "<class 'numpy.float32'>", a dtype no backend knows, and no
    geometry built with "float32" equalled it: a dtype is named as conv_geometry's callers and the planner name it."""
    torch = pytest.importorskip("torch")
    g = conv_geometry((2, 4, 9, 9), (8, 4, 3, 3), padding=1)
    for dtype in (np.float16, np.dtype("float16"), torch.float16, "float16", np.str_("float16")):
        made = g.with_dtype(dtype)
        assert made.dtype == "float16" and type(made.dtype) is str
        assert made == conv_geometry((2, 4, 9, 9), (8, 4, 3, 3), padding=1, dtype="float16")
    for bad, shown in ((np.int8, "<class 'numpy.int8'>"), ("f4", "'f4'"), (None, "None")):
        with pytest.raises(ValueError) as info:
            g.with_dtype(bad)
        assert str(info.value) == ("dtype must be one of float32, float16, bfloat16, float64, or their NumPy or "
                                   f"PyTorch dtype, not {shown}")


def test_conv_geometry_names_its_dtype_and_refuses_what_is_none_as_with_dtype_does():
    """conv_geometry kept str(dtype) unchecked: dtype="int8" made a geometry, np.float16 one of "<class
    'numpy.float16'>", where with_dtype and the public paths give dtype_name's ValueError or the name."""
    torch = pytest.importorskip("torch")
    for dtype in (np.float16, np.dtype("float16"), torch.float16, "float16", np.str_("float16")):
        for made in (conv_geometry((2, 4, 9, 9), (8, 4, 3, 3), padding=1, dtype=dtype),
                     conv_transpose_geometry((2, 8, 9, 9), (8, 4, 3, 3), padding=1, dtype=dtype)):
            assert made.dtype == "float16" and type(made.dtype) is str
    for bad, shown in ((np.int8, "<class 'numpy.int8'>"), ("int8", "'int8'"), ("f4", "'f4'"), (None, "None")):
        for make, x_shape in ((conv_geometry, (2, 4, 9, 9)), (conv_transpose_geometry, (2, 8, 9, 9))):
            with pytest.raises(ValueError) as info:
                make(x_shape, (8, 4, 3, 3), dtype=bad)
            assert str(info.value) == ("dtype must be one of float32, float16, bfloat16, float64, or their NumPy or "
                                       f"PyTorch dtype, not {shown}")


def test_a_layout_given_as_a_str_subclass_is_kept_as_the_plain_name():
    """layout=numpy.str_("NHWC") was kept as given, where a Config's choices and a plan's passes hold the plain str."""
    g = conv_geometry((2, 9, 9, 4), (8, 3, 3, 4), layout=np.str_("NHWC"))
    assert g.layout == "NHWC" and type(g.layout) is str
    assert g == conv_geometry((2, 9, 9, 4), (8, 3, 3, 4), layout="NHWC") and "np.str_" not in repr(g)


def test_geometry_hash_matches_equality_and_survives_pickling_into_another_process():
    g = conv_geometry((2, 9, 9, 4), (8, 3, 3, 4), stride=2, padding=1, layout="NHWC", dtype="float64")
    same = conv_geometry((2, 9, 9, 4), (8, 3, 3, 4), stride=2, padding=1, layout="NHWC", dtype="float64")
    assert hash(g) == hash(same)
    assert g != g.with_dtype("float32")
    # The hash is cached on the instance; a copy unpickled where str hashes differ must hash afresh, or an equal
    # geometry built there would miss it as a dict key.
    code = (
        "import pickle, sys\n"
        "from wsarena._geometry import conv_geometry\n"
        "g = pickle.loads(sys.stdin.buffer.read())\n"
        "fresh = conv_geometry((2, 9, 9, 4), (8, 3, 3, 4), stride=2, padding=1, layout='NHWC', dtype='float64')\n"
        "print({fresh: 'found'}.get(g, 'missed'))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(g), capture_output=True, env=env, check=True)
    assert out.stdout.decode().strip() == "found"


def test_a_geometry_cannot_be_changed():
    """Its shapes and hash are worked out once and kept: a field changed after would leave them stale, and a geometry
    is a key of the algorithm caches."""
    g = conv_geometry((2, 4, 9, 9), (8, 4, 3, 3), padding=1)
    assert g.output_shape == (2, 8, 9, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.padding = (0, 0)
