"""A real `cgn-kvcached serve` on loopback, driven over gRPC: blocks stored, looked up by tier and
streamed back in prefix order; bad requests get statuses, not a dead server; with write-through
the SSD tier survives SIGTERM and SIGKILL in the middle of writes, and nothing corrupt is served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import grpc
import numpy as np
import pytest

from cgn_core.kv.identity import bearer
from cgn_core.readiness import wait_ready_file
from cgn_proto.cognitora.v1 import kv_events_pb2 as ev
from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc
from harness.procs import cgn_kvcached

LAYOUT = pb.KvLayout(dtype="float32", layers=4, kv_heads=3, head_dim=64, block_size=16,
                     engine="cgn-infer 0.1.0")  # fmt: skip
BLOCK = 98_304  # bytes per block of LAYOUT


def block(i: int) -> pb.KvBlock:
    return pb.KvBlock(hash=i.to_bytes(32, "big"), data=bytes([i % 251]) * BLOCK)


@contextmanager
def kvcached(
    tmp: Path, *args: str
) -> Iterator[tuple[pb_grpc.KvCacheStub, subprocess.Popen[bytes]]]:
    with cgn_kvcached(tmp, *args) as kv, kv.channel() as channel:
        yield pb_grpc.KvCacheStub(channel), kv.proc


def metrics(tmp: Path) -> str:
    """The /metrics page of the kvcached started last in `tmp`."""
    ready = sorted(tmp.glob("kvcached-*.ready"))[-1]
    port = json.loads(ready.read_text())["ports"]["admin"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def put(stub: pb_grpc.KvCacheStub, ids: range) -> pb.PutReply:
    return stub.Put(iter([pb.PutRequest(layout=LAYOUT, block=block(i)) for i in ids]), timeout=60)


def test_blocks_in_ram_then_ssd_and_back_in_prefix_order(tmp_path: Path) -> None:
    args = ("--ram-bytes", str(1 << 20), "--ssd-dir", str(tmp_path / "ssd"),
            "--ssd-bytes", str(16 << 20))  # fmt: skip
    with kvcached(tmp_path, *args) as (stub, _):
        assert put(stub, range(20)) == pb.PutReply(stored=20, dropped=0)
        hashes = [block(i).hash for i in range(20)]
        tiers = stub.Lookup(pb.LookupRequest(layout=LAYOUT, hashes=hashes)).tiers
        assert len(tiers) == 20 and tiers[0] == ev.KV_TIER_SSD and tiers[-1] == ev.KV_TIER_RAM
        got = list(stub.Get(pb.GetRequest(layout=LAYOUT, hashes=hashes)))
        assert [g.block for g in got] == [block(i) for i in range(20)]
        gap = [block(0).hash, (999).to_bytes(32, "big"), block(1).hash]
        assert len(list(stub.Get(pb.GetRequest(layout=LAYOUT, hashes=gap)))) == 1
        stats = stub.Stats(pb.StatsRequest())
        assert stats.ram_bytes <= 1 << 20 and stats.ssd_blocks >= 10 and stats.hits_ssd >= 10
        other = pb.KvLayout(**{**{f.name: getattr(LAYOUT, f.name) for f in
                                  LAYOUT.DESCRIPTOR.fields}, "dtype": "bfloat16"})  # fmt: skip
        # another layout finds nothing, and learns nothing: a miss, not an error
        assert list(stub.Get(pb.GetRequest(layout=other, hashes=hashes))) == []
        assert list(stub.Lookup(pb.LookupRequest(layout=other, hashes=hashes)).tiers) == []
        for bad, code in ((pb.LookupRequest(layout=LAYOUT, hashes=[b"short"]),
                           grpc.StatusCode.INVALID_ARGUMENT),
                          (pb.LookupRequest(layout=pb.KvLayout(dtype="float64")),
                           grpc.StatusCode.INVALID_ARGUMENT)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as refused:
                stub.Lookup(bad)
            assert refused.value.code() == code
        page = metrics(tmp_path)
        assert 'cgn_kvcached_hits_total{tier="ssd"}' in page and "cgn_kvcached_evictions" in page
        assert 'cgn_kvcached_blocks{tier="ram"}' in page and "cgn_kvcached_ssd_degraded 0.0" in page
        assert stub.Stats(pb.StatsRequest()).ram_blocks > 0


def test_only_the_node_identity_reads_writes_and_evicts(tmp_path: Path) -> None:
    """Put/Get/Lookup/Stats need the engines' client token, Evict/Clear the admin token; a
    stranger learns nothing and changes nothing, and the store keeps serving its engines."""
    with cgn_kvcached(tmp_path) as kv, ExitStack() as stack:
        assert kv.keys is not None
        engine, admin, stranger, wrong = (
            pb_grpc.KvCacheStub(stack.enter_context(kv.channel(token)))
            for token in (None, kv.keys.admin_token, "", "x" * 64)
        )
        assert put(engine, range(4)) == pb.PutReply(stored=4, dropped=0)
        hashes = [block(i).hash for i in range(4)]
        calls = {
            "Put": lambda s: put(s, range(100, 102)),
            "Get": lambda s: list(s.Get(pb.GetRequest(layout=LAYOUT, hashes=hashes))),
            "Lookup": lambda s: s.Lookup(pb.LookupRequest(layout=LAYOUT, hashes=hashes)),
            "Stats": lambda s: s.Stats(pb.StatsRequest()),
            "Evict": lambda s: s.Evict(pb.EvictRequest(layout=LAYOUT, hashes=hashes)),
            "Clear": lambda s: s.Clear(pb.ClearRequest()),
        }
        for name, call in calls.items():
            for stub, code in ((stranger, grpc.StatusCode.UNAUTHENTICATED),
                               (wrong, grpc.StatusCode.PERMISSION_DENIED)):  # fmt: skip
                with pytest.raises(grpc.RpcError) as refused:
                    call(stub)
                assert refused.value.code() == code, name
        for name in ("Evict", "Clear"):  # an engine may not drop another's blocks
            with pytest.raises(grpc.RpcError) as refused:
                calls[name](engine)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        got = list(engine.Get(pb.GetRequest(layout=LAYOUT, hashes=hashes)))
        assert [g.block for g in got] == [block(i) for i in range(4)]  # nothing changed
        assert admin.Evict(pb.EvictRequest(layout=LAYOUT, hashes=hashes[:1])).evicted == 1
        assert admin.Clear(pb.ClearRequest()).evicted == 3
    with cgn_kvcached(tmp_path, secret=False) as open_store, open_store.channel() as ch:
        with pytest.raises(grpc.RpcError) as refused:  # no secret: no admin at all
            pb_grpc.KvCacheStub(ch).Clear(pb.ClearRequest())
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_ssd_blocks_altered_or_swapped_on_disk_are_never_served(tmp_path: Path) -> None:
    """Each SSD block carries a tag keyed by the node secret over its name and bytes: a
    flipped byte, a file renamed to another block's name, a file written with another key,
    a FIFO or a link under a block's name are refused and counted; the rest still served."""
    ssd = tmp_path / "ssd"
    args = ("--ram-bytes", str(1 << 20), "--ssd-dir", str(ssd), "--ssd-bytes", str(64 << 20),
            "--set", "write_through=true")  # fmt: skip
    with kvcached(tmp_path, *args) as (stub, _):
        put(stub, range(6))
    files = {i: next(ssd.glob(f"*-{block(i).hash.hex()}.blk")) for i in range(6)}
    raw = bytearray(files[1].read_bytes())
    raw[-1] ^= 0xFF  # a flipped byte
    files[1].write_bytes(raw)
    files[2].unlink()
    files[3].rename(files[2])  # block 3's bytes under block 2's name
    other = tmp_path / "other"  # a store with another node secret writes block 4
    other.mkdir()
    with kvcached(other, *args[:2], "--ssd-dir", str(other / "ssd"), *args[4:]) as (o, _):
        put(o, range(4, 5))
    os.replace(next((other / "ssd").glob("*.blk")), files[4])
    files[5].unlink()
    os.mkfifo(files[5])  # a FIFO under block 5's name: never opened, never blocks
    with kvcached(tmp_path, *args) as (stub, _):
        for i in range(6):
            got = list(stub.Get(pb.GetRequest(layout=LAYOUT, hashes=[block(i).hash]), timeout=10))
            assert [g.block for g in got] == ([block(0)] if i == 0 else []), i
        assert stub.Stats(pb.StatsRequest()).checksum_failures == 3
        assert len(list((ssd / "quarantine").iterdir())) == 4


def test_the_ssd_tier_survives_a_restart_and_sigkill_mid_write(tmp_path: Path) -> None:
    args = ("--ram-bytes", str(1 << 20), "--ssd-dir", str(tmp_path / "ssd"),
            "--ssd-bytes", str(64 << 20), "--set", "write_through=true")  # fmt: skip
    with kvcached(tmp_path, *args) as (stub, _):
        put(stub, range(10))
    with kvcached(tmp_path, *args) as (stub, proc):  # SIGTERM'd: every block on disk
        hashes = [block(i).hash for i in range(10)]
        got = list(stub.Get(pb.GetRequest(layout=LAYOUT, hashes=hashes)))
        assert [g.block for g in got] == [block(i) for i in range(10)]
        assert all(g.tier == ev.KV_TIER_SSD for g in got[:5])

        def writer() -> None:  # many blocks; killed part-way
            with suppress(grpc.RpcError):
                put(stub, range(100, 400))

        t = threading.Thread(target=writer)
        t.start()
        deadline = time.monotonic() + 30
        while stub.Stats(pb.StatsRequest()).ssd_blocks < 60:  # 50 of the new ones are on disk
            assert time.monotonic() < deadline, "the writes never reached the SSD"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        t.join(30)
    with kvcached(tmp_path, *args) as (stub, _):
        hashes = [block(i).hash for i in range(100, 400)]
        got = list(stub.Get(pb.GetRequest(layout=LAYOUT, hashes=hashes)))
        assert len(got) >= 40  # what was written before the kill
        assert all(g.block == block(100 + n) for n, g in enumerate(got))  # none torn or corrupt
        assert stub.Stats(pb.StatsRequest()).checksum_failures == 0


def test_mutual_tls_refuses_strangers_and_impostors(tmp_path: Path) -> None:
    from cgn_core import pki
    from cgn_core.settings import TlsSettings
    from cgn_core.tls import channel_credentials

    ca = pki.create_ca()
    pki.write_pair(tmp_path, "ca", ca)
    pki.write_pair(tmp_path, "n1", pki.issue(ca, "n1", "kvcached", ["127.0.0.1", "localhost"]))
    pki.write_pair(tmp_path, "n2", pki.issue(ca, "n2", "infer"))
    sets = [f"tls.{f}_file={tmp_path / name}" for f, name in
            (("ca", "ca.pem"), ("cert", "n1.pem"), ("key", "n1.key"))]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    with cgn_kvcached(tmp_path, *args) as kv:
        assert kv.keys is not None
        token = bearer(kv.keys.client_token)  # with TLS too: a cluster certificate is not enough
        port = wait_ready_file(next(tmp_path.glob("kvcached-*.ready")), 5, kv.proc)["ports"]["grpc"]
        n2 = TlsSettings(ca_file=tmp_path / "ca.pem", cert_file=tmp_path / "n2.pem",
                         key_file=tmp_path / "n2.key")  # fmt: skip
        with grpc.secure_channel(f"localhost:{port}", channel_credentials(n2)) as ch:
            stub = pb_grpc.KvCacheStub(ch)
            assert stub.Stats(pb.StatsRequest(), timeout=10, metadata=[token]).ram_blocks == 0
            with pytest.raises(grpc.RpcError) as tokenless:
                stub.Stats(pb.StatsRequest(), timeout=10)
            assert tokenless.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as impostor:
                meta = [("x-cgn-node", "n1"), token]
                stub.Stats(pb.StatsRequest(), timeout=10, metadata=meta)
            assert impostor.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stranger = TlsSettings(ca_file=tmp_path / "ca.pem")  # trusts us, presents nothing
        with grpc.secure_channel(f"localhost:{port}", channel_credentials(stranger)) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KvCacheStub(ch).Stats(pb.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_shared_memory_moves_blocks_and_refuses_unsafe_files(tmp_path: Path) -> None:
    from cgn_core.kv.client import KvCacheClient, KvCacheError
    from cgn_core.kv.layout import Layout

    layout = Layout(**{f.name: getattr(LAYOUT, f.name) for f in LAYOUT.DESCRIPTOR.fields})
    data = np.random.default_rng(0).integers(0, 256, (8, BLOCK), dtype=np.uint8)
    hashes = [block(i).hash for i in range(8)]
    with cgn_kvcached(tmp_path) as kv, kv.channel() as channel:
        assert kv.keys is not None
        token = kv.keys.client_token
        shm = KvCacheClient(kv.address, layout, token=token)
        inline = KvCacheClient(kv.address, layout, token=token, shared_memory=False)
        assert shm.lookup(hashes) == []  # nothing under this layout yet: empty, not an error
        assert shm.put(hashes[:4], data[:4]) == 4
        assert inline.put(hashes[4:], data[4:]) == 4
        for client in (shm, inline):
            got, tiers = client.get([*hashes, (999).to_bytes(32, "big")])
            assert np.array_equal(got, data) and tiers == ["ram"] * 8
        assert shm._shm_dir == kv.shm_dir and not list(kv.shm_dir.iterdir())  # nothing left
        stub = pb_grpc.KvCacheStub(channel)
        secret = tmp_path / "secret"
        secret.write_bytes(b"x" * BLOCK)
        (kv.shm_dir / "link.kv").symlink_to(secret)
        (kv.shm_dir / "small.kv").write_bytes(b"")
        os.mkfifo(kv.shm_dir / "fifo.kv")  # would block the store's one worker thread if opened
        for path, why in ((secret, "directly in"), (kv.shm_dir / "link.kv", "shm_path"),
                          (kv.shm_dir / "small.kv", "at least"),
                          (kv.shm_dir / "fifo.kv", "regular file"),
                          (kv.shm_dir / "../secret", "directly in")):  # fmt: skip
            with pytest.raises(grpc.RpcError) as refused:
                get = pb.GetRequest(layout=LAYOUT, hashes=hashes, shm_path=str(path))
                list(stub.Get(get, timeout=10))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert why in str(refused.value.details())
        assert secret.read_bytes() == b"x" * BLOCK  # never written through the link
        short = [pb.PutRequest(layout=LAYOUT, block=pb.KvBlock(hash=hashes[0], data=b"x"))]
        with pytest.raises(grpc.RpcError) as wrong_size:
            stub.Put(iter(short))
        assert wrong_size.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        shm.close()
        inline.close()
    gone = KvCacheClient(kv.address, layout, timeout_s=2)
    with pytest.raises(KvCacheError):  # the server is gone: an error the engine recomputes on
        gone.get(hashes)
    gone.close()


def test_tier_events_feed_the_router_index_exactly(tmp_path: Path) -> None:
    """The store's KV event stream (bearer-protected), read as the router reads it: its view
    of each tier equals what Lookup answers, through RAM evictions to the SSD."""
    from google.protobuf import json_format

    from cgn_router.kv_follow import apply_tiers
    from cgn_router.routing.kv_index import TierIndex

    args = ("--ram-bytes", str(1 << 20), "--ssd-dir", str(tmp_path / "ssd"),
            "--ssd-bytes", str(16 << 20), "--set", "events_token=s3cret")  # fmt: skip
    with (
        ExitStack() as stack,
        cgn_kvcached(tmp_path, *args) as kv,
        kv.channel() as channel,
    ):
        stub = pb_grpc.KvCacheStub(channel)
        url = kv.admin + "/v1/kv/events"
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url, timeout=10)
        assert denied.value.code == 401
        denied.value.close()
        put(stub, range(4))  # before subscribing: in the snapshot
        req = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        stream = stack.enter_context(urllib.request.urlopen(req, timeout=10))
        put(stub, range(4, 20))  # RAM holds 10: the oldest go to the SSD, as events
        hashes = [block(i).hash for i in range(20)]
        want = [t for t in stub.Lookup(pb.LookupRequest(layout=LAYOUT, hashes=hashes)).tiers]
        tiers, first, n = TierIndex(), True, 0
        while tiers.extend("n1", hashes, 0) != (
            want.count(ev.KV_TIER_RAM),
            want.count(ev.KV_TIER_SSD),
        ):
            line = stream.readline()
            assert line, "the stream ended"
            if line.startswith(b"data: "):
                msg = json_format.Parse(line[6:], ev.KvEventEnvelope())
                assert apply_tiers(tiers, "n1", msg, first)
                first, n = first and not msg.HasField("snapshot"), n + 1
        assert want.count(ev.KV_TIER_SSD) >= 10 and n > 20


def test_the_shm_dir_is_never_taken_through_a_link_or_from_another_user(tmp_path: Path) -> None:
    """/dev/shm is sticky and world-writable: whoever creates the name first owns it. A link
    planted there is not followed (its target keeps its mode), a directory of another user
    is not used, and our own is made 0700 whatever its mode was."""
    from cgn_kvcached.daemon import prepare_shm_dir

    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    link = tmp_path / "link"
    link.symlink_to(victim)
    assert prepare_shm_dir(link) is None
    assert victim.stat().st_mode & 0o777 == 0o755
    ours = tmp_path / "ours"
    assert prepare_shm_dir(ours) == ours and ours.stat().st_mode & 0o777 == 0o700
    ours.chmod(0o777)
    assert prepare_shm_dir(ours) == ours and ours.stat().st_mode & 0o777 == 0o700
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        assert prepare_shm_dir(theirs) is None
        # a link planted by another user higher up the path is not followed either: only
        # root's own links are (the system's layout)
        planted = tmp_path / "planted"
        planted.symlink_to(victim)
        os.lchown(planted, 65534, 65534)
        assert prepare_shm_dir(planted / "kv") is None and not (victim / "kv").exists()
        system = tmp_path / "system"
        system.symlink_to(victim)  # root's
        assert prepare_shm_dir(system / "kv") == system / "kv" and (victim / "kv").is_dir()


def test_a_secret_that_is_not_random_is_refused(tmp_path: Path) -> None:
    from cgn_core.errors import ConfigError
    from cgn_core.kv.identity import SECRET_BYTES, read_secret

    for weak in (bytes(SECRET_BYTES), b"\xab" * SECRET_BYTES, bytes(range(4)) * 8):
        path = tmp_path / "secret"
        path.write_text(weak.hex())
        path.chmod(0o600)
        with pytest.raises(ConfigError, match="not a random secret"):
            read_secret(path)
    path.write_text(os.urandom(SECRET_BYTES).hex())
    assert len(read_secret(path)) == SECRET_BYTES
