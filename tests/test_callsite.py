"""The line a warning names: that of the innermost reported_at block in force, else the caller's."""

import sys
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


def test_a_warning_and_caller_name_the_line_that_called_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        _callsite.warn("a warning", UserWarning)
    assert [(found.filename, found.lineno) for found in caught] == [(__file__, line)]
    line = sys._getframe().f_lineno + 1
    site = _callsite.caller()
    assert site[:2] == (__file__, line) and site[2] is globals()
    with _callsite.reported_at(("outer.py", 10, {})):
        assert _callsite.caller()[:2] == ("outer.py", 10)


def test_frames_of_a_skipped_library_are_passed_over(monkeypatch):
    monkeypatch.setattr(_callsite, "_skipped", _callsite._skipped)
    # a library's functions, from a file of a folder that is passed over once it is registered
    library = (
        "def warn():\n    _callsite.warn('a warning', UserWarning)\n\n"
        "def caller():\n    return _callsite.caller()\n"
    )
    scope = {"_callsite": _callsite, "UserWarning": UserWarning}
    exec(compile(library, "/a/library/lib.py", "exec"), scope)  # noqa: S102 - another file's code
    assert scope["caller"]()[:2] == ("/a/library/lib.py", 5)  # not registered yet: the library's line is named
    _callsite.skip("/a/library/")
    _callsite.skip("/a/library/")  # registered once
    assert _callsite._skipped.count("/a/library/") == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        scope["warn"]()
    assert [(found.filename, found.lineno) for found in caught] == [(__file__, line)]
    line = sys._getframe().f_lineno + 1
    assert scope["caller"]()[:2] == (__file__, line)


def test_with_every_frame_skipped_the_outermost_is_named(monkeypatch):
    monkeypatch.setattr(_callsite, "_skipped", ("",))  # every file name starts with ""
    outermost = sys._getframe()
    while outermost.f_back is not None:
        outermost = outermost.f_back
    assert _callsite.caller()[:2] == (outermost.f_code.co_filename, outermost.f_lineno)
