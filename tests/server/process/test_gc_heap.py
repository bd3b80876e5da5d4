"""freeze_startup_heap (server/process/gc_heap.py): what exists is frozen out of the collector's
walk, start-up garbage is collected first, and what comes later is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from toppings.server.process.gc_heap import freeze_startup_heap, thaw_heap


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_after_its_garbage_is_collected(unfrozen):
    kept, dropped = Node(), Node()
    kept_ref, dropped_ref = weakref.ref(kept), weakref.ref(dropped)
    del dropped  # garbage of start-up: collected, not frozen
    # at least the count after: a thread a test before left may free a frozen object meanwhile
    assert freeze_startup_heap() >= gc.get_freeze_count() > 0
    assert dropped_ref() is None and kept_ref() is kept
    tracked = {id(o) for o in gc.get_objects()}
    assert id(kept) not in tracked  # frozen: out of every generation's walk


def test_what_is_made_later_is_still_collected(unfrozen):
    freeze_startup_heap()
    later = Node()
    ref = weakref.ref(later)
    del later
    gc.collect()
    assert ref() is None


def test_thawed_the_collector_walks_them_again(unfrozen):
    kept = Node()
    freeze_startup_heap()
    thaw_heap()
    assert gc.get_freeze_count() == 0
    assert id(kept) in {id(o) for o in gc.get_objects()}
