"""The generated stubs are current and import as one package."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO


def test_regenerating_changes_nothing() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_stubs_import_together() -> None:
    from cgn_proto.cognitora.v1 import kv_events_pb2, kv_events_pb2_grpc
    from cgn_proto.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc

    assert rpc_pb2.RangeRequest(key=b"k").key == b"k"
    assert kv_pb2.Event.DELETE == 1 and rpc_pb2_grpc.KVStub is not None
    env = kv_events_pb2.KvEventEnvelope(event=kv_events_pb2.KvBlockEvent(seq=7))
    assert env.WhichOneof("body") == "event" and kv_events_pb2_grpc.KvEventsStub is not None
