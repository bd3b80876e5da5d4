"""/dev/shm running out is an error raised where the memory is asked for, never a SIGBUS later.

Nothing here fills the machine's /dev/shm: a request larger than the whole tmpfs makes
`posix_fallocate` fail with ENOSPC before it backs a single page (the tmpfs checks the size
against its limit first), so the real kernel path is exercised at no cost.
"""

from __future__ import annotations

import os

import pytest
from cpu_lora_helpers import make_adapter, tiny_config

from toppings.cpu_lora import shm
from toppings.cpu_lora.repository import HostRepository


def more_than_the_tmpfs() -> int:
    """Bytes no request to /dev/shm can get: its whole size plus 1 GiB."""
    st = os.statvfs(shm.SHM_DIR)
    return st.f_blocks * st.f_frsize + (1 << 30)


def test_a_segment_larger_than_dev_shm_is_refused_and_unlinked():
    before = shm.leftovers()
    name = shm.new_name("toobig")
    size = more_than_the_tmpfs()
    with pytest.raises(shm.SharedMemoryFull) as info:
        shm.create_shm(name, size)
    message = str(info.value)
    assert str(size) in message and shm.SHM_DIR in message and "free" in message
    assert isinstance(info.value, OSError)
    assert shm.leftovers() == before  # the half-made segment went


def test_a_full_dev_shm_fails_the_add_and_leaves_the_arena_usable(monkeypatch):
    """The arena's data area is sparse: each add reserves its block first. Asking that reserve
    for more than the tmpfs holds makes it fail as a full /dev/shm would."""
    repo = HostRepository.create(tiny_config(), capacity_bytes=1 << 20, max_adapters=4)
    try:
        first = make_adapter("first", 4, ("q_proj", "v_proj"), seed=1)
        repo.add(first)
        free, ids = repo.free_bytes, repo.ids()
        real = shm.reserve_shm
        monkeypatch.setattr(
            shm, "reserve_shm", lambda name, at, n: real(name, at, n + more_than_the_tmpfs())
        )
        with pytest.raises(shm.SharedMemoryFull, match="shared memory is full"):
            repo.add(make_adapter("second", 8, ("q_proj",), seed=2))
        second = make_adapter("second", 8, ("q_proj",), seed=2)
        assert repo.free_bytes == free and repo.ids() == ids
        assert repo.lookup(second.id) is None
        monkeypatch.setattr(shm, "reserve_shm", real)
        repo.add(second)
        assert sorted(repo.ids()) == sorted([first.id, second.id])
    finally:
        repo.close()


def test_the_arena_reserves_only_what_it_holds():
    """A large arena costs /dev/shm its header and table, then the blocks added."""
    capacity = 256 << 20
    repo = HostRepository.create(tiny_config(), capacity_bytes=capacity, max_adapters=4)
    try:
        used = os.stat(os.path.join(shm.SHM_DIR, repo.name.lstrip("/"))).st_blocks * 512
        assert used < capacity // 16
    finally:
        repo.close()
