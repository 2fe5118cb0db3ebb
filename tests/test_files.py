"""Reading a file that must be a regular one, or a pipe where the caller takes one (wsarena._files), as the model
loader, the device properties and the search cache read theirs. Each caller's own refusals are tested with it:
test_models, test_planner, test_searchcache."""

from __future__ import annotations

import errno
import io
import os
import stat
import tracemalloc

import pytest

import wsarena
from wsarena import _files, _searchcache_folder, planner

from .pipe_helpers import unblocked, written_pipe

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
    """The file is opened without blocking, so that a FIFO in its place is not waited on until a writer comes; it
    was read from that descriptor still non-blocking, where a file system that honours O_NONBLOCK on a regular file
    (a FUSE one may) can return part of it. Each read of it is asked of a blocking descriptor: os.read's (the
    bounded reads), and FileIO.readall's (a model file, read whole into one buffer)."""
    real_read, blocking = os.read, []

    def recorded(fd, n):
        blocking.append(os.get_blocking(fd))
        return real_read(fd, n)

    class Recorded(io.FileIO):
        def readall(self):
            blocking.append(os.get_blocking(self.fileno()))
            return super().readall()

    monkeypatch.setattr(os, "read", recorded)
    monkeypatch.setattr(io, "FileIO", Recorded)
    read(tmp_path / "file.json")
    assert blocking and all(blocking), blocking


@pytest.mark.parametrize("limit", [len(DATA), len(DATA) + 1, 1 << 20])
def test_a_file_read_in_parts_is_read_whole(tmp_path, monkeypatch, limit):
    """A read may return less than asked for (Linux's at most 2 GiB at a time, for one): the rest is asked for, to
    the end. (A read without a limit is FileIO.readall's, whose reads are not os.read's: in parts below, from a
    pipe.)"""
    path = tmp_path / "data"
    path.write_bytes(DATA)
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real(fd, min(n, 1000)))
    data, st = _files.read_regular_file(path, limit=limit)
    assert data == DATA and st.st_size == len(DATA)


@pytest.mark.parametrize("look_first", [True, False])
def test_a_regular_file_larger_than_the_limit_is_refused_unread(tmp_path, monkeypatch, look_first):
    """A regular file whose status gives more than the limit (a sparse one of 3 GiB here, which takes no disk) is
    refused before anything of it is read, its size said: an ONNX model over protobuf's 2 GiB was read whole before
    protobuf refused it. One that grows past its status as it is read is read to the limit and a byte, no more."""
    path = tmp_path / "large"
    with path.open("wb") as f:
        f.truncate(3 << 30)
    asked = []
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: asked.append(n) or real(fd, n))
    with pytest.raises(_files.TooLarge) as caught:
        _files.read_regular_file(path, limit=(2 << 30) - 1, look_first=look_first)
    assert (caught.value.size, caught.value.limit, asked) == (3 << 30, (2 << 30) - 1, [])
    assert str(caught.value) == f"{3 << 30} bytes, more than {(2 << 30) - 1}"
    path.write_bytes(DATA)
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 10, *real_fstat(fd)[7:])))
    with pytest.raises(_files.TooLarge) as caught:
        _files.read_regular_file(path, limit=4096)  # its status says 10 bytes
    assert (caught.value.size, str(caught.value)) == (None, "more than 4096 bytes") and sum(asked) == 4097


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [None, 1 << 30])
def test_a_whole_file_read_in_parts_is_held_once(tmp_path, limit):
    """Read in parts (a model file over 2 GiB is: Linux reads at most 2 GiB at a time), the parts were joined, and
    the file held twice in memory at the end. A pipe gives 64 KiB a read: 8 MiB read from one, through the reader
    without a limit and with one (an ONNX model's, 2 GiB), take one buffer, which grows as the parts come, where
    parts joined took 16 MiB."""
    data = os.urandom(8 << 20)
    with written_pipe(data) as path:
        tracemalloc.start()
        try:
            read, _ = _files.read_regular_file(path, limit=limit, pipes=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert read == data
    assert peak < 1.5 * len(data), peak


@pytest.mark.parametrize("limit", [None, 16 << 20])
def test_a_regular_file_read_in_one_part_is_held_once(tmp_path, limit):
    """A regular file that one read gives whole (below 2 GiB) is that read's bytes, with a limit too: not copied
    into the buffer that parts are written into, which would hold it twice at the end."""
    data = os.urandom(8 << 20)
    path = tmp_path / "data"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        read, _ = _files.read_regular_file(path, limit=limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read == data
    assert peak < 1.5 * len(data), peak


@pytest.mark.timeout(30)
@pytest.mark.parametrize("limit", [None, 4096])
def test_a_fifo_that_no_writer_has_open_reads_as_empty_where_pipes_are_read(tmp_path, limit):
    """Opened as open() opens it, a FIFO that no writer has open waits until one comes, for good where none comes:
    opened without blocking it is not waited on, and a blocking read of it finds its end at once (the timeout fails
    a wait). Refused unread where the caller takes no pipe."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _files.read_regular_file(fifo, limit=limit, pipes=True)[0] == b""
    for look_first in (True, False):
        with pytest.raises(_files.NotRegularFile, match=r"^a FIFO \(named pipe\)$"):
            _files.read_regular_file(fifo, limit=limit, look_first=look_first)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [None, 4096, len(DATA) * 20, len(DATA) * 20 - 1, 1 << 20])
def test_a_pipe_is_read_to_its_end_or_to_the_limit(monkeypatch, limit):
    """A pipe is read as cat reads it: to the end of what its writer writes (DATA 20 times, in parts), or refused
    once it gives a byte past the limit, and no more is read. Refused unread where the caller takes no pipe."""
    data = DATA * 20
    parts = []
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: parts.append(real(fd, n)) or parts[-1])
    with written_pipe(data) as path:
        if limit is None or limit >= len(data):
            read, st = _files.read_regular_file(path, limit=limit, pipes=True)
            assert read == data and stat.S_ISFIFO(st.st_mode)
        else:
            with pytest.raises(_files.TooLarge) as caught:
                _files.read_regular_file(path, limit=limit, pipes=True)
            assert (caught.value.size, caught.value.limit, sum(map(len, parts))) == (None, limit, limit + 1)
    with written_pipe(b"") as path, pytest.raises(_files.NotRegularFile, match=r"^a FIFO \(named pipe\)$"):
        _files.read_regular_file(path, limit=limit)


def test_a_part_of_a_regular_file_is_read_in_parts_and_a_fifo_is_refused(tmp_path, monkeypatch):
    """read_regular_part (a small tensor in an ONNX model's external data) reads the bytes asked for, in as many
    reads as it takes, fewer where the file ends sooner; a FIFO, even one that the look before the open took for a
    regular file (put in its place meanwhile), is refused, not waited on until a writer comes."""
    (tmp_path / "data").write_bytes(DATA)
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "data").write_bytes(DATA)
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real(fd, min(n, 1000)))
    assert _files.read_regular_part(tmp_path, "data", 100, 5000) == DATA[100:5100]
    assert _files.read_regular_part(tmp_path, "data", 0, 5001) == DATA[:5001]  # a last read of one byte
    assert _files.read_regular_part(tmp_path, "data", len(DATA) - 10, 5000) == DATA[-10:]
    assert _files.read_regular_part(tmp_path, "data", len(DATA) + 10, 5000) == b""
    assert _files.read_regular_part(tmp_path, "./inner//data", 0, 10) == DATA[:10]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_stat, regular = os.stat, os.stat(tmp_path / "data")
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: regular if os.fspath(p) == "fifo" else real_stat(p, *a, **k))
    with pytest.raises(_files.NotRegularFile, match=r"^a FIFO \(named pipe\)$"):
        unblocked(lambda: _files.read_regular_part(tmp_path, "fifo", 0, 32), fifo)


def test_a_part_is_read_beneath_its_folder_through_no_link_as_onnx_reads_it(tmp_path, monkeypatch):
    """What onnx's loader refuses (onnx.checker's checks, then openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    read_regular_part refuses: a location absolute, empty or with ".." in it, or naming a folder ("data/", which
    normpath() makes "data"), a link on the way, even to a file or a folder inside the folder, a file of several hard
    links; onnx's own loader is the reference for each. The path was
    resolved (realpath), then opened as it was by then, links followed: a link put in the place of the file after
    the look is refused too, not followed out of the folder."""
    from onnx import TensorProto
    from onnx.external_data_helper import load_external_data_for_tensor

    folder = tmp_path / "model"
    (folder / "inner").mkdir(parents=True)
    (folder / "data").write_bytes(DATA)
    (folder / "a..b").write_bytes(DATA)
    (folder / "twice").write_bytes(DATA)
    os.link(folder / "twice", folder / "hard")
    (folder / "inner" / "data").write_bytes(DATA)
    (folder / "folder-link").symlink_to("inner")
    (folder / "inner-link").symlink_to(folder / "data")
    (tmp_path / "secret").write_bytes(b"S" * 64)
    (folder / "out-link").symlink_to(tmp_path / "secret")

    def onnx_reads(location):
        tensor = TensorProto(name="t", data_type=TensorProto.UINT8, dims=[16], data_location=TensorProto.EXTERNAL)
        for key, value in (("location", location), ("offset", "0"), ("length", "16")):
            tensor.external_data.add(key=key, value=value)
        try:
            load_external_data_for_tensor(tensor, str(folder))
        except Exception:  # noqa: BLE001 - onnx raises several types
            return None
        return tensor.raw_data

    refused = (ValueError, OSError, _files.NotRegularFile)
    for location, reads in [("data", True), ("inner/data", True), ("inner/../data", True), ("", False), (".", False),
                            (str(folder / "data"), False), ("../model/data", False), ("a..b", False),
                            ("hard", False), ("twice", False), ("folder-link/data", False), ("inner-link", False),
                            ("out-link", False), ("missing", False), ("data/", False), ("data/.", False),
                            ("inner/data/", False), ("inner/", False), ("folder-link/", False), ("inner-link/", False)]:
        assert (onnx_reads(location) is not None) == reads, location
        if reads:
            assert _files.read_regular_part(folder, location, 0, 16) == onnx_reads(location) == DATA[:16]
        else:
            with pytest.raises(refused):
                _files.read_regular_part(folder, location, 0, 16)
    with pytest.raises(_files.NotRegularFile, match=r"^a symbolic link$") as caught:
        _files.read_regular_part(folder, "out-link", 0, 16)
    assert caught.value.folder is False
    with pytest.raises(_files.NotRegularFile, match=r"^a file of 2 hard links$") as caught:
        _files.read_regular_part(folder, "hard", 0, 16)
    assert caught.value.folder is False
    # the look made to see the file the link was before it was put there: the open follows no link either
    real_stat, regular = os.stat, os.stat(folder / "data")
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: regular if os.fspath(p) == "out-link" else
                        real_stat(p, *a, **k))
    with pytest.raises(OSError) as caught:
        _files.read_regular_part(folder, "out-link", 0, 16)
    assert caught.value.errno == errno.ELOOP


@pytest.mark.skipif(not _files.OPENS_BENEATH, reason="read_regular_part opens a file beneath a folder")
@pytest.mark.parametrize("words", ["this Python's", "CPython 3.13's"])
def test_a_nul_in_a_parts_path_is_refused_as_read_regular_file_refuses_one(tmp_path, monkeypatch, words):
    """A NUL in the location of an ONNX model's external data, or in its folder: read_regular_part relayed what
    os.open or os.stat raised, which CPython 3.13 words as "open: embedded null character in path", where
    read_regular_file refuses a NUL itself, in the words of 3.11 and 3.12 ("embedded null byte"). Both say it so on
    each Python (3.13's words are put in os's functions here, for the older ones)."""
    (tmp_path / "inner").mkdir()
    (tmp_path / "data").write_bytes(DATA)
    (tmp_path / "inner" / "data").write_bytes(DATA)
    if words != "this Python's":
        for name in ("open", "stat"):
            real = getattr(os, name)

            def said(path, *args, name=name, real=real, **kwargs):
                if "\0" in os.fsdecode(path):
                    raise ValueError(f"{name}: embedded null character in path")
                return real(path, *args, **kwargs)

            monkeypatch.setattr(os, name, said)
    for folder, location in [(tmp_path, "da\0ta"), (tmp_path, "inner/da\0ta"), (tmp_path, "in\0ner/data"),
                             (f"{tmp_path}\0", "data"), (os.fsencode(tmp_path) + b"\0", "data")]:
        with pytest.raises(ValueError) as info:
            _files.read_regular_part(folder, location, 0, 16)
        assert str(info.value) == "embedded null byte", (folder, location)
    with pytest.raises(ValueError) as info:
        _files.read_regular_file(tmp_path / "da\0ta")
    assert str(info.value) == "embedded null byte"
    assert _files.read_regular_part(tmp_path, "inner/data", 0, 16) == DATA[:16]  # os's functions read as before


@pytest.mark.parametrize("pipes", [False, True])
def test_a_device_a_socket_and_a_folder_are_refused_even_where_pipes_are_read(tmp_path, monkeypatch, pipes):
    """Only a FIFO is read where the caller takes pipes: a character device may have no end (/dev/zero)."""
    import socket

    monkeypatch.chdir(tmp_path)  # a socket's path is short: at most 107 bytes
    os.symlink(os.devnull, "null")
    os.mkdir("folder")
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k))
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind("sock")
        for name, kind, folder in (("null", "a character device", False), ("folder", "a folder", True),
                                   ("sock", "a socket", False)):
            with pytest.raises(_files.NotRegularFile) as caught:
                _files.read_regular_file(name, pipes=pipes)
            assert (caught.value.kind, caught.value.folder) == (kind, folder)
        assert opened == []  # each is looked at first: a device is not even opened (opening one may do something)
        # read beneath a folder, each is looked at before it is opened (a device is not even opened, nor a FIFO,
        # whose open would let a writer waiting on it go on) and said as such, where the open refuses a socket
        # (ENXIO) without saying what it is
        os.mkfifo("fifo")
        for name, kind, folder in (("folder", "a folder", True), (".", "a folder", True), ("sock", "a socket", False),
                                   ("fifo", "a FIFO (named pipe)", False)):
            opened.clear()
            with pytest.raises(_files.NotRegularFile) as caught:
                _files.read_regular_part(tmp_path, name, 0, 16)
            assert (caught.value.kind, caught.value.folder) == (kind, folder)
            assert opened == [str(tmp_path)]  # the folder alone


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to list the open descriptors")
def test_no_descriptor_is_left_open_by_a_read_or_a_refusal(tmp_path):
    """Each read closes every descriptor it opened (the folders on the way, the file), whether it reads or refuses:
    a caller reading the external data of many tensors, or a lookup per call, would otherwise run out of them."""
    folder = tmp_path / "model"
    (folder / "inner").mkdir(parents=True)
    (folder / "data").write_bytes(DATA)
    (folder / "inner" / "data").write_bytes(DATA)
    os.link(folder / "data", folder / "hard")
    os.mkfifo(folder / "fifo")
    (folder / "link").symlink_to("inner")

    def open_fds():
        return set(os.listdir("/proc/self/fd"))

    before = open_fds()
    assert _files.read_regular_part(folder / "inner", "data", 10, 20) == DATA[10:30]
    assert _files.read_regular_part(folder, "inner/data", 0, 20) == DATA[:20]
    for location, refused in (("hard", _files.NotRegularFile), ("fifo", _files.NotRegularFile),
                              ("link/data", OSError), ("inner/missing", OSError), (".", _files.NotRegularFile)):
        with pytest.raises(refused):
            _files.read_regular_part(folder, location, 0, 16)
    with pytest.raises(OSError):  # lseek refuses a negative offset, once the file is open
        _files.read_regular_part(folder / "inner", "data", -1, 16)
    (folder / "hard").unlink()
    assert _files.read_regular_file(folder / "data")[0] == DATA
    assert _files.read_regular_file(folder / "data", limit=len(DATA))[0] == DATA
    with pytest.raises(_files.TooLarge):
        _files.read_regular_file(folder / "data", limit=10)
    for look_first in (True, False):
        with pytest.raises(_files.NotRegularFile):
            _files.read_regular_file(folder / "fifo", look_first=look_first)
    assert open_fds() == before


def test_an_unexpanded_home_is_suggested_only_where_the_file_was_not_found(tmp_path, monkeypatch):
    """The hint answers "No such file or directory" alone: a path that was found but could not be read (no
    permission, a folder) was the one meant, whatever the home folder holds."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.json").write_text("{}")
    missing = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
    assert _files.unexpanded_home("~/m.json", missing).startswith(" (~ is not expanded")
    for other in (PermissionError(errno.EACCES, os.strerror(errno.EACCES)), IsADirectoryError(errno.EISDIR, "")):
        assert _files.unexpanded_home("~/m.json", other) == ""
    assert _files.unexpanded_home("m.json", missing) == ""  # no ~ to expand
