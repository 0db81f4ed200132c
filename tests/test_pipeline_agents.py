"""A layer pipeline as a multi-node replica, end to end: real etcd, a router running the
reconciler, two agents (two "nodes" on loopback, one fabric) and real SmolLM2 parts.

A model whose profile spans 2 nodes is placed as a head and a stage; the stage's agent runs
`cgn-infer stage --part 1/2`, the reconciler hands its address to the head's placement, the
head's agent starts `cgn-infer serve --stages`, and only the head is routed to. When the
stage is killed, the head fails with it and the replica comes back whole, serving again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from cgn_core.etcd.local import LocalEtcd
from harness.poll import until
from harness.procs import Router, cgn_agent, cgn_router, etcd_run

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]
CTL = str(Path(sys.executable).parent / "cgn-ctl")
MODEL_YAML = """\
name: big
source: smollm2
replicas: {min: 1, max: 1}
profiles:
  - engine: cgn_infer
    nodes: 2
    threads: 1
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Router]]:
    tmp = tmp_path_factory.mktemp("pipeline-cluster")
    etcd = LocalEtcd(tmp / "etcd")
    etcd.start()
    try:
        with ExitStack() as stack:
            for node in ("n1", "n2"):
                cfg = tmp / f"{node}.yaml"
                cfg.write_text(yaml.safe_dump({"labels": {"fabric": "lan"}}))
                stack.enter_context(cgn_agent(
                    tmp / node, etcd.endpoint, "--config", str(cfg), "--set", "lease_ttl_s=2",
                    "--set", "engines.stop_on_exit=true", node=node,
                ))  # fmt: skip
            config = {"etcd": {"endpoints": [etcd.endpoint]},
                      "reconciler": {"interval_s": 0.3, "lease_ttl_s": 2, "rebuild_base_s": 0.5},
                      "scrape": {"interval_s": 0.5}}  # fmt: skip
            router = stack.enter_context(cgn_router(tmp, config))
            yield etcd.endpoint, router
    finally:
        etcd.stop()


def ctl(etcd: str, *args: str, stdin: str | None = None) -> str:
    res = subprocess.run([CTL, *args, "--etcd", etcd], input=stdin, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def parts(etcd: str) -> dict[str, dict[str, Any]]:
    rows = json.loads(ctl(etcd, "replicas", "--json"))
    return {r["part"].split()[0]: r for r in rows if r["model"] == "big" and r["part"]}


def ask(router: Router) -> str:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        out = c.chat.completions.create(
            model="big", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
            temperature=0,
        )  # fmt: skip
    return out.choices[0].message.content or ""


def test_a_two_node_pipeline_is_launched_routed_and_rebuilt(cluster: tuple[str, Router]) -> None:
    etcd, router = cluster
    spec = Path(os.environ.get("TMPDIR", "/tmp")) / f"big-{os.getpid()}.yaml"
    spec.write_text(MODEL_YAML)
    ctl(etcd, "models", "apply", "-f", str(spec))
    ready = until("the pipeline's head is Ready",
                  lambda: (p := parts(etcd)).get("head", {}).get("phase") == "Ready" and p,
                  timeout_s=120)  # fmt: skip
    head, stage = ready["head"], ready["stage"]
    assert head["replica"] == stage["replica"] and head["node"] != stage["node"]
    assert stage["phase"] == "Ready" and stage["part"].startswith("stage 1/2 127.0.0.1:")
    answer = until("the router serves the pipeline", lambda: ask(router), timeout_s=30)
    assert answer
    endpoints = json.loads(ctl(etcd, "status", "--json"))
    assert [m["ready"] for m in endpoints["models"] if m["model"] == "big"] == [1]
    # the stage dies mid-answer: the stream ends with an error event (its first bytes were
    # sent, so it cannot be retried), the head's /health names the stage at once, the
    # agents bring both parts back and the replica serves again
    # NOTE: client and stream closed here: a stream left to the collector warns (and fails)
    # at the module's end, as it once did on CI
    with (
        openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60) as client,
        client.chat.completions.create(
            model="big", messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True},
        ) as stream,
        pytest.raises(openai.APIError, match="stage"),
    ):  # fmt: skip
        for got, _ in enumerate(stream, 1):
            if got == 3:
                os.kill(stage_process(etcd, stage), signal.SIGKILL)
    address = stage["part"].split()[-1]

    def head_health() -> Any:
        try:
            with urllib.request.urlopen(head["url"] + "/health", timeout=5) as r:
                return None if r.status == 200 else r.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return json.loads(exc.read())
        except OSError:  # not listening (restarted already): keep looking
            return None

    health = until("the head's health names the lost stage", head_health, timeout_s=30)
    assert health["status"] == "failed" and address in health["reason"], health
    until(
        "the replica is whole and Ready again",
        lambda: all(p["phase"] == "Ready" for p in parts(etcd).values()),
        timeout_s=120,
    )
    assert until("the router serves it again", lambda: ask(router), timeout_s=60)


def stage_process(etcd: str, stage: dict[str, Any]) -> int:
    """The stage's pid, from its replica status in etcd."""

    async def read(client: Any) -> int:
        doc = await client.get_json(f"/cognitora/replicas/{stage['node']}/{stage['replica']}")
        return int(doc["pid"])

    return etcd_run(etcd, read)
