"""What ``stream=`` accepts: raw handles, stream objects, ``__cuda_stream__``, CPU lane keys; what it refuses."""

import copy
import gc
import pickle
import threading
import weakref

import pytest

from wsarena.arena.streams import PerThreadStream, ThreadLane, resolve_stream, stream_handle, thread_lane


class ProtocolStream:
    def __init__(self, handle, version=0):
        self.handle = handle
        self.version = version

    def __cuda_stream__(self):
        return (self.version, self.handle)


class PtrStream:  # an older CuPy stream: only .ptr
    def __init__(self, ptr):
        self.ptr = ptr


class TorchLikeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class HandleObject:  # cuda.core hands out handle objects that convert with int()
    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value


def device(stream, current=lambda: 0):
    return resolve_stream(stream, lanes=False, current=current)


@pytest.mark.parametrize("handle", [0, 1, 3, 0x7F3A_0000_1230])
def test_raw_ints_are_handles(handle):
    assert device(handle) == (handle, None)
    assert stream_handle(handle) == handle


def test_the_legacy_null_stream_is_one_key_for_every_thread():
    keys = []
    t = threading.Thread(target=lambda: keys.append(device(0)[0]))
    t.start()
    t.join()
    assert keys == [0] == [device(0)[0]] and type(keys[0]) is int


# ------------------------------------------------------------------------- the per-thread default stream
def other_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(5)
    return out[0]


def test_handle_2_is_keyed_by_the_calling_thread():
    key, anchor = device(2)
    assert type(key) is PerThreadStream and not isinstance(key, int)  # a key of its own, not an int
    assert key.handle == 2 and type(key.handle) is int  # providers and CUDA calls still get handle 2
    assert key.lane is thread_lane() and anchor.lane is thread_lane()  # anchor: dies with the thread
    assert device(2) == (key, anchor) and device(2)[0] is key  # one key per thread
    # not (a == b) asks __eq__ itself, beside != (__ne__): SIM201's rewrite to != would drop that check
    assert key != 2 and 2 != key and not (key == 2) and key not in {2: None}  # nor the bare handle  # noqa: SIM201
    theirs = other_thread(lambda: device(2)[0])
    assert type(theirs) is PerThreadStream and theirs.handle == 2
    assert theirs != key and not (theirs == key) and len({key, theirs}) == 2  # noqa: SIM201
    assert "PerThreadStream" in repr(key) and "MainThread" in repr(key)


@pytest.mark.parametrize("stream", [ProtocolStream(2), PtrStream(2), TorchLikeStream(2)])
def test_stream_objects_with_handle_2_and_none_get_the_same_per_thread_key(stream):
    mine = device(2)[0]
    assert device(stream)[0] is mine
    assert device(None, current=lambda: stream)[0] is mine  # CuPy's current stream is Stream.ptds
    assert device(None, current=lambda: 2)[0] is mine
    assert device(mine)[0] is mine  # a key passed back as stream= is this thread's handle 2 again
    assert other_thread(lambda: device(mine)[0]) is not mine  # ...in whichever thread passes it


def test_stream_handle_of_the_per_thread_stream_is_the_plain_int_2():
    for stream in (2, ProtocolStream(2), PtrStream(2), device(2)[0]):
        handle = stream_handle(stream)
        assert handle == 2 and type(handle) is int


def test_per_thread_keys_copy_as_themselves_and_pickle_as_the_handle():
    key = device(2)[0]
    assert copy.copy(key) is key and copy.deepcopy({key: 1}) == {key: 1}
    restored = pickle.loads(pickle.dumps(key))
    assert restored == 2 and type(restored) is int


def test_handle_2_is_a_plain_lane_key_on_the_host():
    assert resolve_stream(2, lanes=True) == (2, None)
    assert type(resolve_stream(2, lanes=True)[0]) is int


def test_cuda_stream_protocol():
    s = ProtocolStream(0xABC)
    key, anchor = device(s)
    assert key == 0xABC and anchor is s
    assert stream_handle(s) == 0xABC


def test_cuda_stream_protocol_with_a_handle_object():
    assert device(ProtocolStream(HandleObject(99)))[0] == 99


def test_ptr_and_cuda_stream_attributes():
    assert device(PtrStream(5))[0] == 5
    assert device(TorchLikeStream(6))[0] == 6
    assert stream_handle(TorchLikeStream(6)) == 6


def test_none_is_the_current_stream():
    current = ProtocolStream(1234)
    key, anchor = device(None, current=lambda: current)
    assert key == 1234 and anchor is current
    assert device(None, current=lambda: 3) == (3, None)


def test_none_without_a_current_stream_is_a_type_error():
    with pytest.raises(TypeError, match="current stream"):
        resolve_stream(None, lanes=False)


@pytest.mark.parametrize("current", [None, "junk"])
def test_a_current_stream_that_is_none_says_it_is_the_providers(current):
    with pytest.raises(TypeError, match=rf"stream=None: the provider's current stream, {current!r}, is not a CUDA"):
        device(None, current=lambda: current)


@pytest.mark.parametrize("bad", ["lane", 1.5, b"x", object(), [3], True, PtrStream("nope")])
def test_device_refuses_other_kinds_naming_the_value(bad):
    with pytest.raises(TypeError) as info:
        device(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError):
        stream_handle(bad)


@pytest.mark.parametrize("reply", [None, (1,), "ab", (0, "x"), (0, None)])
def test_bad_cuda_stream_replies_are_type_errors(reply):
    class Bad:
        def __cuda_stream__(self):
            return reply

    with pytest.raises(TypeError, match="stream="):
        device(Bad())


def test_negative_handles_are_value_errors():
    with pytest.raises(ValueError, match="negative"):
        device(-1)
    with pytest.raises(ValueError, match="negative"):
        device(ProtocolStream(-5))


def test_objects_without_weakrefs_have_no_anchor():
    class Slotted:
        __slots__ = ()

        def __cuda_stream__(self):
            return (0, 8)

    assert device(Slotted()) == (8, None)


# ------------------------------------------------------------------------------------------- CPU lanes
def test_lanes_none_is_this_threads_lane():
    key, anchor = resolve_stream(None, lanes=True)
    assert key is thread_lane() and isinstance(key, ThreadLane)
    assert anchor is not None and anchor.lane is key
    assert "MainThread" in repr(key)


def test_each_thread_gets_its_own_lane():
    lanes = []
    t = threading.Thread(target=lambda: lanes.append(thread_lane()))
    t.start()
    t.join()
    assert lanes[0] is not thread_lane()
    assert lanes[0] != thread_lane()


@pytest.mark.parametrize("key", ["lane-a", 3, ("layer", 2), 2.5])
def test_any_hashable_is_a_lane_key(key):
    assert resolve_stream(key, lanes=True) == (key, None)


@pytest.mark.parametrize("key", [frozenset({1}), ProtocolStream(4)])
def test_a_lane_key_object_that_can_be_weakly_referenced_is_its_own_anchor(key):
    """Its lane goes when it dies (the table holds it weakly)."""
    assert resolve_stream(key, lanes=True) == (key, key)


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {1}])
def test_unhashable_lane_keys_are_type_errors(bad):
    with pytest.raises(TypeError, match="hashable"):
        resolve_stream(bad, lanes=True)


def test_cupy_stream_makes_an_object_for_each_call_over_one_kept_cuda_core_object():
    """CuPy's object for a handle is new each time (CuPy's stream-ordered allocator frees an array on the object it
    was allocated under while that lives: it must die with the call that made it current), tied to no device; the
    cuda.core object under it, 5 to 9 us to make, is kept for the next call on that handle. The default streams are
    CuPy's own objects, which neither take nor evict it. Real CuPy and cuda.core objects: none needs a GPU."""
    import cupy

    from wsarena.arena.streams import core_stream, cupy_stream

    first = cupy_stream(0x1234)
    gone = weakref.ref(first)
    core = core_stream(0x1234)
    second = cupy_stream(0x1234)
    assert first is not second and isinstance(second, cupy.cuda.Stream)
    assert (first.ptr, first.device_id) == (second.ptr, second.device_id) == (0x1234, -1)
    del first
    gc.collect()
    assert gone() is None and core.__cuda_stream__() == (0, 0x1234)
    assert cupy_stream(0) is cupy.cuda.Stream.null and cupy_stream(2) is cupy.cuda.Stream.ptds
    assert core_stream(0x1234) is core
    assert core_stream(0x4321) is not core and core_stream(0x1234) is core  # kept by handle, several at once


def test_stream_to_enter_enters_nothing_for_the_current_stream_and_a_cupy_object_for_another():
    """What the cuDNN backend's scope and wsarena._interop's enter for a stream= on a device: nothing where it is CuPy's
    current stream there (asking it enters nothing), a CuPy stream as it is given, else a CuPy object of the call's
    own for its handle. Real CuPy objects, none needs a GPU; CuPy's current stream of each device a stand-in."""
    import cupy

    from wsarena.arena.streams import stream_to_enter

    current = {0: PtrStream(0x77), 1: PtrStream(0)}
    cuda = type("cuda", (), {"Stream": cupy.cuda.Stream, "get_current_stream": staticmethod(current.__getitem__)})
    given = cupy.cuda.Stream.from_external(ProtocolStream(0x78))
    for stream in (0x77, ProtocolStream(0x77), TorchLikeStream(0x77)):
        assert stream_to_enter(cuda, stream, 0) is None
        made = stream_to_enter(cuda, stream, 1)
        assert isinstance(made, cupy.cuda.Stream) and (made.ptr, made.device_id) == (0x77, -1)
        assert stream_to_enter(cuda, stream, 1) is not made  # one of the call's own
    assert stream_to_enter(cuda, given, 0) is given and stream_to_enter(cuda, 0, 1) is None
    assert stream_to_enter(cuda, cupy.cuda.Stream.from_external(ProtocolStream(0x77)), 0) is None
    with pytest.raises(ValueError, match="negative"):
        stream_to_enter(cuda, -1, 0)


def test_core_stream_keeps_an_object_per_handle_for_streams_used_in_turn(monkeypatch):
    """A program that alternates between side streams makes cuda.core's object once per handle, not once per call
    (5 to 9 us each): the objects own nothing, so several are kept, the least recently used going past the bound."""
    from wsarena.arena import streams

    made = []
    from_handle = streams._from_handle
    monkeypatch.setattr(streams, "_from_handle", lambda handle: made.append(handle) or from_handle(handle))
    first, second = streams.core_stream(0x51), streams.core_stream(0x52)
    for _ in range(3):
        assert streams.core_stream(0x51) is first and streams.core_stream(0x52) is second
    assert made == [0x51, 0x52]
    assert first.__cuda_stream__() == (0, 0x51) and second.__cuda_stream__() == (0, 0x52)
    others = range(0x1000, 0x1000 + streams.KEPT_STREAMS)  # as many others as are kept: 0x51 goes, then 0x52
    for handle in others:
        streams.core_stream(handle)
    assert streams.core_stream(0x51) is not first
    assert made == [0x51, 0x52, *others, 0x51]
    streams.forget_kept_stream()
    assert streams.core_stream(0x52) is not second
