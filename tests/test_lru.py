"""The one cache of costly objects (cuDNN descriptor sets): hits, rebuilds, failures, bounds, races."""

import gc
import os
import threading
import weakref

import pytest

from wsarena._lru import LRU

from .forking import fork


class Thing:
    def __init__(self, key):
        self.key = key
        self.closed = False

    def close(self):
        self.closed = True


def test_the_same_key_gives_the_same_object_and_other_keys_others():
    cache = LRU(8)
    first = cache.get("a", lambda: Thing("a"))
    assert cache.get("a", lambda: Thing("again")) is first
    assert cache.get("b", lambda: Thing("b")) is not first
    assert cache.builds == 2 and len(cache) == 2 and "a" in cache


def test_an_entry_closed_by_mistake_is_built_again():
    cache = LRU(8, valid=lambda t: not t.closed)
    first = cache.get("a", lambda: Thing("a"))
    first.close()
    again = cache.get("a", lambda: Thing("a"))
    assert again is not first and not again.closed
    assert cache.get("a", lambda: Thing("a")) is again


def test_lookup_finds_a_valid_value_builds_nothing_and_makes_it_the_most_recent():
    cache = LRU(2, valid=lambda t: not t.closed)
    assert cache.lookup("a") is None and len(cache) == 0 and cache.builds == 0
    first = cache.get("a", lambda: Thing("a"))
    cache.get("b", lambda: Thing("b"))
    assert cache.lookup("a") is first  # now the most recent: "b" is the one evicted next
    cache.get("c", lambda: Thing("c"))
    assert "a" in cache and "b" not in cache and cache.builds == 3
    first.close()
    assert cache.lookup("a") is None and cache.builds == 3  # closed: a miss, for get() to build again


def test_put_replaces_the_value_makes_it_the_most_recent_and_keeps_the_bound():
    discarded = []
    cache = LRU(2, discard=discarded.append)
    first = cache.get("a", lambda: Thing("a"))
    b = cache.get("b", lambda: Thing("b"))
    second = Thing("a again")
    cache.put("a", second)  # in place of the first, which whoever holds it still uses: not discarded
    assert cache.values() == [b, second]  # the most recent by the put itself, before any lookup
    assert cache.lookup("a") is second and len(cache) == 2 and discarded == [] and not first.closed
    cache.put("c", Thing("c"))
    assert "b" not in cache and "a" in cache and "c" in cache and cache.builds == 4


def test_put_keeps_a_value_the_check_keeps():
    """``keep`` decides on the value the key holds (a valid one): kept, ``put`` changes nothing and says so."""
    cache = LRU(2, valid=lambda t: not t.closed)
    first = Thing("a")
    assert cache.put("a", first, keep=lambda t: True)  # nothing held: in it goes
    assert cache.put("a", Thing("other"), keep=lambda t: t is first) is False and cache.lookup("a") is first
    assert cache.builds == 1
    first.close()  # no longer valid: not kept, whatever the check says
    again = Thing("again")
    assert cache.put("a", again, keep=lambda t: True) and cache.lookup("a") is again


def test_a_failed_build_is_not_cached():
    cache = LRU(8)

    def fail():
        raise ValueError("cannot build")

    for _ in range(2):
        with pytest.raises(ValueError, match="cannot build"):
            cache.get("a", fail)
    assert len(cache) == 0 and cache.builds == 0


def test_it_is_bounded_least_recently_used_first_and_eviction_closes_nothing():
    cache = LRU(3)
    first = cache.get(1, lambda: Thing(1))
    for n in (2, 3):
        cache.get(n, lambda n=n: Thing(n))
    cache.get(1, lambda: Thing("rebuilt"))  # used again: now the most recent
    cache.get(4, lambda: Thing(4))  # evicts 2, the least recently used
    assert len(cache) == 3 and 2 not in cache and 1 in cache
    assert cache.get(1, lambda: Thing("rebuilt")) is first
    assert cache.builds == 4 and not first.closed


def test_of_two_threads_building_one_key_one_object_wins_and_the_other_is_discarded():
    discarded = []
    cache = LRU(8, discard=lambda t: (t.close(), discarded.append(t)))
    both_building = threading.Barrier(2)
    got = []

    def build():
        both_building.wait(5)  # both missed; both build
        return Thing("k")

    threads = [threading.Thread(target=lambda: got.append(cache.get("k", build))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 2 and got[0] is got[1] and not got[0].closed
    assert len(discarded) == 1 and discarded[0].closed and discarded[0] is not got[0]
    assert cache.builds == 1


def test_a_value_inserted_while_a_miss_builds_wins_and_becomes_the_most_recent():
    """What another thread inserts for the key while a miss builds (here the build itself, to order the race) is
    kept and returned, the built one given to ``discard``, and the key made the most recently used, as a hit makes
    it."""
    discarded = []
    cache = LRU(4, discard=discarded.append)
    other, b, built = Thing("other"), Thing("b"), Thing("built")

    def build():
        cache.put("a", other)
        cache.put("b", b)
        return built

    assert cache.get("a", build) is other
    assert discarded == [built] and cache.values() == [b, other]


def test_clear_forgets_every_entry_and_closes_none():
    cache = LRU(4)
    first = cache.get("a", lambda: Thing("a"))
    cache.get("b", lambda: Thing("b"))
    cache.clear()
    assert len(cache) == 0 and "a" not in cache and cache.values() == [] and not first.closed
    assert cache.get("a", lambda: Thing("a")) is not first and cache.builds == 3


def test_maxsize_must_be_positive():
    with pytest.raises(ValueError, match="maxsize"):
        LRU(0)
    one = LRU(1)  # the least bound: one entry, the last
    one.get("a", lambda: Thing("a"))
    b = one.get("b", lambda: Thing("b"))
    assert one.values() == [b]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_child_forked_while_another_thread_inserts_can_insert():
    """A thread holding the cache's lock at os.fork() does not exist in the child: the child finds the lock free
    (a child that would wait for it reports False after a second instead of hanging)."""
    cache = LRU(2)
    cache.get("a", lambda: Thing("a"))
    inserting, forked = threading.Event(), threading.Event()

    def insert():
        with cache._lock:  # what get() holds while it inserts and evicts
            inserting.set()
            forked.wait(10)

    thread = threading.Thread(target=insert)
    thread.start()
    inserting.wait(10)

    def in_the_child():
        if not cache._lock.acquire(timeout=1):
            return "the lock is held"
        cache._lock.release()
        cache.get("b", lambda: Thing("b"))
        return sorted(t.key for t in cache.values())

    try:
        wait = fork(in_the_child)
    finally:
        forked.set()
        thread.join()
    assert wait() == ["a", "b"]


def test_a_caches_lock_goes_with_the_cache():
    """What frees the lock in a forked child holds it weakly: a cache made and dropped (one per backend, and per
    fork in a child) leaves nothing behind, no lock and no at-fork hook run at every fork for ever."""
    lock = weakref.ref(LRU(2)._lock)
    gc.collect()
    assert lock() is None


def test_items_reads_every_entry_whatever_a_hit_does_meanwhile():
    """items() takes no lock (a collected plan cache's finalizer reads it, which may run where the lock is held), and
    lookups take none either: it must run no code of the keys' (a geometry's __hash__ is Python), where another
    thread's hit could move an entry and cut the snapshot short. Here a key's own __hash__ makes that hit."""
    cache = LRU(8)

    class Key:
        hit = False

        def __hash__(self):
            if Key.hit:
                Key.hit = False
                cache.lookup(keys[0])  # a hit elsewhere, between two entries' reads
            return 7

    keys = [(Key(), n) for n in range(4)]
    for key in keys:
        cache.put(key, Thing(key))
    Key.hit = True
    assert sorted(n for (_, n), _ in cache.items()) == [0, 1, 2, 3]
