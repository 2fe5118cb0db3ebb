"""Call-signature keys: what may key a remembered call, and the one bound that the ops' records and wsarena.torch's
checked geometries both keep."""

import numpy as np
import pytest

import wsarena
from wsarena import _callkeys, ops


def test_lists_freeze_into_tuples_and_what_equals_an_int_is_not_a_key():
    assert _callkeys.freeze_params((1, [2, 3], (4, [5]), None)) == (1, (2, 3), (4, (5,)), None)
    assert _callkeys.freeze("NCHW") == "NCHW"
    # True == 1 and 1.0 == 1 as keys, yet neither is a valid parameter: such a call is checked every time
    for bad in (True, 1.0, np.int64(1), [1, True], [1, 2.0]):
        assert _callkeys.freeze_params((bad, 0, 1, 1)) is None
        with pytest.raises(_callkeys.Uncacheable):
            _callkeys.freeze(bad)


def test_a_full_table_is_emptied_before_the_next_signature(monkeypatch):
    monkeypatch.setattr(_callkeys, "RECORDS_MAX", 3)
    table: dict[int, str] = {}
    for key in range(3):
        _callkeys.remember(table, key, str(key))
    assert table == {0: "0", 1: "1", 2: "2"}
    _callkeys.remember(table, 3, "3")
    assert table == {3: "3"}


def test_the_ops_records_keep_the_shared_bound(monkeypatch):
    monkeypatch.setattr(_callkeys, "RECORDS_MAX", 3)
    ops.records_clear()
    w = np.ones((1, 1, 1, 1), np.float32)
    for size in range(1, 8):
        x = np.full((1, 1, size, size), 2, np.float32)
        np.testing.assert_array_equal(wsarena.conv_forward(x, w), x)  # a 1x1 filter of ones: y is x
        assert 1 <= len(ops._records) <= 3


def test_wsarena_torch_geometries_keep_the_shared_bound(monkeypatch):
    pytest.importorskip("torch")
    from wsarena.torch import _shapes

    monkeypatch.setattr(_callkeys, "RECORDS_MAX", 3)
    monkeypatch.setattr(_shapes, "_remembered", {})
    for size in range(3, 10):
        geom = _shapes.forward_geometry((1, 1, size, size), (1, 1, 3, 3), [1, 1], [0, 0], [1, 1], 1)
        assert geom.input_size == (size, size)
        assert 1 <= len(_shapes._remembered) <= 3
