"""Settings: layering flag > env > YAML > defaults, and errors that say where they came from."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from cgn_agent.settings import AgentSettings
from cgn_core.settings import (
    RANGE,
    EtcdSettings,
    SettingsError,
    load_settings,
    numeric_fields,
    settings_to_dict,
)
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
        ({"http.port": "70000"}, r"http.port must be in \[0, 65535\], got 70000"),
        ({"http.port": "-1"}, r"http.port must be in \[0, 65535\], got -1"),
        ({"http.idle_timeout_s": "0"}, r"http.idle_timeout_s must be in \[0.01, 3600\]"),
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


# ---- every numeric setting has a range, and a value outside it is refused ----


def _numeric_settings() -> list[tuple[str, list[Any], dataclasses.Field[Any], type]]:
    """(service, YAML path to the field, the field, its type) for every int and float field
    of every service's tree: a dict of settings by one entry "x", a tuple by one item."""
    found = []

    def walk(service: str, cls: type, trail: list[Any]) -> None:
        hints = typing.get_type_hints(cls)
        numeric = {f.name for f in numeric_fields(cls)}
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if f.name in numeric:
                found.append((service, [*trail, f.name], f, float if float in _types(tp) else int))
            elif dataclasses.is_dataclass(tp):
                walk(service, tp, [*trail, f.name])
            elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
                walk(service, typing.get_args(tp)[1], [*trail, f.name, "x"])
            elif typing.get_origin(tp) is tuple and dataclasses.is_dataclass(
                typing.get_args(tp)[0]
            ):
                walk(service, typing.get_args(tp)[0], [*trail, f.name, 0])

    for service, cls in sorted(TREES.items()):
        walk(service, cls, [])
    return found


def _types(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) or (tp,)


def _nested(path: list[Any], value: Any) -> Any:
    for key in reversed(path):
        value = [value] if key == 0 else {key: value}
    return value


NUMERIC = _numeric_settings()


def test_every_numeric_setting_declares_a_range_that_holds_its_default() -> None:
    assert len(NUMERIC) > 100  # the walk reaches every tree
    unranged = [
        f"{s}: {'.'.join(map(str, p))}" for s, p, f, _ in NUMERIC if RANGE not in f.metadata
    ]
    assert not unranged, f"numeric settings without ranged(default, low, high): {unranged}"
    for service, path, f, _ in NUMERIC:
        low, high = f.metadata[RANGE]
        assert low <= f.default <= high, (service, path)


@pytest.mark.parametrize(
    ("service", "path", "field", "kind"),
    NUMERIC,
    ids=[f"{s}:{'.'.join(map(str, p))}" for s, p, _, _ in NUMERIC],
)
def test_a_numeric_setting_outside_its_range_is_a_one_line_error(
    service: str, path: list[Any], field: dataclasses.Field[Any], kind: type, tmp_path: Path
) -> None:
    low, high = field.metadata[RANGE]
    bad: list[Any] = [kind(high * 2 + 1), kind(low - 1)]
    if kind is float:
        bad += [math.nan, math.inf]
    for value in bad:
        doc = tmp_path / "settings.yaml"
        doc.write_text(yaml.safe_dump(_nested(path, value)))
        with pytest.raises(SettingsError) as err:
            load_settings(TREES[service], service, yaml_path=doc)
        message = err.value.message
        assert f"{field.name} must be in [" in message and "\n" not in message, message
    for value in (low, high):  # both ends are in range
        doc.write_text(yaml.safe_dump(_nested(path, kind(value))))
        try:
            load_settings(TREES[service], service, yaml_path=doc)
        except SettingsError as exc:  # another rule across settings may refuse an end
            assert f"{field.name} must be in [" not in exc.message, exc.message


def test_the_issue_55_absurd_values_are_refused() -> None:
    """Each was accepted before ranges: --ctx 10^12, migration.max_tokens=10^30,
    attempts=1e20, kvcached ram_bytes=10^15, scrape_concurrency=0, retention_s=1e12."""
    cases = [
        ("infer", {"ctx": str(10**12)}),
        ("infer", {"sim.engines": "100000"}),
        ("router", {"migration.max_tokens": str(10**30)}),
        ("router", {"attempts": "1e20"}),
        ("kvcached", {"ram_bytes": str(10**15)}),
        ("metrics", {"scrape_concurrency": "0"}),
        ("metrics", {"retention_s": "1e12"}),
    ]
    for service, flags in cases:
        with pytest.raises(SettingsError):
            load_settings(TREES[service], service, flags=flags)
