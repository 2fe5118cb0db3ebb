"""Property-based test of pinning: random eager leases (some held across steps, under which a reserve grows the
buffer), reserves, captures (of one stream or forked to two), leases during them, graphs closed, trims, a stream
object dropped (its handle then naming the same stream or another), the arena closed and replaced by a new one (as
get_arena() replaces it, nothing else referring to it), in debug mode, on a device-like arena whose capture status the
test controls.

A model tracks, per stream, the buffer the arena holds (its address and size) and the one outgrown under a held
lease, and, per graph, the buffers it captured. After every step: a lease during a capture gets its stream's buffer
as it is, or a CaptureError where that is too small; no buffer a live graph holds was freed; ``stats()`` sizes and
pinned bytes (per stream and in all) are the model's; the provider holds the streams' buffers, those pinned (by a
closed arena's graphs too), and at most those whose free waits for a capture under way; and nothing was freed on a
stream being captured, nor with no stream while a capture that an arena of the device knows of goes on.
"""

import gc
import weakref

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import wsarena
import wsarena._config
from wsarena.arena import Arena
from wsarena.arena._stats import aligned_size
from wsarena.arena.testing import FakeStream, RecordingProvider
from wsarena.errors import CaptureError

HANDLES = (0x51, 0x52, 0x53)  # raw stream handles; 0x53 is reached through a stream object that may be dropped
OBJECT = 0x53
SIZES = st.one_of(st.integers(0, 5000), st.integers(5000, 200_000), st.sampled_from([1, 256, 257, 8192]))
KEY = st.sampled_from(HANDLES)


class _Graph:
    __slots__ = ("closed", "fake", "leased", "pinned", "streams")

    def __init__(self, fake, streams):
        self.fake, self.streams = fake, streams
        self.pinned = {}  # ptr -> (size, handle, frees made before, arena) of each buffer it captured
        self.leased = False  # a lease that takes bytes was captured: the arena knows of the capture
        self.closed = False

    @property
    def capturing(self):
        return bool(self.streams)


class PinningMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        wsarena._config._reset()
        wsarena.configure(debug=True)
        self.provider = RecordingProvider(device_id=0)
        self.arena = Arena(self.provider)
        self.buffer = dict.fromkeys(HANDLES)  # handle -> (ptr, size) of the buffer its sub-arena holds, or None
        self.graphs = []
        self.stream = FakeStream(OBJECT)  # the live stream object of OBJECT's stream, or None
        self.stream_id = 1
        self.provider.stream_ids[OBJECT] = self.stream_id
        self.orphan = False  # OBJECT's stream object died since its buffer was last used: no lease adopted it yet
        self.watched_id = None  # the id of the stream whose object watches OBJECT's buffer
        self.frees_seen = 0  # the provider's frees the invariants have looked at
        self.unstreamed = set()  # ptr of each buffer a graph holds whose stream the arena forgot: freed with no stream
        self.held = {}  # handle -> (Workspace, (ptr, size) of the buffer it uses) of a lease held across steps
        self.retired = {}  # handle -> (ptr, size) of the buffer a reserve outgrew under the held lease
        # id of each Buffer the arena allocated -> (the Buffer, the handle it was allocated for, the arena's generation)
        self.owners = {}
        self.generation = 0  # how many times the arena was replaced: the arena a pinned buffer is of
        self.closed = []  # weak references to the arenas replaced

    def teardown(self):
        for ws, _ in getattr(self, "held", {}).values():
            ws.__exit__(None, None, None)
        for graph in getattr(self, "graphs", []):
            if graph.capturing:
                self.provider.end_capture(graph.fake)
            graph.fake.close()
        wsarena._config._reset()

    # ------------------------------------------------------------------------------------------ helpers
    def _stream(self, handle):
        """What a call passes as ``stream=``: the stream object for OBJECT (made again once dropped)."""
        if handle != OBJECT:
            return handle
        if self.stream is None:
            self.stream = FakeStream(OBJECT)
        return self.stream

    def _adopt(self, handle):
        """An eager lease or reserve on ``handle``: an orphaned buffer is the stream's if its handle names the same
        stream still, else it is let go."""
        if handle == OBJECT and self.orphan:
            self.orphan = False
            if self.provider.stream_ids[OBJECT] != self.watched_id:
                self.buffer[OBJECT] = None
                for graph in self.graphs:  # what graphs hold of the dead stream is no longer the handle's
                    for ptr, (size, owner, before, generation) in graph.pinned.items():
                        if owner == OBJECT and generation == self.generation:
                            graph.pinned[ptr] = (size, ("gone", self.watched_id), before, generation)

    def _sync(self):
        """What the arena let go of its own accord: an orphaned buffer, once the sub-arena is forgotten (by a trim,
        or when another stream's sub-arena is made)."""
        if self.orphan:
            sub = self.arena._subs.get(OBJECT)
            if sub is None or sub.block is None or sub.block.ptr != self.buffer[OBJECT][0]:
                self.buffer[OBJECT] = None
                self.orphan = False

    def _refused(self, error, match, handle, n):
        with pytest.raises(error, match=match), self.arena.lease(n, stream=self._stream(handle)):
            pass

    def _capture_of(self, handle):
        return next((g for g in self.graphs if handle in g.streams), None)

    def _live_pins(self, every=False):
        """ptr -> (size, handle, frees made before it was pinned) of every buffer of the arena (``every``: of the
        arenas replaced too) that a graph not closed holds."""
        pins = {}
        for graph in self.graphs:
            if not graph.closed:
                for ptr, (size, handle, before, generation) in graph.pinned.items():
                    if every or generation == self.generation:
                        pins[ptr] = (size, handle, min(before, pins.get(ptr, (0, 0, before))[2]))
        return pins

    def _grew(self, handle, ptr, n):
        """An eager lease or reserve of ``n`` bytes got ``ptr`` (None: a reserve): the model's buffer of ``handle``."""
        old = self.buffer[handle]
        if old is not None and old[1] >= n:
            assert ptr is None or ptr == old[0]
            return
        size = aligned_size(n)
        current = self.arena._subs[handle].block
        self.owners[id(current.buffer)] = (current.buffer, handle, self.generation)
        assert current.size == size and (ptr is None or ptr == current.ptr)
        if old is not None:
            assert current.ptr != old[0]
            if handle in self.held and self.held[handle][1] == old:
                self.retired[handle] = old  # the held lease goes on using it
        elif handle == OBJECT:
            self.watched_id = self.provider.stream_ids[OBJECT]
        self.buffer[handle] = (current.ptr, size)

    # --------------------------------------------------------------------------------------------- rules
    @rule(handle=KEY, n=SIZES)
    def eager_lease(self, handle, n):
        if self._capture_of(handle) is not None:
            return
        if n and handle in self.held:
            self._refused(RuntimeError, "already holds a lease", handle, n)
            return
        if n:
            self._adopt(handle)
        with self.arena.lease(n, stream=self._stream(handle)) as ws:
            if n:
                self._grew(handle, ws.ptr, n)
        self._sync()

    @rule(handle=KEY, n=SIZES)
    def reserve(self, handle, n):
        try:
            self._reserve(handle, n)
        finally:
            self._sync()

    def _reserve(self, handle, n):
        graph = self._capture_of(handle)
        held = self.buffer[handle][1] if self.buffer[handle] is not None else 0
        if graph is not None and n and handle == OBJECT and self.orphan:
            with pytest.raises(CaptureError, match="stream object that is gone"):
                self.arena.reserve(n, stream=self._stream(handle))
            return
        if graph is not None and n > held:
            with pytest.raises(CaptureError, match="needs the arena to grow"):
                self.arena.reserve(n, stream=self._stream(handle))
            return
        if n and graph is None:
            self._adopt(handle)
        self.arena.reserve(n, stream=self._stream(handle))
        if n:
            self._grew(handle, None, n)
        self._sync()

    @rule(data=st.data())
    def begin_capture(self, data):
        """A capture of one stream, or forked to two; mostly of streams that hold a buffer."""
        free = [h for h in HANDLES if self._capture_of(h) is None]
        sized = [h for h in free if self.buffer[h] is not None]
        if not free:
            return
        pick = st.sampled_from(sized) if sized and data.draw(st.integers(0, 3)) else st.sampled_from(free)
        handles = data.draw(st.lists(pick, min_size=1, max_size=2, unique=True))
        fake = self.provider.begin_capture(*handles)
        self.graphs.append(_Graph(fake, set(handles)))

    @precondition(lambda self: any(b is not None and self._capture_of(h) is None for h, b in self.buffer.items()))
    @rule(data=st.data())
    def capture_a_lease(self, data):
        """A whole capture of one lease the stream's buffer holds, on a stream that holds one."""
        handle = data.draw(st.sampled_from([h for h, b in self.buffer.items() if b is not None and not
                                            self._capture_of(h)]))
        fake = self.provider.begin_capture(handle)
        self.graphs.append(_Graph(fake, {handle}))
        try:
            self._captured_lease(data, True, handle)
        finally:
            self.provider.end_capture(fake)
            self.graphs[-1].streams = set()
            self._sync()

    @precondition(lambda self: any(g.capturing for g in self.graphs))
    @rule(data=st.data(), fits=st.booleans())
    def captured_lease(self, data, fits):
        """A lease during a capture: mostly one the stream's buffer holds, else one that would grow it."""
        try:
            self._captured_lease(data, fits)
        finally:
            self._sync()

    def _captured_lease(self, data, fits, handle=None):
        if handle is None:
            handle = data.draw(st.sampled_from(sorted(h for g in self.graphs for h in g.streams)))
        graph = self._capture_of(handle)
        held = self.buffer[handle]
        size = held[1] if held is not None else 0
        n = data.draw(st.integers(min(1, size), size) if fits else st.integers(size + 1, size + 100_000))
        if n and handle == OBJECT and self.orphan:  # whether the handle names the same stream cannot be asked now
            self._refused(CaptureError, "stream object that is gone", handle, n)
            return
        if n and handle in self.held:
            self._refused(RuntimeError, "already holds a lease", handle, n)
            return
        if n > (held[1] if held is not None else 0):
            self._refused(CaptureError, "needs the arena to grow", handle, n)
            return
        with self.arena.lease(n, stream=self._stream(handle)) as ws:
            if n:
                assert ws.ptr == held[0]  # the stream's buffer, as it is
                graph.pinned.setdefault(held[0], (held[1], handle, len(self.provider.frees), self.generation))
                graph.leased = True
        self._sync()

    @rule(handle=st.sampled_from(HANDLES[:2]), n=st.integers(1, 50_000))
    def hold_lease(self, handle, n):
        """An eager lease held across the steps that follow (on a stream not being captured)."""
        if handle in self.held or self._capture_of(handle) is not None:
            return
        ws = self.arena.lease(n, stream=handle)
        ws.__enter__()
        self._grew(handle, ws.ptr, n)
        self.held[handle] = (ws, self.buffer[handle])
        self._sync()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data):
        handle = data.draw(st.sampled_from(sorted(self.held)))
        ws, _ = self.held.pop(handle)
        ws.__exit__(None, None, None)
        self.retired.pop(handle, None)  # let go (kept aside if a graph holds it)
        self._sync()

    @precondition(lambda self: any(g.capturing for g in self.graphs))
    @rule(data=st.data())
    def end_capture(self, data):
        graph = data.draw(st.sampled_from([g for g in self.graphs if g.capturing]))
        self.provider.end_capture(graph.fake)
        graph.streams = set()

    @precondition(lambda self: any(not g.capturing and not g.closed for g in self.graphs))
    @rule(data=st.data())
    def close_graph(self, data):
        graph = data.draw(st.sampled_from([g for g in self.graphs if not g.capturing and not g.closed]))
        graph.fake.close()
        graph.closed = True

    @rule()
    def trim(self):
        self.arena.trim()
        self._sync()
        pins = self._live_pins()
        for handle, held in self.buffer.items():
            in_use = handle in self.held and self.held[handle][1] == held
            if held is not None and held[0] not in pins and not in_use:
                self.buffer[handle] = None  # let go (its free may wait for a capture on its stream)

    @precondition(lambda self: self.stream is not None)
    @rule(same=st.booleans())
    def drop_stream_object(self, same):
        """The stream object of OBJECT dies; its handle names the same stream again, or a new one."""
        self.stream = None
        gc.collect()
        self.orphan = self.buffer[OBJECT] is not None
        if not same:
            self.stream_id += 1
            self.provider.stream_ids[OBJECT] = self.stream_id

    @rule()
    def replace_arena(self):
        """The arena is closed and replaced by a new one over the same provider, as get_arena() replaces a closed
        arena, and nothing refers to the closed one: the buffers graphs hold of it are freed once they are gone (by
        the new arena's stats(), which the invariant calls), in stream order and not during a capture."""
        for ws, _ in self.held.values():
            ws.__exit__(None, None, None)
        self.held.clear()
        self.retired.clear()
        self.arena.close()
        self.closed.append(weakref.ref(self.arena))
        self.arena = Arena(self.provider)
        self.generation += 1
        self.buffer = dict.fromkeys(HANDLES)
        self.orphan = False

    @rule()
    def release_everything(self):
        """Every lease released, every capture ended and every graph closed: a trim gives every buffer back."""
        for ws, _ in self.held.values():
            ws.__exit__(None, None, None)
        self.held.clear()
        self.retired.clear()
        for graph in self.graphs:
            if graph.capturing:
                self.provider.end_capture(graph.fake)
                graph.streams = set()
            graph.fake.close()
            graph.closed = True
        self.arena.trim()
        assert self.provider.held == [] and self.arena.stats().pinned_bytes == 0
        self.buffer = dict.fromkeys(HANDLES)
        self.orphan = False

    # ------------------------------------------------------------------------------------------ invariants
    @invariant()
    def agrees_with_the_model(self):
        """One invariant, its checks in order: stats() gives back what it may, which the last check looks at."""
        pins = self._live_pins()
        stats = self.arena.stats()
        assert stats.pinned_bytes == sum(size for size, _, _ in pins.values())
        for key, s in stats.streams.items():
            assert type(key) is int  # no lease is under way: none is moved aside as a dead stream's
            current = self.buffer[key]
            assert s.capacity_bytes == (current[1] if current is not None else 0)
            assert s.retired_bytes == (self.retired[key][1] if key in self.retired else 0)
            assert s.leases == (key in self.held)
            assert s.pinned_bytes == sum(size for size, h, _ in pins.values() if h == key)
        # No buffer a live graph holds is freed (an address freed before it was pinned may have been allocated again)
        pins = self._live_pins(every=True)
        held = {buffer.ptr for buffer in self.provider.held}
        for ptr, (_, _, before) in pins.items():
            assert ptr not in [buffer.ptr for buffer, _ in self.provider.frees[before:]] and ptr in held
        # The provider holds the streams' buffers, those pinned, and those whose free waits for a capture: on their
        # stream, or, freed with no stream (a device synchronisation; that of a stream the arena forgot since it was
        # queued, too, even once it uses the handle again), one under way (that the arena knows of, or that it asked
        # about, a stream it knew a capture on before)
        known = any(g.capturing and g.leased for g in self.graphs)
        capturing = any(g.capturing for g in self.graphs)
        arenas = [self.arena] + [arena for arena in (ref() for ref in self.closed) if arena is not None]
        waiting = {
            buffer.ptr for arena in arenas for buffer, stream in arena._to_free
            if self._capture_of(stream) is not None
            or ((stream is None or stream not in arena._subs or buffer.ptr in self.unstreamed) and capturing)
        }
        current = {held[0] for held in self.buffer.values() if held is not None}
        current |= {ptr for ptr, _ in self.retired.values()}
        assert current | set(pins) <= held <= current | set(pins) | waiting
        # A buffer a graph holds whose stream the arena forgot since (a trim found nothing else there, the arena was
        # closed) is freed with no stream: the handle's owner may have destroyed the stream since. So is one whose
        # free was held back while its stream was captured, once the arena forgot that stream. Where the arena forgot
        # it before the last step, with no stream for sure (during the step, the free may have come first, on the
        # stream; or with none, the free held back during the step as the stream was forgotten)
        unstreamed = set(self.unstreamed)
        freed_before = [buffer.ptr for buffer, _ in self.provider.frees[:self.frees_seen]]
        for graph in self.graphs:
            for ptr, (_, handle, before, generation) in graph.pinned.items():
                if ptr not in freed_before[before:] and (
                    generation != self.generation or handle not in self.arena._subs
                ):
                    self.unstreamed.add(ptr)
        for arena in arenas:
            self.unstreamed |= {
                buffer.ptr for buffer, stream in list(arena._to_free)
                if self._capture_of(stream) is not None and stream not in arena._subs
            }
        # Nothing was freed on a stream being captured, nor with no stream while a capture the arena knows goes on;
        # each buffer is freed in its stream's order (with no stream only where that may be gone: OBJECT's, and a
        # forgotten stream's)
        for buffer, stream in self.provider.frees[self.frees_seen:]:
            assert self._capture_of(stream) is None and not (stream is None and known)
            _, handle, generation = self.owners.pop(id(buffer))
            if buffer.ptr in unstreamed:
                assert stream is None
            forgotten = buffer.ptr in self.unstreamed or generation != self.generation or handle not in self.arena._subs
            assert stream == handle or (stream is None and (handle == OBJECT or forgotten))
            self.unstreamed.discard(buffer.ptr)
            unstreamed.discard(buffer.ptr)
        self.frees_seen = len(self.provider.frees)


TestPinning = PinningMachine.TestCase
TestPinning.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
