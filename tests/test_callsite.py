"""The line a warning names: that of the innermost reported_at block in force, else the caller's."""

import warnings

import pytest

from wsarena import _callsite


def _named() -> tuple[str, int]:
    """The file and line a warning given here names."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _callsite.warn("a warning", UserWarning)
    (found,) = caught
    return found.filename, found.lineno


def test_a_reported_at_block_names_its_site_and_gives_back_the_one_before_however_it_ends():
    outer, inner = ("outer.py", 10, {}), ("inner.py", 20, {})
    before = _named()
    with _callsite.reported_at(outer):
        assert _named() == ("outer.py", 10)
        with _callsite.reported_at(inner):
            assert _named() == ("inner.py", 20)
        assert _named() == ("outer.py", 10)
        with pytest.raises(KeyError), _callsite.reported_at(inner):
            raise KeyError("ends the block")
        assert _named() == ("outer.py", 10)
        with _callsite.reported_at(None):  # None: the calling line, as outside any block
            assert _named()[0] == __file__
    assert _named()[0] == before[0] == __file__
    assert _callsite._site.get() is None
