"""cgn-kvcached's block store (issue #19, part 1): the RAM tier's budget and pins (hypothesis),
the SSD tier's durable writes, checksums, rebuild and full disk (a real filled tmpfs), and the
two tiers together. The gRPC service around them is not built yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_core.kv.layout import BlockKey, Layout, LayoutError
from cgn_core.kv.ram_tier import RamFull, RamTier
from cgn_core.kv.ssd_tier import HEADER, SsdTier
from cgn_core.kv.store import BlockStore
from tests.support.disks import small_tmpfs

LAYOUT = Layout("float32", layers=30, kv_heads=3, head_dim=64, block_size=16,
                engine="cgn-infer 0.1.0")  # fmt: skip


def key(i: int, layout: Layout = LAYOUT) -> BlockKey:
    return BlockKey(layout.digest, i.to_bytes(32, "big"))


def test_layouts_name_what_the_bytes_mean() -> None:
    assert LAYOUT.block_bytes == 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2's K and V per block
    other = Layout("bfloat16", 30, 3, 64, 16, "cgn-infer 0.1.0")
    assert len(LAYOUT.digest) == 16 and LAYOUT.digest != other.digest
    assert Layout.from_json({"dtype": "float32", "layers": 30, "kv_heads": 3, "head_dim": 64,
                             "block_size": 16, "engine": "cgn-infer 0.1.0"}) == LAYOUT  # fmt: skip
    base = {"dtype": "float32", "layers": 30, "kv_heads": 3, "head_dim": 64, "block_size": 16,
            "engine": "x"}  # fmt: skip
    for bad in ({"dtype": "float64"}, {"layers": 0}, {"head_dim": True}, {"engine": ""}):
        with pytest.raises(LayoutError):
            Layout(**{**base, **bad})  # type: ignore[arg-type]
    assert BlockKey.from_hex(key(7).hex()) == key(7)
    with pytest.raises(LayoutError):
        BlockKey.from_hex("zz-00")


# ---- RAM tier: a property test of budget, LRU and pins -------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 15), st.integers(1, 40)),
        st.tuples(st.just("get"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("pin"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("unpin"), st.integers(0, 15), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_ram_tier_keeps_its_budget_and_never_evicts_a_pinned_block(
    ops: list[tuple[str, int, int]],
) -> None:
    ram = RamTier(budget_bytes=100)
    pins: dict[int, int] = {}
    for op, i, size in ops:
        if op == "put":
            before = set(ram.block_keys())
            try:
                evicted = ram.put(key(i), bytes([i]) * size)
            except RamFull:
                assert set(ram.block_keys()) == before  # a refused put changes nothing
                continue
            assert all(pins.get(int.from_bytes(k.block, "big"), 0) == 0 for k, _ in evicted)
        elif op == "get":
            got = ram.get(key(i))
            assert got is None or set(got) == {i}
        elif op == "pin" and ram.pin(key(i)):
            pins[i] = pins.get(i, 0) + 1
        elif op == "unpin" and pins.get(i):
            ram.unpin(key(i))
            pins[i] -= 1
        assert ram.used_bytes == sum(len(ram.get(k) or b"") for k in ram.block_keys()) <= 100
        for pinned, n in pins.items():
            if n:
                assert key(pinned) in ram  # a reader's blocks stay under it


def test_ram_tier_evicts_the_least_recently_used_first() -> None:
    ram = RamTier(budget_bytes=30)
    for i in range(3):
        ram.put(key(i), b"x" * 10)
    ram.get(key(0))  # 0 is now the most recent
    assert [k for k, _ in ram.put(key(3), b"y" * 10)] == [key(1)]
    ram.pin(key(2))
    assert [k for k, _ in ram.put(key(4), b"z" * 10)] == [key(0)]  # 2 is pinned, 0 is next


# ---- SSD tier -----------------------------------------------------------------------------


def test_ssd_blocks_survive_a_restart_and_a_corrupt_one_is_never_served(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "ssd", budget_bytes=1 << 20)
    for i in range(4):
        ssd.put(key(i), bytes([i]) * 1000)
    (tmp_path / "ssd" / ".tmp-deadbeef").write_bytes(b"half a block")  # a crash mid-write
    # Flip one payload byte of block 2 on disk (a bad sector), truncate block 3.
    p2 = ssd.path(key(2))
    raw = bytearray(p2.read_bytes())
    raw[HEADER.size + 10] ^= 0xFF
    p2.write_bytes(bytes(raw))
    p3 = ssd.path(key(3))
    p3.write_bytes(p3.read_bytes()[:500])
    again = SsdTier(tmp_path / "ssd", budget_bytes=1 << 20)
    assert not (tmp_path / "ssd" / ".tmp-deadbeef").exists()
    assert key(3) not in again and again.quarantined == 1  # its header no longer fits its size
    assert again.get(key(0)) == bytes([0]) * 1000 and again.get(key(1)) == bytes([1]) * 1000
    assert again.get(key(2)) is None and again.checksum_failures == 1
    assert key(2) not in again and (tmp_path / "ssd" / "quarantine" / p2.name).exists()
    assert again.used_bytes == 2 * (HEADER.size + 1000)


def test_ssd_budget_evicts_the_oldest_files(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path, budget_bytes=3 * (HEADER.size + 100))
    for i in range(3):
        ssd.put(key(i), b"a" * 100)
    ssd.get(key(0))
    assert ssd.put(key(3), b"b" * 100) == [key(1)]
    assert not ssd.path(key(1)).exists() and len(ssd) == 3


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only): the SSD tier's disk, to fill up."""
    with small_tmpfs(tmp_path / "disk") as mnt:
        yield mnt


def test_a_full_disk_degrades_to_ram_and_leaves_no_partial_block(tiny_disk: Path) -> None:
    clock = [0.0]
    store = BlockStore(RamTier(budget_bytes=20_000), SsdTier(tiny_disk, budget_bytes=1 << 30),
                       write_through=True, ssd_retry_s=30, clock=lambda: clock[0])  # fmt: skip
    for i in range(12):  # 12 x 10 KB through to a 64 KiB disk
        store.put(key(i), bytes([i]) * 10_000)
    assert store.ssd_degraded and store.stats.ssd_write_failures >= 1
    assert not [p for p in tiny_disk.iterdir() if p.name.startswith(".tmp-")]
    assert store.ssd is not None
    for k in store.ssd.block_keys():  # every block on disk is whole and checks out
        assert store.ssd.get(k) is not None
    assert store.get(key(11)) == (bytes([11]) * 10_000, "ram")  # RAM still serves
    for k in store.ssd.block_keys():  # an operator frees the disk
        store.ssd.discard(k)
    store.put(key(20), b"z" * 10_000)
    assert store.ssd_degraded  # not retried before ssd_retry_s
    clock[0] = 31.0
    store.put(key(21), b"w" * 10_000)
    assert not store.ssd_degraded and key(21) in store.ssd  # the disk has room again


# ---- the two tiers together ----------------------------------------------------------------


def test_ram_evictions_go_to_ssd_and_come_back_promoted(tmp_path: Path) -> None:
    store = BlockStore(RamTier(budget_bytes=3000), SsdTier(tmp_path, budget_bytes=1 << 20))
    for i in range(5):
        store.put(key(i), bytes([i]) * 1000)
    assert store.lookup([key(i) for i in range(6)]) == ["ssd", "ssd", "ram", "ram", "ram"]
    assert store.get(key(0)) == (bytes([0]) * 1000, "ssd")
    assert store.get(key(0)) == (bytes([0]) * 1000, "ram")  # promoted
    assert store.lookup([key(9), key(0)]) == []  # a chain stops at its first miss
    other = Layout("bfloat16", 30, 3, 64, 16, "cgn-infer 0.1.0")
    assert store.get(key(0, other)) is None  # another layout never sees these bytes
    assert store.stats.hits == {"ram": 1, "ssd": 1} and store.stats.misses == 1
