"""`cgn-router serve --workers 2` for real: one port, two router processes, a sim engine and
API keys in etcd; a key's limits counted once, a killed worker restarted while the other
serves, a reload (SIGHUP) that fails no request, one /metrics that adds the workers up."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cgn_core import keys
from cgn_core.apikeys import Limits, create
from cgn_core.etcd.local import LocalEtcd
from cgn_router.workers.metrics_merge import merge_pages
from cgn_router.workers.supervisor import HUNG_S
from harness.metrics import metric
from harness.poll import until
from harness.procs import Router, cgn_infer_engines, cgn_router, etcd_put, runs

pytestmark = pytest.mark.etcd
SIM = ("--backend", "sim", "--speed", "50", "--model-name", "sim")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEtcd, Router]]:
    tmp = tmp_path_factory.mktemp("workers")
    etcd = LocalEtcd(tmp / "etcd")
    etcd.start()
    try:
        with cgn_infer_engines(tmp, 1, *SIM) as engines:
            etcd_put(etcd.endpoint, keys.ENDPOINTS + "sim/e1",
                     {"url": engines[0].url, "engine": "cgn-infer"})  # fmt: skip
            config = {"etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
                      "reconciler": {"enabled": False}, "workers": 2,
                      "models": {"sim": {"tokenizer": "smollm2"}}}  # fmt: skip
            with cgn_router(tmp, config) as r:
                yield etcd, r
    finally:
        etcd.stop()


def key(etcd: LocalEtcd, limits: Limits = Limits()) -> str:
    secret, record = create("t", "gold", limits=limits)
    etcd_put(etcd.endpoint, keys.API_KEYS + record.id, record.to_json())
    return secret


def call(router: Router, secret: str, stream: bool = False) -> int:
    """One request on a connection of its own (the kernel picks the worker per connection);
    `stream`: streamed, with its usage (only a stream shows its first token's time)."""
    body = json.dumps({"model": "sim", "prompt": "hello", "max_tokens": 2, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})}).encode()  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}
    req = urllib.request.Request(router.url + "/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), exc.read().decode()


def health(router: Router) -> tuple[int, dict[str, Any]]:
    status, text = get(router.admin + "/healthz")
    return status, json.loads(text)


def handled(page: str) -> float:
    """Requests a page counts: served, and refused by a key's limits."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith("cgn_router_requests_total{") or (
            line.startswith("cgn_router_admission_rejections_total{") and "rate_limited" in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def per_worker(router: Router) -> tuple[float, float]:
    """(the primary's, the other's) requests: the whole page less the other's own."""
    both = handled(get(router.admin + "/metrics")[1])
    other = handled(get(health(router)[1]["workers"][1]["metrics"])[1])
    return both - other, other


def test_a_keys_limits_are_counted_once_across_workers(router: tuple[LocalEtcd, Router]) -> None:
    etcd, r = router
    limited = key(etcd, Limits(rps=2))
    probe = key(etcd)  # written after: a worker that knows it knows the limited key too
    until("both workers to know the keys", lambda: all(call(r, probe) == 200 for _ in range(8)),
          timeout_s=30)  # fmt: skip
    assert all(health(r)[1]["workers"][i]["running"] for i in (0, 1))
    before = per_worker(r)
    start = time.monotonic()
    codes = Counter(call(r, limited) for _ in range(12))
    refilled = 2 * (time.monotonic() - start)  # tokens the bucket regained meanwhile
    after = per_worker(r)
    assert set(codes) <= {200, 429}, codes
    # a bucket of 2 that refills 2 a second: the burst gets 2 and what refilled meanwhile;
    # counted per worker it would have had 4, and twice the refill
    assert 2 <= codes[200] <= 2 + math.ceil(refilled), (codes, refilled)
    assert after[0] > before[0] and after[1] > before[1], (before, after)  # both workers served


def test_one_page_of_metrics_adds_the_workers_up(router: tuple[LocalEtcd, Router]) -> None:
    _, r = router
    both = get(r.admin + "/metrics")[1]
    assert both.count("# TYPE cgn_router_requests_total counter") == 1
    primary, other = per_worker(r)
    assert primary > 0 and other > 0 and handled(both) == primary + other


def samples(router: Router, admin: str) -> float:
    """The answers behind the primary's learned speed of the one engine (/endpoints, with
    `admin`, a key of the admin scope)."""
    headers = {"Authorization": f"Bearer {admin}"}
    req = urllib.request.Request(router.admin + "/endpoints", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        (row,) = json.load(resp)["endpoints"]
    return float(row["speed"]["samples"])


def test_a_conversation_resumes_from_each_workers_prompt_cache(
    router: tuple[LocalEtcd, Router],
) -> None:
    """Each worker keeps its own prompt prefix cache: a turn whose connection lands on a worker
    that saw any earlier turn of the conversation resumes there, so at most the first turn
    each worker sees is hashed whole."""
    etcd, r = router
    secret = key(etcd)
    lookups = "cgn_router_prompt_cache_lookups_total"
    hits0, misses0 = (metric(r.admin, lookups, result=x) for x in ("hit", "miss"))
    messages = [{"role": "system", "content": "You are terse. " * 300}]
    turns = 8
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: " + "and why? " * 40})
        body = json.dumps({"model": "sim", "messages": messages, "max_tokens": 2}).encode()
        req = urllib.request.Request(r.url + "/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {secret}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:  # a connection of its own
            answer = json.load(resp)["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer or "."})
    hits, misses = (metric(r.admin, lookups, result=x) for x in ("hit", "miss"))
    assert hits - hits0 + misses - misses0 == turns
    assert 1 <= misses - misses0 <= 2  # one per worker at most
    assert metric(r.admin, "cgn_router_prompt_cache_bytes") > 0  # the workers' added up


def test_every_workers_answers_teach_each_worker_the_speed(
    router: tuple[LocalEtcd, Router],
) -> None:
    """An endpoint's speed is fitted from the answers both workers saw: the primary's count
    of samples grows by every streamed answer, not by its share of them."""
    etcd, r = router
    secret, record = create("ops", "gold", admin=True)
    etcd_put(etcd.endpoint, keys.API_KEYS + record.id, record.to_json())
    until("both workers to know the key",
          lambda: all(call(r, secret) == 200 for _ in range(4)), timeout_s=30)  # fmt: skip
    time.sleep(1.1)  # SPEED_READ_S: the primary refits on its next read
    before, served = samples(r, secret), per_worker(r)
    assert all(call(r, secret, stream=True) == 200 for _ in range(10))
    after = per_worker(r)
    assert after[1] > served[1], "the other worker served none of them"
    until("the primary to fit all ten", lambda: samples(r, secret) == before + 10, timeout_s=10)


def test_merge_pages_sums_work_and_shows_the_largest_view() -> None:
    one = (
        "# HELP cgn_router_requests_total Requests.\n# TYPE cgn_router_requests_total counter\n"
        'cgn_router_requests_total{model="m",outcome="ok"} 3.0\n'
        'cgn_router_requests_created{model="m",outcome="ok"} 100.0\n'
        "# HELP cgn_router_endpoint_kv_blocks Blocks.\n# TYPE cgn_router_endpoint_kv_blocks gauge\n"
        'cgn_router_endpoint_kv_blocks{endpoint="e"} 40.0\n'
        "# HELP cgn_router_queue_depth Waiting.\n# TYPE cgn_router_queue_depth gauge\n"
        'cgn_router_queue_depth{band="gold"} 1.0\n'
    )
    two = (
        "# HELP cgn_router_requests_total Requests.\n# TYPE cgn_router_requests_total counter\n"
        'cgn_router_requests_total{model="m",outcome="ok"} 4.0\n'
        'cgn_router_requests_total{model="m",outcome="error"} 1.0\n'
        'cgn_router_requests_created{model="m",outcome="ok"} 90.0\n'
        "# HELP cgn_router_endpoint_kv_blocks Blocks.\n# TYPE cgn_router_endpoint_kv_blocks gauge\n"
        'cgn_router_endpoint_kv_blocks{endpoint="e"} 42.0\n'
        "# HELP cgn_router_queue_depth Waiting.\n# TYPE cgn_router_queue_depth gauge\n"
        'cgn_router_queue_depth{band="gold"} 2.0\n'
    )
    merged = merge_pages([one, two]).splitlines()
    assert merged == [
        "# HELP cgn_router_requests_total Requests.",
        "# TYPE cgn_router_requests_total counter",
        'cgn_router_requests_total{model="m",outcome="ok"} 7.0',
        'cgn_router_requests_created{model="m",outcome="ok"} 90.0',
        'cgn_router_requests_total{model="m",outcome="error"} 1.0',
        "# HELP cgn_router_endpoint_kv_blocks Blocks.",
        "# TYPE cgn_router_endpoint_kv_blocks gauge",
        'cgn_router_endpoint_kv_blocks{endpoint="e"} 42.0',
        "# HELP cgn_router_queue_depth Waiting.",
        "# TYPE cgn_router_queue_depth gauge",
        'cgn_router_queue_depth{band="gold"} 3.0',
    ]


class Load:
    """Requests one after another, each on a new connection, until stopped; their codes."""

    def __init__(self, router: Router, secret: str):
        self.codes: Counter[int | str] = Counter()
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.codes[call(router, secret)] += 1
                except OSError as exc:  # a reset or refused connection: a failure too
                    self.codes[type(exc).__name__] += 1

        self._thread = threading.Thread(target=loop, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def known_key(etcd: LocalEtcd, r: Router) -> str:
    """A key without limits that both workers have read."""
    secret = key(etcd)
    until("the key known", lambda: all(call(r, secret) == 200 for _ in range(6)), timeout_s=30)
    return secret


def usage_table(router: Router) -> int:
    """A descriptor of the router's shared usage table (its memfd, opened through /proc)."""
    fds = Path(f"/proc/{router.proc.pid}/fd")
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith("/memfd:cgn-router-usage"):
                return os.open(fd, os.O_RDWR)
    raise AssertionError("the supervisor holds no usage table")


def test_a_lock_held_from_outside_stalls_no_worker(router: tuple[LocalEtcd, Router]) -> None:
    """A holder of the usage table's lock that never lets go (a stopped worker, here another
    process) costs a request at most the lock's bounded wait: keys with limits are still
    served, each worker counting alone meanwhile."""
    etcd, r = router
    limited = key(etcd, Limits(rps=1000, tokens_per_min=10**6, concurrent=100))
    until("both workers to know the key", lambda: all(call(r, limited) == 200 for _ in range(6)),
          timeout_s=30)  # fmt: skip
    fd = usage_table(r)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        started = time.monotonic()
        codes = Counter(call(r, limited) for _ in range(8))
        took = time.monotonic() - started
        assert codes == {200: 8}, codes
        assert took < 8 * 1.0, took  # each waited at most ms for the lock, not for its holder
        assert health(r)[0] == 200
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)


def test_a_killed_worker_is_restarted_while_the_other_serves(
    router: tuple[LocalEtcd, Router],
) -> None:
    etcd, r = router
    secret = known_key(etcd, r)
    victim = health(r)[1]["workers"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    _, doc = until("/healthz to say a worker is down", lambda: (
        (h := health(r))[0] == 503 and h), timeout_s=10)  # fmt: skip
    assert doc["status"] == "degraded" and doc["workers"][1]["last_exit"] == -signal.SIGKILL
    codes = Counter(call(r, secret) for _ in range(10))  # the survivor takes every connection
    assert codes == {200: 10}, codes
    _, doc = until("the worker restarted", lambda: (h := health(r))[0] == 200 and h, timeout_s=60)
    assert doc["workers"][1]["restarts"] == 1 and doc["workers"][1]["pid"] != victim["pid"]


def test_a_stopped_worker_is_replaced_and_every_new_request_answered(
    router: tuple[LocalEtcd, Router],
) -> None:
    """SIGSTOP: the kernel keeps handing the worker its share of new connections while it
    lives, so the supervisor, seeing its heartbeat stop, kills and replaces it within
    HUNG_S (and a poll); after that every new request is answered within 2 s."""
    etcd, r = router
    secret = known_key(etcd, r)
    victim = health(r)[1]["workers"][1]
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        until("the stopped worker replaced",
              lambda: health(r)[1]["workers"][1]["hangs"] == victim["hangs"] + 1,
              timeout_s=15, poll_s=0.05)  # fmt: skip
        received_for = time.monotonic() - stopped
        assert received_for < HUNG_S + 1.0, received_for
        for _ in range(16):
            asked = time.monotonic()
            assert call(r, secret) == 200
            assert time.monotonic() - asked < 2.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGCONT)
    _, doc = until("the worker back", lambda: (h := health(r))[0] == 200 and h, timeout_s=60)
    assert doc["workers"][1]["pid"] != victim["pid"]


def test_a_reload_restarts_each_worker_and_fails_no_request(
    router: tuple[LocalEtcd, Router],
) -> None:
    etcd, r = router
    secret = known_key(etcd, r)
    old = {w["pid"] for w in health(r)[1]["workers"]}
    with Load(r, secret) as load:
        until("a few requests", lambda: load.codes[200] >= 5, timeout_s=30)
        r.proc.send_signal(signal.SIGHUP)
        until("every worker replaced", lambda: (h := health(r))[0] == 200 and not (
            {w["pid"] for w in h[1]["workers"]} & old), timeout_s=90)  # fmt: skip
        seen = load.codes[200]
        until("requests served by the new workers", lambda: load.codes[200] >= seen + 5,
              timeout_s=30)  # fmt: skip
    assert set(load.codes) == {200}, load.codes


def test_one_worker_per_usable_core_within_a_cgroup_quota(tmp_path: Path) -> None:
    from cgn_core.process import usable_cores

    cores = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    for text, want in (("max 100000", cores), ("150000 100000", min(cores, 2)),
                       ("50000 100000", 1), ("garbage", cores)):  # fmt: skip
        quota.write_text(text + "\n")
        assert usable_cores(quota) == want, text
    assert usable_cores(tmp_path / "missing") == cores


def test_a_port_in_use_is_refused_not_shared(
    router: tuple[LocalEtcd, Router], tmp_path: Path
) -> None:
    """A second router started on the first one's port (SO_REUSEPORT would let it join
    silently) and a port another program listens on: one line, exit 2."""
    import subprocess
    import sys

    _, r = router
    cfg = tmp_path / "router.yaml"
    cfg.write_text("discovery: static\nauth: {enabled: false}\n"
                   "endpoints: {e: {url: 'http://127.0.0.1:9', model: m}}\n")  # fmt: skip
    exe = str(Path(sys.executable).parent / "cgn-router")
    with socket.create_server(("127.0.0.1", 0)) as other:
        for port in (r.url.rsplit(":", 1)[1], str(other.getsockname()[1])):
            res = subprocess.run([exe, "serve", "-c", str(cfg), "--workers", "2", "--port", port,
                                  "--admin-port", "0"], capture_output=True, text=True, timeout=60)  # fmt: skip
            assert res.returncode == 2, res.stderr
            assert (
                res.stderr.strip()
                == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
            )


def test_workers_stop_when_their_supervisor_is_killed(router: tuple[LocalEtcd, Router]) -> None:
    """kill -9 of the supervisor (last in this module: it ends the router) leaves no worker
    serving the port on its own."""
    _, r = router
    pids = [w["pid"] for w in health(r)[1]["workers"]]
    r.proc.kill()
    r.proc.wait(10)
    until("the workers gone", lambda: not any(runs(p, "cgn_router.cli") for p in pids),
          timeout_s=30)  # fmt: skip


def test_a_table_whose_lock_another_process_holds_is_busy_within_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The wait is bounded, the holder is named, and for BUSY_S nobody tries again."""
    from cgn_router.workers import shared

    fd = shared.create(shared.USAGE, 2)
    usage = shared.SharedUsage(fd, 2, 0)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, time; fcntl.lockf({fd}, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)"],
        pass_fds=(fd,), stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        started = time.monotonic()
        with caplog.at_level("WARNING"), usage.use("key") as slot:
            assert slot is None  # counts alone
        assert time.monotonic() - started < 0.5
        assert f"by pid {holder.pid}" in caplog.text
        assert usage.table.holder() == holder.pid
        caplog.clear()
        with usage.use("key") as slot:  # within BUSY_S: not tried, not logged again
            assert slot is None
        assert not caplog.text
    finally:
        holder.kill()
        holder.communicate()
    usage.table._busy_until = 0.0
    with usage.use("key") as slot:
        assert slot is not None and slot.in_flight == 0
    usage.close()
    os.close(fd)


def test_each_workers_speed_fit_is_read_whole_by_the_others() -> None:
    """A worker's fit is read by the others as it wrote it; a column caught mid-write is
    left out of that read, not read torn; an endpoint gone is forgotten."""
    from cgn_router.routing.speed import STATE_FIELDS
    from cgn_router.workers import shared

    assert shared.SPEED_FIELDS == STATE_FIELDS
    fd = shared.create(shared.SPEED, 3)
    views = [shared.SharedSpeed(fd, 3, w) for w in range(3)]
    fit = tuple(float(i + 1) for i in range(STATE_FIELDS))
    views[1].publish("e1", fit)
    views[2].publish("e1", (0.0,) * STATE_FIELDS)  # nothing learned: not a fit to read
    assert views[0].others("e1") == [fit] and views[1].others("e1") == []
    assert views[0].others("e2") == []
    table = views[0].table
    at = table.slot("e1")
    assert at is not None
    column = table.column_at(at, 1)
    (seq,) = struct.unpack_from("=q", table.mem, column)
    struct.pack_into("=q", table.mem, column, seq + 1)  # worker 1 is writing
    assert views[0].others("e1") == []
    struct.pack_into("=q", table.mem, column, seq)
    views[1].forget("e1")
    assert views[0].others("e1") == []
    for view in views:
        view.close()
    os.close(fd)
