"""The backend (graph) API's owned descriptor through the real libcudnn, without a GPU.

Creating and setting attributes need only libcudnn. Finalizing, and so reading attributes back, needs cuDNN's
engine sub-libraries to load, which needs ``libcuda.so.1``: the conftest loads a stand-in where the driver is
missing (tests/cudnn_probe/driver.py); the tests that finalize skip, with the reason, where even that fails.
"""

from __future__ import annotations

import ctypes
import gc
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from wsarena import cudnn
from wsarena.cudnn import BackendAttributeName as A
from wsarena.cudnn import BackendAttributeType as T
from wsarena.cudnn import BackendDescriptor
from wsarena.cudnn import BackendDescriptorType as D

from .cudnn_probe import driver

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def finalizing():
    reason = driver.finalize_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def tensor(uid, dims, strides, dtype=cudnn.DataType.FLOAT, alignment=16):
    t = BackendDescriptor(D.TENSOR_DESCRIPTOR)
    t.set(A.TENSOR_DATA_TYPE, T.DATA_TYPE, dtype).set(A.TENSOR_DIMENSIONS, T.INT64, dims)
    t.set(A.TENSOR_STRIDES, T.INT64, strides).set(A.TENSOR_UNIQUE_ID, T.INT64, uid)
    return t.set(A.TENSOR_BYTE_ALIGNMENT, T.INT64, alignment)


def test_every_attribute_type_has_a_ctype_of_the_headers_size():
    assert cudnn.ATTRIBUTE_CTYPES[T.INT64] is ctypes.c_int64
    assert cudnn.ATTRIBUTE_CTYPES[T.BACKEND_DESCRIPTOR] is ctypes.c_void_p
    assert cudnn.ATTRIBUTE_CTYPES[T.BOOLEAN] is ctypes.c_bool and ctypes.sizeof(ctypes.c_bool) == 1


def test_create_and_set_need_no_finalize():
    with tensor(1, [2, 3, 4, 5], [60, 20, 5, 1]) as t:
        assert t.kind is D.TENSOR_DESCRIPTOR and not t.finalized and t.handle
    assert t.closed
    t.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        _ = t.handle


def test_tensor_round_trip(finalizing):
    with tensor(7, [2, 3, 4, 5], [60, 1, 15, 3], cudnn.DataType.HALF, 8) as t:
        t.set(A.TENSOR_IS_VIRTUAL, T.BOOLEAN, False).finalize()
        assert t.finalized
        assert t.get(A.TENSOR_DIMENSIONS, T.INT64) == [2, 3, 4, 5]
        assert t.get(A.TENSOR_STRIDES, T.INT64) == [60, 1, 15, 3]
        assert t.get(A.TENSOR_DIMENSIONS, T.INT64, 2) == [2, 3]
        assert t.get_one(A.TENSOR_UNIQUE_ID, T.INT64) == 7
        assert t.get_one(A.TENSOR_DATA_TYPE, T.DATA_TYPE) is cudnn.DataType.HALF
        assert t.get_one(A.TENSOR_IS_VIRTUAL, T.BOOLEAN) is False
        assert t.count(A.TENSOR_DIMENSIONS, T.INT64) == 4


def test_convolution_round_trip(finalizing):
    with BackendDescriptor(D.CONVOLUTION_DESCRIPTOR) as conv:
        conv.set(A.CONVOLUTION_COMP_TYPE, T.DATA_TYPE, cudnn.DataType.DOUBLE)
        conv.set(A.CONVOLUTION_CONV_MODE, T.CONVOLUTION_MODE, cudnn.ConvolutionMode.CROSS_CORRELATION)
        conv.set(A.CONVOLUTION_SPATIAL_DIMS, T.INT64, 3)
        conv.set(A.CONVOLUTION_DILATIONS, T.INT64, [1, 2, 3]).set(A.CONVOLUTION_FILTER_STRIDES, T.INT64, [2, 1, 1])
        conv.set(A.CONVOLUTION_PRE_PADDINGS, T.INT64, [0, 1, 2]).set(A.CONVOLUTION_POST_PADDINGS, T.INT64, [0, 1, 2])
        conv.finalize()
        assert conv.get_one(A.CONVOLUTION_COMP_TYPE, T.DATA_TYPE) is cudnn.DataType.DOUBLE
        assert conv.get(A.CONVOLUTION_DILATIONS, T.INT64) == [1, 2, 3]
        assert conv.get(A.CONVOLUTION_FILTER_STRIDES, T.INT64) == [2, 1, 1]
        assert conv.get(A.CONVOLUTION_PRE_PADDINGS, T.INT64) == [0, 1, 2]


def test_knob_choice_round_trip(finalizing):
    with BackendDescriptor(D.KNOB_CHOICE_DESCRIPTOR) as knob:
        knob.set(A.KNOB_CHOICE_KNOB_TYPE, T.KNOB_TYPE, cudnn.BackendKnobType.TILE_SIZE)
        knob.set(A.KNOB_CHOICE_KNOB_VALUE, T.INT64, 3).finalize()
        assert knob.get_one(A.KNOB_CHOICE_KNOB_TYPE, T.KNOB_TYPE) is cudnn.BackendKnobType.TILE_SIZE
        assert knob.get_one(A.KNOB_CHOICE_KNOB_VALUE, T.INT64) == 3


def test_descriptor_attributes_come_back_as_descriptors_and_keep_their_parts_alive(finalizing):
    x, w, y = tensor(1, [1, 2, 5, 5], [50, 25, 5, 1]), tensor(2, [3, 2, 3, 3], [18, 9, 3, 1]), tensor(
        3, [1, 3, 3, 3], [27, 9, 3, 1]
    )
    for t in (x, w, y):
        t.finalize()
    conv = BackendDescriptor(D.CONVOLUTION_DESCRIPTOR)
    conv.set(A.CONVOLUTION_COMP_TYPE, T.DATA_TYPE, cudnn.DataType.FLOAT)
    conv.set(A.CONVOLUTION_CONV_MODE, T.CONVOLUTION_MODE, cudnn.ConvolutionMode.CROSS_CORRELATION)
    conv.set(A.CONVOLUTION_SPATIAL_DIMS, T.INT64, 2)
    for name, value in ((A.CONVOLUTION_DILATIONS, 1), (A.CONVOLUTION_FILTER_STRIDES, 1),
                        (A.CONVOLUTION_PRE_PADDINGS, 0), (A.CONVOLUTION_POST_PADDINGS, 0)):
        conv.set(name, T.INT64, [value, value])
    conv.finalize()
    op = BackendDescriptor(D.OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)
    op.set(A.OPERATION_CONVOLUTION_FORWARD_ALPHA, T.FLOAT, 1.0).set(A.OPERATION_CONVOLUTION_FORWARD_BETA, T.FLOAT, 0)
    op.set(A.OPERATION_CONVOLUTION_FORWARD_CONV_DESC, T.BACKEND_DESCRIPTOR, conv)
    op.set(A.OPERATION_CONVOLUTION_FORWARD_X, T.BACKEND_DESCRIPTOR, x)
    op.set(A.OPERATION_CONVOLUTION_FORWARD_W, T.BACKEND_DESCRIPTOR, w)
    op.set(A.OPERATION_CONVOLUTION_FORWARD_Y, T.BACKEND_DESCRIPTOR, y)
    del x, w, y, conv
    gc.collect()  # the operation holds its parts
    op.finalize()
    (got,) = op.get_descriptors(A.OPERATION_CONVOLUTION_FORWARD_W, D.TENSOR_DESCRIPTOR, 1)
    assert got.finalized and got.kind is D.TENSOR_DESCRIPTOR
    # cuDNN 9.28 hands back its own grouped form of w, (groups, K, C, R, S), whose unique id reads -1
    assert got.get(A.TENSOR_DIMENSIONS, T.INT64) == [1, 3, 2, 3, 3]
    del op
    gc.collect()
    assert got.get(A.TENSOR_DIMENSIONS, T.INT64)[1:] == [3, 2, 3, 3]  # what it was read from stays alive with it


def test_text_attribute_round_trip(finalizing):
    text = (DATA / "h100-handwritten.json").read_text()
    with BackendDescriptor(D.DEVICEPROP_DESCRIPTOR) as props:
        props.set(A.DEVICEPROP_JSON_REPRESENTATION, T.CHAR, text).finalize()
        assert json.loads(props.get_text(A.DEVICEPROP_JSON_REPRESENTATION)) == json.loads(text)


def test_a_value_the_type_cannot_hold_is_a_type_error_naming_the_attribute():
    with BackendDescriptor(D.TENSOR_DESCRIPTOR) as t:
        with pytest.raises(TypeError, match="TENSOR_DIMENSIONS"):
            t.set(A.TENSOR_DIMENSIONS, T.INT64, ["2", 3])
        with pytest.raises(TypeError, match="TENSOR_IS_VIRTUAL"):
            t.set(A.TENSOR_IS_VIRTUAL, T.BOOLEAN, 1)
        with pytest.raises(TypeError, match="a BackendDescriptor"):
            BackendDescriptor(D.OPERATIONGRAPH_DESCRIPTOR).set(A.OPERATIONGRAPH_OPS, T.BACKEND_DESCRIPTOR, [5])
        with pytest.raises(TypeError, match="get_text"):
            t.get(A.TENSOR_DIMENSIONS, T.CHAR)
        with pytest.raises(TypeError, match="not supported"):
            t.set(A.TENSOR_DIMENSIONS, T.FRACTION, 1)
        with pytest.raises(ValueError, match="TENSOR_DATA_TYPE"):
            t.set(A.TENSOR_DATA_TYPE, T.DATA_TYPE, 99)  # refused before cuDNN, which aborts the process on it


def test_an_integer_the_c_type_cannot_hold_is_refused_not_wrapped():
    """ctypes does no overflow check: (c_int64 * 1)(2**64 + 1) holds 1. cuDNN would then be given another value
    than the caller's (an engine index, a dimension, a device id, a pointer) without a word."""
    limits = [(T.INT64, A.TENSOR_DIMENSIONS, [2**63, -(2**63) - 1, 2**64 + 1]),
              (T.INT32, A.DEVICEPROP_DEVICE_ID, [2**31, -(2**31) - 1, 2**32]),
              (T.VOID_PTR, A.VARIANT_PACK_WORKSPACE, [-1, 2**64, 2**64 + 1])]
    for attr_type, name, values in limits:
        with BackendDescriptor(D.TENSOR_DESCRIPTOR) as t:
            for value in values:
                with pytest.raises(ValueError, match=f"{name.name}: .*cannot be {attr_type.name}"):
                    t.set(name, attr_type, [3, value] if attr_type == T.INT64 else value)
    with BackendDescriptor(D.DEVICEPROP_DESCRIPTOR) as props:  # the limits themselves are values
        props.set(A.DEVICEPROP_DEVICE_ID, T.INT32, 2**31 - 1).set(A.DEVICEPROP_DEVICE_ID, T.INT32, -(2**31))
    with BackendDescriptor(D.VARIANT_PACK_DESCRIPTOR) as pack:
        pack.set(A.VARIANT_PACK_WORKSPACE, T.VOID_PTR, 2**64 - 1).set(A.VARIANT_PACK_WORKSPACE, T.VOID_PTR, 0)


def test_any_integer_type_is_checked_by_its_value():
    """What the attribute takes as an int (anything with ``__index__``: NumPy's, an address wrapper's) is compared
    with the C type's limits as the int it stands for."""
    class Address:
        def __init__(self, value):
            self.value = value

        def __index__(self):
            return self.value

    with BackendDescriptor(D.VARIANT_PACK_DESCRIPTOR) as pack:
        for value in (Address(2**64 - 1), np.uint64(2**64 - 1), np.int64(0x1000)):
            pack.set(A.VARIANT_PACK_WORKSPACE, T.VOID_PTR, value)
        for value in (Address(2**64), Address(-1)):
            with pytest.raises(ValueError, match="VARIANT_PACK_WORKSPACE: .*cannot be VOID_PTR .*outside"):
                pack.set(A.VARIANT_PACK_WORKSPACE, T.VOID_PTR, value)


def test_cudnn_refusals_are_typed_errors():
    with BackendDescriptor(D.TENSOR_DESCRIPTOR) as t:
        with pytest.raises(cudnn.CudnnBadParamAttributeTypeError, match="TENSOR_DATA_TYPE"):
            t.set(A.TENSOR_DATA_TYPE, T.INT64, 0)  # the attribute's type is DATA_TYPE
        with pytest.raises(cudnn.CudnnBadParamError):
            t.set(123456, T.INT64, 0)  # no such attribute
        with pytest.raises(cudnn.CudnnNotInitializedError):
            t.get(A.TENSOR_DIMENSIONS, T.INT64, 4)  # not finalized
    with pytest.raises(ValueError):
        BackendDescriptor(999)  # no such kind: refused before cuDNN is asked


def test_a_bad_value_is_refused_at_finalize_and_a_finalized_descriptor_is_read_only(finalizing):
    # cuDNN's reason from 9.21 on; an older one's (ptrDesc->finalize()) says no more than the descriptor named
    reason = "not a valid tensor data type" if cudnn.load_library().version >= 92100 else r"\[TENSOR_DESCRIPTOR\]"
    with tensor(1, [2, 3, 4, 5], [60, 20, 5, 1], dtype=cudnn.DataType.FAST_FLOAT_FOR_FP8) as t:
        with pytest.raises(cudnn.CudnnBadParamError, match=reason):
            t.finalize()  # a data type no tensor may have
        assert not t.finalized
    with tensor(1, [2, 3, 4, 5], [60, 20, 5, 1]) as t:
        t.finalize()
        with pytest.raises(cudnn.CudnnBadParamError):
            t.set(A.TENSOR_UNIQUE_ID, T.INT64, 2)
        assert t.get_one(A.TENSOR_UNIQUE_ID, T.INT64) == 1


def test_a_forgotten_descriptor_is_destroyed_quietly_when_collected():
    t = tensor(1, [1, 1, 1, 1], [1, 1, 1, 1])
    finalizer = t._finalizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del t
        gc.collect()
    assert not finalizer.alive


def _since_in_headers() -> dict[str, int]:
    """Attribute name (without ``CUDNN_ATTR_``) -> the version its ``@since cuDNN X.Y.Z`` comment in the headers
    gives (9.2.0 -> 90200)."""
    import re

    import cudnn_headers

    text = (cudnn_headers.header_directory() / "cudnn_graph.h").read_text()
    pattern = re.compile(r"^\s*CUDNN_ATTR_(\w+)\b[^=\n]*=\s*\d+,.*@since cuDNN (\d+)\.(\d+)\.(\d+)", re.MULTILINE)
    return {m[1]: int(m[2]) * 10000 + int(m[3]) * 100 + int(m[4]) for m in pattern.finditer(text)}


def test_a_ctrl_c_anywhere_in_a_cudnn_call_is_a_keyboard_interrupt():
    """ctypes reads an argument's ``_as_parameter_``, Python code, and turns what it raises into ArgumentError: a
    Ctrl-C landing there came out as ``ArgumentError: argument 1: KeyboardInterrupt:`` (``wsarena report`` exited
    3 with that line, planning). Every place of a call where CPython runs a signal handler is tried; only
    KeyboardInterrupt may come out (another exception fails the test)."""
    from .interrupts import interrupt_at_check

    t = BackendDescriptor(D.TENSOR_DESCRIPTOR)
    t.set(A.TENSOR_UNIQUE_ID, T.INT64, 1)  # the function declared first: a run interrupted there declares it again
    n = 1
    while interrupt_at_check(n, t.set, A.TENSOR_UNIQUE_ID, T.INT64, 1):
        n += 1
    assert n > 20  # the call's own checks were reached
    t.close()


def test_attributes_newer_than_cudnn_9_0_that_wsarena_uses_are_gated_by_their_version():
    """OPTIONAL_ATTRIBUTES holds, with the headers' version, every attribute the graph code sets or reads that
    cuDNN 9.0 lacks: reading ENGINECFG_WORKSPACE_SIZE (9.2) on 9.0 or 9.1 would fail for every geometry."""
    import re

    import cudnn_headers

    from wsarena.cudnn import backend

    version = cudnn_headers.header_version()
    if (version.major, version.minor) < (9, 22):
        pytest.skip(f"the installed headers are cuDNN {version}: they give attributes their version from 9.22 on")
    since = _since_in_headers()
    assert since["ENGINECFG_WORKSPACE_SIZE"] == 90200 and since["TENSOR_UNIQUE_ID"] == 90000  # the pattern reads
    used = {name for module in Path(backend.__file__).parent.glob("*.py") if module.name != "_enums.py"
            for name in re.findall(r"\b(?:A|BackendAttributeName)\.([A-Z_0-9]+)\b", module.read_text())}
    assert {"ENGINECFG_WORKSPACE_SIZE", "DEVICEPROP_JSON_REPRESENTATION", "EXECUTION_PLAN_WORKSPACE_SIZE"} <= used
    newer = {name: since[name] for name in used if name in since and since[name] > 90000}
    assert {a.name: v for a, v in backend.OPTIONAL_ATTRIBUTES.items()} == newer


def test_has_attribute_follows_the_loaded_version(monkeypatch):
    import dataclasses

    from wsarena.cudnn import _library, backend

    real = _library.load_library()
    assert backend.has_attribute(A.ENGINECFG_WORKSPACE_SIZE) and backend.has_attribute(A.TENSOR_UNIQUE_ID)
    monkeypatch.setattr(_library, "_loaded", dataclasses.replace(real, version=90100))
    assert not backend.has_attribute(A.ENGINECFG_WORKSPACE_SIZE) and backend.has_attribute(A.TENSOR_UNIQUE_ID)
    monkeypatch.setattr(_library, "_loaded", dataclasses.replace(real, version=90200))
    assert backend.has_attribute(A.ENGINECFG_WORKSPACE_SIZE)
