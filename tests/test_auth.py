"""API keys end to end: cgn-ctl keys against a real etcd, a router enforcing them, a sim engine behind it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cgn_core.etcd.local import LocalEtcd
from harness.metrics import metric
from harness.procs import Router, cgn_infer_engines, cgn_router, etcd_put, etcd_run

pytestmark = pytest.mark.etcd
CTL = str(Path(sys.executable).parent / "cgn-ctl")
SIM = ("--backend", "sim", "--speed", "50", "--model-name", "sim")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEtcd, Router]]:
    tmp = tmp_path_factory.mktemp("auth")
    etcd = LocalEtcd(tmp / "etcd")
    etcd.start()
    try:
        with cgn_infer_engines(tmp, 1, *SIM) as engines:
            etcd_put(
                etcd.endpoint,
                "/cognitora/endpoints/sim/e1",
                {"url": engines[0].url, "engine": "cgn-infer"},
            )
            etcd_put(
                etcd.endpoint,
                "/cognitora/endpoints/other/e1",
                {"url": engines[0].url, "engine": "cgn-infer"},
            )
            config = {"etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
                      "reconciler": {"enabled": False}}  # fmt: skip
            with cgn_router(tmp, config) as router:
                yield etcd, router
    finally:
        etcd.stop()


def ctl(etcd: LocalEtcd, *args: str) -> Any:
    json_flag = [] if args[0] == "revoke" else ["--json"]
    res = subprocess.run([CTL, "keys", *args, "--etcd", etcd.endpoint, *json_flag], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout) if json_flag else res.stdout


def call(
    router: Router,
    key: str | None,
    model: str = "sim",
    prompt: str | list[int] = "hello",
    extra: dict[str, Any] | None = None,
) -> tuple[int, dict[str, str], Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, **(extra or {})}).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(router.url + "/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.load(resp)
    except urllib.error.HTTPError as exc:
        with exc:  # NOTE: closed, or its socket is a ResourceWarning in some later test
            return exc.code, dict(exc.headers), json.load(exc)


def until(check: Any, timeout_s: float = 10) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def test_keys_scopes_and_revocation(cluster: tuple[LocalEtcd, Router]) -> None:
    etcd, router = cluster
    created = ctl(etcd, "create", "--tenant", "acme", "--band", "gold", "--models", "sim")
    key = created["key"]
    assert key.startswith(f"cgn_{created['id']}_") and "hash" not in created
    until(lambda: call(router, key)[0] == 200)
    status, _, err = call(router, None)
    assert (
        status == 401
        and err["error"]["code"] == "missing_key"
        and err["error"]["type"] == "authentication_error"
    )
    assert call(router, key[:-1] + ("A" if key[-1] != "A" else "B"))[0] == 401
    assert call(router, "not-a-key")[0] == 401
    # a scoped key learns nothing of the other models: not from /v1/models, not from a 404,
    # and a model it may not use is answered exactly as one that does not exist
    forbidden, missing = call(router, key, model="other"), call(router, key, model="nope")
    assert forbidden[0] == missing[0] == 404
    assert forbidden[2]["error"]["message"] == missing[2]["error"]["message"].replace(
        "nope", "other"
    )
    req = urllib.request.Request(
        router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert [m["id"] for m in json.load(resp)["data"]] == ["sim"]
    status, _, err = call(router, key, model="nope")
    assert status == 404 and err["error"]["message"] == (
        "model 'nope' does not exist or this key may not use it (known: sim)"
    )
    listed = ctl(etcd, "list")
    assert [k["id"] for k in listed] == [created["id"]] and "hash" not in listed[0]
    ctl(etcd, "revoke", created["id"])
    took = until(lambda: call(router, key)[0] == 401)
    assert took < 5.0  # revocation takes effect within seconds
    with urllib.request.urlopen(router.admin + "/readyz", timeout=5) as resp:
        readyz = json.load(resp)
    assert readyz["auth"] == "enabled"


def test_a_keys_scope_reaches_an_adapter_only_where_it_names_it(
    cluster: tuple[LocalEtcd, Router],
) -> None:
    """#60: a key scoped to a base does not reach its adapters, nor one scoped to an
    adapter its base; each learns of the other's name nothing (404s, /v1/models)."""
    etcd, router = cluster
    etcd_put(etcd.endpoint, "/cognitora/catalog/models/other",
             {"adapters": {"other-sql": {"source": "/m/sql.gguf"}}})  # fmt: skip
    base = ctl(etcd, "create", "--tenant", "acme", "--models", "other")["key"]
    tuned = ctl(etcd, "create", "--tenant", "acme", "--models", "other-sql")["key"]
    # routed (the sim engine answers for its own model only), so in the key's scope
    until(lambda: "x-cognitora-endpoint" in call(router, base, model="other")[1])
    # in its scope, and no replica holds it (the endpoint lists none, and the sim engine,
    # started without lora_dirs, loads none): a 503 that says so
    until(lambda: call(router, tuned, model="other-sql")[0] == 503)
    status, _, err = call(router, tuned, model="other-sql")
    assert err["error"]["message"] == (
        "LoRA adapter 'other-sql' is loaded on no replica, and loading it on other/e1 failed "
        "(the router's log says why)"
    )
    for key, model, known in ((base, "other-sql", "other"), (tuned, "other", "other-sql")):
        status, _, err = call(router, key, model=model)
        assert status == 404 and err["error"]["message"].endswith(f"(known: {known})"), err
        req = urllib.request.Request(
            router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == [known]


def test_limits_answer_429_with_retry_after(cluster: tuple[LocalEtcd, Router]) -> None:
    etcd, router = cluster
    key = ctl(etcd, "create", "--tenant", "slow", "--rps", "1")["key"]
    until(lambda: call(router, key)[0] == 200)  # known, and a token in the bucket
    status, headers, err = call(router, key)  # the bucket is empty right after
    assert status == 429 and headers["Retry-After"] == "1"
    assert (
        err["error"]["type"] == "rate_limit_error"
        and "requests per second" in err["error"]["message"]
    )


def test_rotate_keeps_the_old_key_for_its_grace_period(cluster: tuple[LocalEtcd, Router]) -> None:
    etcd, router = cluster
    old = ctl(etcd, "create", "--tenant", "rot", "--models", "sim,other")
    until(lambda: call(router, old["key"])[0] == 200)
    new = ctl(etcd, "rotate", old["id"], "--grace", "2")
    assert new["tenant"] == "rot" and new["models"] == ["sim", "other"] and new["id"] != old["id"]
    until(lambda: call(router, new["key"])[0] == 200)
    assert call(router, old["key"])[0] == 200  # still inside its grace period
    until(lambda: call(router, old["key"])[0] == 401, timeout_s=10)
    assert call(router, old["key"])[2]["error"]["code"] == "expired_key"


def test_tenants_never_share_cached_prompts_unless_their_keys_share_a_group(
    cluster: tuple[LocalEtcd, Router],
) -> None:
    """#58: the same prompt from another tenant is computed afresh, and routed as uncached
    (the router's hashes are salted too); keys naming one kv_share_group share. Paired: a
    tenant's own repeat is a hit, so a miss is isolation, not caching switched off."""
    etcd, router = cluster
    a, b = (ctl(etcd, "create", "--tenant", t)["key"] for t in ("kv-a", "kv-b"))
    c, d = (ctl(etcd, "create", "--tenant", t, "--kv-share-group", "acme")["key"]
            for t in ("kv-c", "kv-d"))  # fmt: skip
    # a name that differs from an existing one only in case is refused, not a new tenant
    res = subprocess.run([CTL, "keys", "create", "--tenant", "KV-A", "--etcd", etcd.endpoint],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "'KV-A' differs from the existing 'kv-a'" in res.stderr
    assert "Traceback" not in res.stderr
    listed = {k["tenant"]: k["kv_share_group"] for k in ctl(etcd, "list")}
    assert listed["kv-c"] == listed["kv-d"] == "acme" and listed["kv-a"] == ""
    for key in (a, b, c, d):
        until(lambda key=key: call(router, key)[0] == 200)
    prompt = [1000 + i for i in range(640)]  # token ids: the router hashes them exactly

    def ask(key: str) -> tuple[int, float]:  # (cached tokens, tokens the router predicted)
        before = metric(router.admin, "cgn_router_prefix_tokens_predicted_total", model="sim")
        status, _, doc = call(router, key, prompt=prompt)
        assert status == 200, doc
        after = metric(router.admin, "cgn_router_prefix_tokens_predicted_total", model="sim")
        return doc["usage"]["prompt_tokens_details"]["cached_tokens"], after - before

    assert ask(a)[0] == 0
    until(lambda: min(ask(a)) >= 624)  # a's own repeat: cached, and routed as cached
    assert ask(b) == (0, 0)  # another tenant: neither
    assert ask(a)[0] >= 624  # a's blocks are still there: b's miss was isolation
    assert ask(c)[0] == 0
    until(lambda: min(ask(d)) >= 624)  # d shares c's group: c's blocks serve it
    # a client's own salt is refused: with it, a client could join another tenant's cache
    status, _, err = call(router, a, extra={"cache_salt": "kv-c"})
    assert status == 400 and err["error"]["param"] == "cache_salt"


def test_a_tenants_budget_holds_across_routers_and_their_restarts(
    cluster: tuple[LocalEtcd, Router], tmp_path: Path
) -> None:
    """#58: each router counts what it serves and publishes it; a budget covers what every
    router served, a restarted router takes its own count back up, and past the budget
    every router answers 429 budget_exhausted with the time it resets."""
    etcd, router = cluster
    key = ctl(etcd, "create", "--tenant", "metered")["key"]
    until(lambda: call(router, key)[0] == 200)
    config = {"etcd": {"endpoints": [etcd.endpoint]}, "auth": {"enabled": True},
              "reconciler": {"enabled": False}, "budgets": {"instance": "second"}}  # fmt: skip

    def mine() -> Any:  # the second router's published count of "metered"
        doc = etcd_run(etcd.endpoint, lambda c: c.get_json("/cognitora/usage/second.w0/metered"))
        return doc[1] if doc else 0  # [day, tokens today, this month, joules today]

    served = 0
    with cgn_router(tmp_path, config) as second:
        until(lambda: call(second, key)[0] == 200)
        for _ in range(2):
            status, _, doc = call(second, key)
            served += doc["usage"]["total_tokens"]
    assert mine() >= served  # written when it stopped, whatever its publish interval
    with cgn_router(tmp_path, config) as second:  # restarted: its count is taken up again
        until(lambda: call(second, key)[0] == 200)
        until(lambda: mine() > served)
        assert mine() > served + 2  # what it served before the restart is still counted
        rows = {r["tenant"]: r for r in tenants(etcd, "list")}
        used = rows["metered"]["used"]["tokens_today"]
        tenants(etcd, "set", "metered", "--tokens-per-day", str(int(used) + 1))
        # the first router: within the budget (by one token), then past it
        until(lambda: call(router, key)[0] == 429)
        status, headers, err = call(router, key)
        assert status == 429 and err["error"]["code"] == "budget_exhausted"
        assert "tokens per day; the budget resets at" in err["error"]["message"]
        assert 1 <= int(headers["Retry-After"]) <= 86401
        # once the first's count is published (within its 1 s interval), the second knows
        # within a watch delay: it serves that tenant at most one request more
        until(lambda: {r["tenant"]: r for r in tenants(etcd, "list")}["metered"]["exhausted"])
        answers: list[int] = []
        until(lambda: answers.append(call(second, key)[0]) or answers[-1] == 429, timeout_s=5)
        assert answers.count(200) <= 1, answers
        rows = {r["tenant"]: r for r in tenants(etcd, "list")}
        assert rows["metered"]["exhausted"]["budget"] == "tokens_per_day"
        # bounded overshoot: what the first served past the budget was its last request
        assert rows["metered"]["used"]["tokens_today"] <= used + 1 + 2 * served
        assert metric(second.admin, "cgn_router_tenant_budget_remaining", tenant="metered",
                      budget="tokens_per_day") == 0  # fmt: skip
        tenants(etcd, "delete", "metered")
        until(lambda: call(second, key)[0] == 200)
    bad = subprocess.run([CTL, "tenants", "set", "metered", "--tokens-per-day", "nan",
                          "--etcd", etcd.endpoint], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "tokens_per_day must be positive" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_key_with_a_budget_of_its_own_is_refused_past_it(
    cluster: tuple[LocalEtcd, Router],
) -> None:
    """`keys create --tokens-per-day`: that key is refused past its own budget, with its id
    named; its tenant's other keys go on."""
    etcd, router = cluster
    capped = ctl(etcd, "create", "--tenant", "split", "--tokens-per-day", "1")
    other = ctl(etcd, "create", "--tenant", "split")["key"]
    assert capped["budget"]["tokens_per_day"] == 1
    until(lambda: call(router, capped["key"])[0] == 200)  # within: 0 of 1 used
    status, _, err = call(router, capped["key"])
    assert status == 429 and err["error"]["code"] == "budget_exhausted"
    assert f"key {capped['id']} has used" in err["error"]["message"]
    until(lambda: call(router, other)[0] == 200)


def tenants(etcd: LocalEtcd, *args: str) -> Any:
    json_flag = [] if args[0] == "delete" else ["--json"]
    res = subprocess.run([CTL, "tenants", *args, "--etcd", etcd.endpoint, *json_flag],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout) if json_flag else res.stdout


def test_management_paths_need_an_admin_key(cluster: tuple[LocalEtcd, Router]) -> None:
    """The admin listener without TLS: health and metrics stay open; /endpoints and
    /reconciler need a key with the admin scope (401 without a key, 403 without the scope)."""
    etcd, router = cluster

    def admin(path: str, key: str | None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        req = urllib.request.Request(router.admin + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.load(resp) if path != "/metrics" else None
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.load(exc)

    user = ctl(etcd, "create", "--tenant", "acme", "--band", "gold")["key"]
    operator = ctl(etcd, "create", "--tenant", "ops", "--band", "gold", "--admin")["key"]
    until(lambda: call(router, operator)[0] == 200)  # the router has seen both keys
    for path in ("/healthz", "/readyz", "/metrics"):
        assert admin(path, None)[0] == 200, path
    for path in ("/endpoints", "/reconciler"):
        status, err = admin(path, None)
        assert status == 401 and err["error"]["type"] == "authentication_error", path
        status, err = admin(path, user)
        assert status == 403 and err["error"]["code"] == "admin_required", path
        assert admin(path, operator)[0] == 200, path
    assert "endpoints" in admin("/endpoints", operator)[1]


def test_an_over_budget_prompt_is_refused_before_it_is_forwarded() -> None:
    """The limiter charges an estimate (bytes / 4) before tokenizing; the exact count then
    either fits what the key held when the request came, or the request is a 429 and the
    estimate is refunded (nothing forwarded, nothing charged)."""
    from cgn_core.apikeys import Limits, create
    from cgn_core.errors import RateLimited
    from cgn_router.auth import Limiter, Principal

    _, record = create("t", "gold", limits=Limits(tokens_per_min=1000))
    who, limiter, t = Principal(record.id, "t", "gold", record), Limiter(), 100.0
    limiter.acquire(who, 100, now=t)
    limiter.settle(who, 100, 900, now=t)  # fits: 1000 were held
    limiter.release(who)
    bucket = limiter.usage[record.id].tokens
    assert bucket is not None and bucket.level == pytest.approx(100)
    limiter.acquire(who, 50, now=t)  # the estimate fits what is left ...
    with pytest.raises(RateLimited) as refused:  # ... the exact count does not
        limiter.settle(who, 50, 600, now=t)
    assert refused.value.retry_after_s >= 30  # 500 tokens at 1000 per minute
    limiter.release(who)
    assert bucket.level == pytest.approx(100)  # the estimate refunded, nothing charged
    limiter.acquire(who, 50, now=t)
    limiter.settle(who, 50, 20, now=t)  # an overestimate is refunded
    assert bucket.level == pytest.approx(80)
    limiter.release(who)


def test_a_prompt_over_the_keys_whole_budget_is_a_400_even_on_a_fresh_key() -> None:
    """No wait would ever admit it: 400, nothing charged (it was served once before)."""
    from cgn_core.apikeys import Limits, create
    from cgn_core.errors import InvalidRequest
    from cgn_router.auth import Limiter, Principal

    _, record = create("t", "gold", limits=Limits(tokens_per_min=1000))
    who, limiter, t = Principal(record.id, "t", "gold", record), Limiter(), 100.0
    for estimate, exact in ((3000, 3000), (200, 400_000)):
        limiter.acquire(who, estimate, now=t)  # an estimate over the budget takes it whole
        with pytest.raises(InvalidRequest, match="exceed the key's whole budget of 1000"):
            limiter.settle(who, estimate, exact, now=t)
        limiter.release(who)
        bucket = limiter.usage[record.id].tokens
        assert bucket is not None and bucket.level == pytest.approx(1000)


def test_a_keys_limits_hold_across_workers() -> None:
    """Two workers' limiters on one shared table count a key once: its requests per second,
    its requests in flight; a worker that restarts forgets only its own requests in flight."""
    import os

    from cgn_core.apikeys import Limits, create
    from cgn_core.errors import RateLimited
    from cgn_router.auth import Limiter, Principal
    from cgn_router.workers import shared

    fd = shared.create(shared.USAGE, 2)
    views = [shared.SharedUsage(fd, 2, w) for w in (0, 1)]
    try:
        one, two = (Limiter(shared=v) for v in views)
        _, record = create("t", "gold", limits=Limits(rps=2, concurrent=3))
        who, t = Principal(record.id, "t", "gold", record), 100.0
        one.acquire(who, 10, now=t)
        two.acquire(who, 10, now=t)
        with pytest.raises(RateLimited, match="requests per second"):
            one.acquire(who, 10, now=t)  # the bucket of 2 is empty, whichever worker asks
        two.acquire(who, 10, now=t + 1.0)  # refilled: 2 a second
        with pytest.raises(RateLimited, match="3 requests in flight"):
            one.acquire(who, 10, now=t + 5.0)
        one.release(who)
        one.acquire(who, 10, now=t + 5.0)  # 3 in flight again: 1 in worker 0, 2 in worker 1
        views[1].close()
        views[1] = shared.SharedUsage(fd, 2, 1)  # worker 1 restarted: its 2 are gone
        one.acquire(who, 10, now=t + 9.0)
        one.acquire(who, 10, now=t + 9.0)
        with pytest.raises(RateLimited, match="3 requests in flight"):
            Limiter(shared=views[1]).acquire(who, 10, now=t + 20.0)
        assert not one.usage  # nothing was counted outside the shared table
    finally:
        for v in views:
            v.close()
        os.close(fd)
