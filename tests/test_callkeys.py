"""Call-signature keys: what may key a remembered call, and the one bound that the ops' records and wsarena.torch's
checked geometries both keep."""

import numpy as np
import pytest

import wsarena
from wsarena import _callkeys, algos, ops


def test_lists_freeze_into_tuples_and_what_equals_an_int_is_not_a_key():
    assert _callkeys.freeze_params((1, [2, 3], (4, [5]), None)) == (1, (2, 3), (4, (5,)), None)
    assert _callkeys.freeze("NCHW") == "NCHW"
    # True == 1 and 1.0 == 1 as keys, yet neither is a valid parameter: such a call is checked every time
    for bad in (True, 1.0, np.int64(1), [1, True], [1, 2.0]):
        assert _callkeys.freeze_params((bad, 0, 1, 1)) is None
        with pytest.raises(_callkeys.Uncacheable):
            _callkeys.freeze(bad)


def test_what_keys_a_call_is_told_whatever_comes_first():
    # ints and tuples of ints are a key as they are; a list is a tuple; text and None stay
    params = (1, (2, 3), 0, 1)
    assert _callkeys.freeze_params(params) is params
    assert _callkeys.freeze([2, 3]) == (2, 3) and type(_callkeys.freeze([2, 3])) is tuple
    assert _callkeys.freeze((2, 3)) == (2, 3) and _callkeys.freeze(()) == ()
    assert (_callkeys.freeze(5), _callkeys.freeze(None), _callkeys.freeze("same")) == (5, None, "same")
    assert _callkeys.freeze(([1, 2], None)) == ((1, 2), None)  # frozen all the way down, with no int at the top
    # what is no key is found wherever it stands: first in a sequence, in a tuple, among no int at all
    for bad in ((2.0, 1), [True, 1], (1, 2.0), (2.0,), [True]):
        with pytest.raises(_callkeys.Uncacheable):
            _callkeys.freeze(bad)
    for params in (((1, 2.0), 0, 1, 1), ((2.0, 1), 0, 1, 1), (2.0, "same", [1, 1], None), ("same", None, 1, True)):
        assert _callkeys.freeze_params(params) is None, params
    assert _callkeys.freeze_params(("same", None, [1, 2], (3,))) == ("same", None, (1, 2), (3,))


def test_the_ops_keep_as_many_signatures_as_the_algorithm_cache_keeps_keys():
    assert _callkeys.RECORDS_MAX == algos.CHOICES_MAX  # as algos says
    table = dict.fromkeys(range(_callkeys.RECORDS_MAX - 1))
    _callkeys.remember(table, -1, None)  # the last that fits
    assert len(table) == _callkeys.RECORDS_MAX
    _callkeys.remember(table, -2, None)
    assert table == {-2: None}


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
