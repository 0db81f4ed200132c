"""cgn-ctl against a real etcd: the catalog, nodes, replicas, explain-placement, cordon, drain, status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cgn_core.etcd.local import LocalEtcd
from harness.procs import etcd_put, etcd_run

pytestmark = pytest.mark.etcd
CTL = str(Path(sys.executable).parent / "cgn-ctl")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """A private etcd: these tests write /cognitora/ keys other modules' routers would see."""
    server = LocalEtcd(tmp_path_factory.mktemp("ctl") / "etcd")
    server.start()
    yield server
    server.stop()


def ctl(etcd: LocalEtcd, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CTL, *args, "--etcd", etcd.endpoint], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def ok_json(etcd: LocalEtcd, *args: str) -> Any:
    res = ctl(etcd, *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def write(tmp: Path, text: str) -> str:
    path = tmp / "model.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


GPU_NODE = {"node": "g1", "node_class": "h100-80g", "engines": ["vllm", "cgn_infer"],
            "accelerators": [{"index": 0, "accel_class": "h100-80g", "health": []},
                             {"index": 1, "accel_class": "h100-80g", "health": ["uncorrected ECC errors: 4"]}],
            "power": {"watts": 700.0}, "cpu": {"cores": 64}}  # fmt: skip
CPU_NODE = {"node": "c1", "node_class": "cpu", "engines": ["cgn_infer"], "accelerators": [],
            "power": {"watts": None}, "cpu": {"cores": 2}}  # fmt: skip


def test_models_apply_list_get_delete(etcd: LocalEtcd, tmp_path: Path) -> None:
    f = write(
        tmp_path,
        """\
        name: small
        source: smollm2
        replicas: {min: 1, max: 2}
        aliases: [tiny]
        profiles:
          - {engine: cgn_infer, backend: sim}
        ---
        name: big
        source: meta-llama/Llama-3.1-8B-Instruct
        fallbacks: [small]
        profiles:
          - {engine: vllm, accelerator: h100-80g, devices: 2, tensor_parallel: 2}
          - {engine: cgn_infer, source: smollm2}
        """,
    )
    res = ctl(etcd, "models", "apply", "-f", f)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["model big applied", "model small applied"]
    rows = {r["model"]: r for r in ok_json(etcd, "models", "list")}
    assert rows["small"]["aliases"] == ["tiny"] and rows["small"]["max"] == 2
    assert rows["small"]["managed_by"] is None  # applied here, not by a Kubernetes resource
    assert rows["big"]["profiles"] == ["vllm@h100-80g×2", "cgn_infer@cpu"]
    got = ok_json(etcd, "models", "get", "big")
    assert got["fallbacks"] == ["small"] and got["replicas"] == {"min": 1, "max": 1}
    table = ctl(etcd, "models", "list")
    assert "small" in table.stdout and "0/0/-, 1–2" in table.stdout  # no autoscaler target yet
    # bounds changed in place, checked like apply
    res = ctl(etcd, "models", "scale", "small", "--max", "4")
    assert res.returncode == 0 and res.stdout.strip() == "model small: min 1, max 4", res.stderr
    assert ok_json(etcd, "models", "get", "small")["replicas"] == {"min": 1, "max": 4}
    for args, why in ((["--min", "5", "--max", "3"], "min 5 is above max 3"),
                      (["--max", "9999"], "expected an integer in [1, 4096]"),
                      (["--role", "decode", "--max", "2"], "--role applies to a disaggregated"),
                      ([], "give --min, --max or both")):  # fmt: skip
        res = ctl(etcd, "models", "scale", "small", *args)
        assert res.returncode == 2 and why in res.stderr, res.stderr
    assert ctl(etcd, "models", "scale", "nope", "--max", "2").returncode == 1
    # small cannot go while big falls back to it
    res = ctl(etcd, "models", "delete", "small")
    assert (
        res.returncode == 1
        and res.stderr.strip() == "error: small is the fallback of big; change those first"
    )
    assert ctl(etcd, "models", "delete", "big").returncode == 0
    assert (
        ctl(etcd, "models", "get", "big").stderr.strip()
        == "error: model 'big' is not in the catalog"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nsource: s\nprofiles: [{engine: vllm, accelerator: h100-80g, devices: 2, tensor_parallel: 4}]\n",
         "profiles[0].tensor_parallel: 4 does not divide devices × nodes = 2"),
        ("name: x\nsource: s\nfallbacks: [nothing]\nprofiles: [{engine: cgn_infer}]\n",
         "x: fallbacks[0]: 'nothing' names no model in the catalog"),
        ("name: x\nsource: s\naliases: [small]\nprofiles: [{engine: cgn_infer}]\n",
         "x: aliases[0]: 'small' is the name of a model"),
        ("name: x\nsource: s\nprofiles: [{engine: cgn_infer, colour: red}]\n", "profiles[0].colour: unknown field"),
        ("name: [unclosed\n", "not YAML"),
    ],
)  # fmt: skip
def test_bad_models_are_refused_with_the_field_path_and_nothing_written(
    etcd: LocalEtcd, tmp_path: Path, text: str, message: str
) -> None:
    res = ctl(etcd, "models", "apply", "-f", write(tmp_path, text))
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.startswith("error: ") and message in res.stderr and "Traceback" not in res.stderr
    )
    assert "x" not in {r["model"] for r in ok_json(etcd, "models", "list")}


def test_an_adapter_of_another_base_is_refused_at_apply_naming_both(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    from cgn_core.bundled_models import smollm2
    from harness.lora import write_adapter

    base = smollm2()
    good = write_adapter(base, tmp_path / "sql.gguf", layers=(0,))
    foreign = write_adapter(base, tmp_path / "qwen.gguf", layers=(0,), arch="qwen2")
    text = f"name: lora-m\nsource: {base}\nprofiles: [{{engine: cgn_infer}}]\nadapters:\n"
    res = ctl(
        etcd, "models", "apply", "-f", write(tmp_path, text + f"  q: {{source: {foreign}}}\n")
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"adapters.q: adapter {foreign} is for architecture 'qwen2'" in res.stderr
    assert str(base) in res.stderr
    res = ctl(etcd, "models", "apply", "-f", write(tmp_path, text + f"  sql: {{source: {good}}}\n"))
    assert res.returncode == 0, res.stderr
    stored = ok_json(etcd, "models", "get", "lora-m")
    assert stored["adapters"] == {"sql": {"source": str(good)}} and stored["max_adapters"] == 4
    # where it is loaded, as the agents' status records say, and why
    place, status = "/cognitora/placements/c9/r-a", "/cognitora/replicas/c9/r-a"
    etcd_put(etcd.endpoint, place, {"model": "lora-m", "engine": "cgn_infer"})
    etcd_put(etcd.endpoint, status, {"phase": "Ready", "model": "lora-m", "adapters": ["sql"]})
    [row] = ok_json(etcd, "replicas", "--model", "lora-m")
    assert row["adapters"] == ["sql"] and row["phase"] == "Ready"
    [sql] = ok_json(etcd, "explain-placement", "lora-m")["adapters"]
    assert sql == {"adapter": "sql", "source": str(good), "pin": False, "held_by": ["c9/r-a"],
                   "why": "cgn_infer: loaded on demand where the router sends its requests; "
                          "the least recently used idle adapter is evicted past max_adapters 4"}  # fmt: skip
    text = ctl(etcd, "explain-placement", "lora-m").stdout
    assert "held by" in text and "c9/r-a" in text and "loaded on demand" in text
    etcd_run(etcd.endpoint, lambda c: c.delete("/cognitora/placements/c9/", prefix=True))
    etcd_run(etcd.endpoint, lambda c: c.delete("/cognitora/replicas/c9/", prefix=True))
    assert ctl(etcd, "models", "delete", "lora-m").returncode == 0


@pytest.mark.slow
def test_nodes_replicas_explain_cordon_and_status(etcd: LocalEtcd, tmp_path: Path) -> None:
    etcd_put(etcd.endpoint, "/cognitora/nodes/g1", GPU_NODE)
    etcd_put(etcd.endpoint, "/cognitora/nodes/c1", CPU_NODE)
    etcd_put(
        etcd.endpoint, "/cognitora/placements/gone/r9", {"model": "small", "engine": "cgn_infer"}
    )
    assert ctl(etcd, "models", "apply", "-f", write(tmp_path, """\
        name: gpu-model
        source: s
        profiles: [{engine: vllm, accelerator: h100-80g, devices: 2}]
        """)).returncode == 0  # fmt: skip
    nodes = {n["node"]: n for n in ok_json(etcd, "nodes")}
    assert nodes["g1"]["unhealthy"] == [{"index": 1, "why": "uncorrected ECC errors: 4"}]
    assert nodes["gone"]["state"] == "unreachable" and nodes["gone"]["replicas"] == ["r9"]
    reps = ok_json(etcd, "replicas")
    assert reps == [{"replica": "r9", "node": "gone", "model": "small", "engine": "cgn_infer", "role": "both", "devices": [],
                     "phase": "Pending", "url": None, "restarts": 0, "reason": "", "node_state": "unreachable", "part": "",
                     "adapters": []}]  # fmt: skip
    why = ok_json(etcd, "explain-placement", "gpu-model")
    assert why["profile"] is None
    assert {c["node"]: c["reason"] for c in why["candidates"]} == {
        "c1": "vllm is not installed on this node",
        "g1": "needs 2 free h100-80g device(s): 1 free of 2 h100-80g, 1 unhealthy (uncorrected ECC errors: 4)",
        "gone": "node is unreachable",
    }
    # CPU replicas: equal counts, so power breaks the tie: g1 reports its watts, c1 does not
    assert ok_json(etcd, "explain-placement", "small")["nodes"] == [["g1", []]]
    assert ctl(etcd, "cordon", "g1", "--reason", "disk swap").stdout.strip() == "g1 cordoned"
    assert ok_json(etcd, "explain-placement", "small")["nodes"] == [["c1", []]]
    assert {n["node"]: n["state"] for n in ok_json(etcd, "nodes")}["g1"] == "cordoned"
    st = ok_json(etcd, "status")
    assert st["leader"] is None and "gpu-model" in st["unplaceable"]
    assert "reconciler leader: none" in ctl(etcd, "status").stdout
    assert ctl(etcd, "uncordon", "g1").stdout.strip() == "g1 uncordoned"
    assert ctl(etcd, "uncordon", "g1").stdout.strip() == "g1 was not cordoned"
    drained = ctl(etcd, "drain", "g1", "--no-wait", "--grace", "30")
    assert drained.returncode == 0 and drained.stdout.strip() == "g1 drained"
    assert {n["node"]: n["state"] for n in ok_json(etcd, "nodes")}["g1"] == "draining"
    assert (
        ctl(etcd, "explain-placement", "nope").stderr.strip()
        == "error: model 'nope' is not in the catalog"
    )
    assert (
        ctl(etcd, "explain-placement", "small", "--role", "prefill").stderr.strip()
        == "error: model 'small' has no prefill pool (its pools: both)"
    )
    assert ctl(etcd, "drain", "g1", "--grace", "0").returncode == 2


def test_operator_mistakes_are_refused_in_one_line(etcd: LocalEtcd, tmp_path: Path) -> None:
    etcd_put(etcd.endpoint, "/cognitora/nodes/c1", CPU_NODE)
    typo = ctl(etcd, "cordon", "c1-typo")
    assert typo.returncode == 2 and typo.stderr.startswith("error: no node 'c1-typo' is registered")
    assert etcd_get(etcd, "/cognitora/cordon/c1-typo") is None
    typo = ctl(etcd, "drain", "c1-typo", "--no-wait")  # it exited 0 and wrote a cordon
    assert typo.returncode == 2 and typo.stderr.startswith("error: no node 'c1-typo' is registered")
    assert etcd_get(etcd, "/cognitora/cordon/c1-typo") is None
    assert ctl(etcd, "drain", "c1", "--grace", "nan").returncode == 2
    pre = ctl(etcd, "cordon", "c9", "--pre")
    assert pre.returncode == 0 and pre.stdout.strip() == "c9 pre-cordoned (it has not joined yet)"
    band = ctl(etcd, "keys", "create", "--tenant", "acme", "--band", "golden")
    assert band.returncode == 2 and "band 'golden' is not one of the routers' bands" in band.stderr
    for content, why in (
        (b"\xff\xfe", "not UTF-8 text"),
        (b"a: " + b"[" * 5000, "nested too deeply"),
    ):
        path = tmp_path / "bad.yaml"
        path.write_bytes(content)
        res = ctl(etcd, "models", "apply", "-f", str(path))
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr


def test_record_text_reaches_the_terminal_as_text(etcd: LocalEtcd) -> None:
    """A forged node record's escape sequences and markup are shown, never obeyed."""
    evil = "e\x1b]0;pwned\x07\x1b[2J[red]x[/red]\u202e"
    etcd_put(etcd.endpoint, "/cognitora/nodes/evil1", {**CPU_NODE, "node": "evil1",
             "node_class": evil, "engines": [evil]})  # fmt: skip
    shown = subprocess.run([CTL, "nodes", "--etcd", etcd.endpoint], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})  # fmt: skip
    assert shown.returncode == 0 and "pwned" in shown.stdout, shown.stdout + shown.stderr
    assert "\x1b" not in shown.stdout and "\u202e" not in shown.stdout
    assert "[red]x[/red]" in shown.stdout.replace("\n", "")


def test_commands_find_the_etcd_that_up_started(etcd: LocalEtcd, tmp_path: Path) -> None:
    """With no --etcd, cgn-ctl reads the etcd `up` recorded (it may have moved off 2379)."""
    etcd_put(etcd.endpoint, "/cognitora/nodes/c1", CPU_NODE)
    state = tmp_path / "state"
    state.mkdir()
    (state / "up.json").write_text(json.dumps({"etcd": etcd.endpoint, "processes": []}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGN_CTL_")}
    res = subprocess.run([CTL, "nodes", "--json"], capture_output=True, text=True, timeout=60,
                         env={**env, "CGN_CTL_STATE_DIR": str(state)})  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "c1" in {n["node"] for n in json.loads(res.stdout)}


def etcd_get(etcd: LocalEtcd, key: str) -> Any:
    from harness.procs import etcd_run

    return etcd_run(etcd.endpoint, lambda c: c.get(key))


def test_explain_route_renders_any_answer_and_refuses_what_is_not_one() -> None:
    """The router's answer is a stranger's JSON: a figure that is not a number shows as "-",
    never a traceback; no router there is one line that says so."""
    from rich.console import Console

    from cgn_ctl.route_cmd import RouteUnexplained, ask, table

    odd = {"model": "m", "chosen": "m/a", "candidates": [
        {"id": "m/a", "chosen": True, "total": "NaN", "predicted_ttft_ms": None,
         "terms_ms": [1], "lag": True, "hit_tokens": 32, "speed": "fast"},
        "not a row",
    ]}  # fmt: skip
    out = Console(width=200, record=True)
    out.print(table(odd))
    text = out.export_text()
    assert "m/a" in text and "32" in text and "prior" in text
    with pytest.raises(RouteUnexplained, match="cannot ask the router at "):
        ask("http://127.0.0.1:9", {"model": "m", "prompt": "hi"}, None, None)
