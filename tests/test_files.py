"""Reading a file that must be a regular one (wsarena._files), as the model loader, the device properties and the
search cache read theirs. Each caller's own refusals are tested with it: test_models, test_planner,
test_searchcache."""

from __future__ import annotations

import os

import pytest

import wsarena
from wsarena import _files, _searchcache_folder, planner

DATA = bytes(range(256)) * 40  # 10 KiB, no two neighbouring parts alike


def _model(path):
    path.write_text('[{"name": "c", "input_shape": [1, 3, 8, 8], "weight_shape": [4, 3, 3, 3]}]')
    assert [layer.name for layer in wsarena.load_model(path)] == ["c"]


def _properties(path):
    path.write_text("{}")
    assert planner._read_properties(str(path)) == "{}"


def _entry(path):
    path.write_text("{}")
    assert _searchcache_folder.read_entry(path)[0] == "{}"


@pytest.mark.parametrize("read", [_model, _properties, _entry], ids=["model", "device properties", "search entry"])
def test_a_regular_file_is_read_from_a_blocking_descriptor(tmp_path, monkeypatch, read):
    """The file is opened without blocking, so that a FIFO in its place is refused rather than waited on; it was read
    from that descriptor still non-blocking, where a file system that honours O_NONBLOCK on a regular file (a
    FUSE one may) can return part of it. Each read of it is asked of a blocking descriptor."""
    real, blocking = os.read, []

    def recorded(fd, n):
        blocking.append(os.get_blocking(fd))
        return real(fd, n)

    monkeypatch.setattr(os, "read", recorded)
    read(tmp_path / "file.json")
    assert blocking and all(blocking), blocking


@pytest.mark.parametrize("limit", [None, 4096, len(DATA), len(DATA) - 1])
def test_a_file_read_in_parts_is_read_whole_or_to_its_limit(tmp_path, monkeypatch, limit):
    """A read may return less than asked for (Linux's at most 2 GiB at a time, for one): the rest is asked for, to
    the end, or to the limit and a byte past it, which tells the caller that the file is larger."""
    path = tmp_path / "data"
    path.write_bytes(DATA)
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real(fd, min(n, 1000)))
    data, st = _files.read_regular_file(path, limit=limit)
    assert data == (DATA if limit is None else DATA[:limit + 1]) and st.st_size == len(DATA)
