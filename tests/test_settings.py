"""Settings: layering flag > env > YAML > defaults, and errors that say where they came from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cgn_agent.settings import AgentSettings
from cgn_core.settings import EtcdSettings, SettingsError, load_settings, settings_to_dict
from cgn_ctl.settings import CtlSettings
from cgn_infer.settings import InferSettings
from cgn_kvcached.settings import KvcachedSettings
from cgn_metrics.settings import MetricsSettings
from cgn_operator.settings import OperatorSettings
from cgn_router.settings import RouterSettings

from .conftest import REPO

TREES = {
    "router": RouterSettings,
    "agent": AgentSettings,
    "kvcached": KvcachedSettings,
    "metrics": MetricsSettings,
    "ctl": CtlSettings,
    "operator": OperatorSettings,
    "infer": InferSettings,
}


@pytest.mark.parametrize("service", sorted(TREES))
def test_example_config_loads(service: str) -> None:
    path = REPO / "configs" / f"{service}.yaml"
    settings = load_settings(TREES[service], service, yaml_path=path)
    assert dataclasses.is_dataclass(settings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.log = None  # type: ignore[misc]


def test_example_values_are_applied() -> None:
    s = load_settings(RouterSettings, "router", yaml_path=REPO / "configs/router.yaml")
    assert s.http.host == "0.0.0.0" and s.log.format == "json"
    k = load_settings(KvcachedSettings, "kvcached", yaml_path=REPO / "configs/kvcached.yaml")
    assert k.ssd_dir == Path("/var/lib/cognitora/kv") and k.ssd_bytes == 100 << 30


def test_layers_flag_over_env_over_yaml_over_default(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("http: {port: 1001}\nadmin: {port: 2001}\netcd: {timeout_s: 3}\n")
    env = {"CGN_ROUTER_ADMIN__PORT": "2002", "CGN_ROUTER_HTTP__PORT": "1002", "OTHER": "x"}
    s = load_settings(RouterSettings, "router", yaml_path=cfg, env=env, flags={"http.port": "1003"})
    assert s.http.port == 1003  # flag
    assert s.admin.port == 2002  # env over YAML
    assert s.etcd.timeout_s == 3.0  # YAML int accepted as float
    assert s.http.host == "127.0.0.1"  # default kept beside an overridden sibling
    assert s.etcd.endpoints == ("127.0.0.1:2379",)


def test_env_parsing_of_lists_bools_optionals() -> None:
    env = {
        "CGN_ROUTER_ETCD__ENDPOINTS": "10.0.0.1:2379, 10.0.0.2:2379",
        "CGN_ROUTER_TLS__CA_FILE": "/etc/ca.pem",
        "CGN_ROUTER_CONFIG": "/ignored/owned/by/the/cli.yaml",
    }
    s = load_settings(RouterSettings, "router", env=env)
    assert s.etcd.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert s.tls.ca_file == Path("/etc/ca.pem") and s.tls.enabled
    k = load_settings(KvcachedSettings, "kvcached", env={"CGN_KVCACHED_SSD_DIR": "none"})
    assert k.ssd_dir is None


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("http: {prot: 1}\n", "r.yaml: http.prot: unknown key"),
        ("htp: {}\n", "r.yaml: htp: unknown key"),
        ("http: {port: '80'}\n", "r.yaml: http.port: expected an integer, got '80'"),
        ("http: {port: true}\n", "r.yaml: http.port: expected an integer, got True"),
        ("http: 8080\n", "r.yaml: http: expected a mapping of settings"),
        ("log: {level: loud}\n", "r.yaml: log.level: expected one of debug, info"),
        ("etcd: {endpoints: 5}\n", "r.yaml: etcd.endpoints: expected a list"),
        ("etcd: {tls: {ca_file: 3}}\n", "r.yaml: etcd.tls.ca_file: expected a path"),
        ("endpoints: {a: 1}\n", "r.yaml: endpoints.a: expected a mapping of settings, got int"),
        ("endpoints: {a: {uri: x}}\n", "r.yaml: endpoints.a.uri: unknown key"),
        ("endpoints: {a: {url: 1}}\n", "r.yaml: endpoints.a.url: expected a string"),
        ("- a\n- b\n", "r.yaml: the top level must be a mapping, got a list"),
        ("http: {port: [\n", "r.yaml: not valid YAML (line"),
    ],
)
def test_yaml_errors_name_file_and_path(tmp_path: Path, yaml_text: str, message: str) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SettingsError) as info:
        load_settings(RouterSettings, "router", yaml_path=cfg)
    assert message in str(info.value)
    assert str(cfg) in str(info.value)


def test_env_and_flag_errors_name_their_origin(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="environment variable CGN_ROUTER_HTTP__PROT"):
        load_settings(RouterSettings, "router", env={"CGN_ROUTER_HTTP__PROT": "1"})
    with pytest.raises(SettingsError, match=r"flag http\.port=x: expected an integer"):
        load_settings(RouterSettings, "router", flags={"http.port": "x"})
    with pytest.raises(
        SettingsError, match=r"flag log\.level\.x=1: 'log\.level' has no sub-settings"
    ):
        load_settings(RouterSettings, "router", flags={"log.level.x": "1"})
    with pytest.raises(SettingsError, match="cannot read settings file"):
        load_settings(RouterSettings, "router", yaml_path=tmp_path / "missing.yaml")


def test_bool_parsing() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class T:
        on: bool = False

    assert load_settings(T, "t", env={"CGN_T_ON": "yes"}).on is True
    assert load_settings(T, "t", env={"CGN_T_ON": "0"}).on is False
    with pytest.raises(SettingsError, match="expected true or false"):
        load_settings(T, "t", env={"CGN_T_ON": "maybe"})


def test_empty_yaml_is_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("# nothing\n")
    assert load_settings(EtcdSettings, "x", yaml_path=cfg) == EtcdSettings()


def test_round_trip_to_plain_data() -> None:
    d = settings_to_dict(load_settings(InferSettings, "infer"))
    assert d["http"] == {"host": "127.0.0.1", "port": 8001, "idle_timeout_s": 15.0,
                         "body_timeout_s": 60.0}  # fmt: skip
    assert d["backend"] == "torch" and d["model"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"http.port": "70000"}, "http.port must be 0-65535, got 70000"),
        ({"http.port": "-1"}, "http.port must be 0-65535, got -1"),
        ({"http.idle_timeout_s": "0"}, "http.idle_timeout_s must be positive"),
    ],
)
def test_listener_values_are_range_checked(flags: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(InferSettings, "infer", flags=flags)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\xff\xfehttp: {}", "not UTF-8 text"), (b"a: " + b"[" * 5000, "nested too deeply")],
)
def test_unreadable_yaml_is_one_settings_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "s.yaml"
    path.write_bytes(content)
    with pytest.raises(SettingsError, match=message):
        load_settings(RouterSettings, "router", yaml_path=path)
