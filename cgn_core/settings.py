"""Typed, frozen settings trees, loaded as flag > env > YAML > defaults.

A service declares its tree as frozen, slotted dataclasses whose fields all
have defaults. `load_settings` builds it from four layers, each overriding the
one before:

1. the dataclass defaults;
2. a YAML file (`yaml.safe_load`), whose keys must mirror the tree;
3. environment variables `CGN_<SERVICE>_<PATH>`, where nested fields are joined
   with a double underscore: `CGN_ROUTER_HTTP__PORT=8081`,
   `CGN_ROUTER_ETCD__ENDPOINTS=10.0.0.1:2379,10.0.0.2:2379`;
4. flags, as dotted paths (`http.port=8081`), from a CLI.

An unknown key or a value of the wrong type in any layer is a `SettingsError`
that names where it came from: the YAML file and path, the variable, or the
flag. Values from the environment and from flags are strings and are parsed
to the field's type (`true/false/1/0/yes/no/on/off` for booleans, commas for
tuples); YAML values must already have the right type.

Supported field types: bool, int, float, str, Path, Literal[...] of strings,
`X | None`, `tuple[X, ...]`, `dict[str, X]` and nested settings dataclasses (as
fields, or as the items of a tuple or dict, given in YAML).

Every int and float field declares its range where it is declared, with
`ranged(default, low, high)`; a value outside it (or NaN, or an infinity) is
refused as it is built, naming the field and the range
(tests/test_settings.py walks every service's tree: a numeric field without a
range fails it).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from cgn_core.errors import ConfigError
from cgn_core.files import read_regular

T = TypeVar("T")
N = TypeVar("N", int, float)
RANGE = "range"  # a numeric field's metadata key: (low, high), both inclusive
MAX_SETTINGS_BYTES = 16 << 20  # a settings file larger than this is not one

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ConfigError):
    """A settings layer holds an unknown key or a value of the wrong type."""


# ---- common sub-trees shared by the services ---------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class TlsSettings:
    """Files for (mutual) TLS; all empty means plaintext (a development default)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.ca_file is not None


@typing.runtime_checkable
class Checked(typing.Protocol):
    """A settings dataclass with rules beyond its fields' ranges (`ranged`, which the loader
    checks first): with them, the one way settings are validated.

    `check` raises ConfigError naming the field (the loader prefixes its path: `pipeline.stages:
    expected host:port`); a sub-tree's runs as it is built, before its parent's, so a
    service's root settings check last, with the rules that span several settings. Daemons
    validate nothing of their own."""

    def check(self) -> None: ...


def ranged(default: N, low: float, high: float) -> N:
    """A numeric setting: its default and its range [low, high], both inclusive."""
    if not low <= default <= high:
        raise ValueError(f"default {default} is outside [{low}, {high}]")  # a bug in a tree
    field: N = dataclasses.field(default=default, metadata={RANGE: (low, high)})
    return field


def numeric_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The int and float fields of a settings dataclass (`X | None` of them included)."""
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (types.UnionType, typing.Union) and len(members) == 1:
            tp = members[0]
        if tp in (int, float):
            out.append(f)
    return out


def check_ranges(settings: Any) -> None:
    """ConfigError naming the first numeric field of `settings` outside its declared range."""
    for f in numeric_fields(type(settings)):
        value = getattr(settings, f.name)
        bounds = f.metadata.get(RANGE)
        if value is None or bounds is None:
            continue
        low, high = bounds
        if not (math.isfinite(value) and low <= value <= high):
            raise ConfigError(f"{f.name} must be in [{_bound(low)}, {_bound(high)}], got {value!r}")


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclasses.dataclass(frozen=True, slots=True)
class EtcdSettings:
    """How to reach etcd."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    timeout_s: float = ranged(5.0, 0.1, 300)
    tls: TlsSettings = TlsSettings()


@dataclasses.dataclass(frozen=True, slots=True)
class LogSettings:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


@dataclasses.dataclass(frozen=True, slots=True)
class ListenSettings:
    """One HTTP listener. A connection that has not sent a complete request head for
    `idle_timeout_s` (a slow client, or an idle keep-alive one) is closed; a request body
    not read within `body_timeout_s` is refused with 408."""

    host: str = "127.0.0.1"
    port: int = ranged(0, 0, 65535)
    idle_timeout_s: float = ranged(15.0, 0.01, 3600)
    body_timeout_s: float = ranged(60.0, 0.01, 3600)


@dataclasses.dataclass(frozen=True, slots=True)
class TracingSettings:
    """OpenTelemetry traces (cgn_core/tracing.py): off unless `enabled`; spans go to the
    OTLP/gRPC collector at `endpoint` (https:// for TLS). `sample_ratio` of the traces that
    start here are sampled (failed requests always are); at most `queue_spans` wait for
    export, more are dropped and counted."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4317"
    sample_ratio: float = ranged(0.01, 0, 1)
    queue_spans: int = ranged(8192, 1, 1 << 20)
    export_every_s: float = ranged(1.0, 0.01, 3600)
    export_timeout_s: float = ranged(5.0, 0.1, 300)

    def check(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"endpoint must be an http(s):// URL, got {self.endpoint!r}")


# ---- loading -----------------------------------------------------------------


def load_settings(
    cls: type[T],
    service: str,
    *,
    yaml_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, str] | None = None,
    reserved_env: frozenset[str] = frozenset({"CONFIG"}),
) -> T:
    """Build `cls` from defaults, then `yaml_path`, then `env`, then `flags`.

    `service` names the environment prefix (`router` → `CGN_ROUTER_`).
    `reserved_env` lists variable suffixes the loader ignores because a CLI
    owns them (e.g. `CGN_ROUTER_CONFIG` for the config file's path).
    """
    raw: dict[str, Any] = {}
    if yaml_path is not None:
        _merge_yaml(cls, raw, yaml_path)
    prefix = f"CGN_{service.upper()}_"
    for name, value in sorted((env or {}).items()):
        if not name.startswith(prefix) or name[len(prefix) :] in reserved_env:
            continue
        path = name[len(prefix) :].lower().split("__")
        _set_path(cls, raw, path, _Str(value), f"environment variable {name}")
    for dotted, value in (flags or {}).items():
        _set_path(cls, raw, dotted.split("."), _Str(value), f"flag {dotted}={value}")
    return _build(cls, raw)


def settings_to_dict(obj: Any) -> Any:
    """Plain data (for `config show`, JSON and YAML output) from a settings tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: settings_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [settings_to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, Mapping):
        return {k: settings_to_dict(v) for k, v in obj.items()}
    return obj


class _Str(str):
    """A string from the environment or a flag: parsed to the field's type."""


def _merge_yaml(cls: type, raw: dict[str, Any], path: Path) -> None:
    try:
        text = read_regular(path, MAX_SETTINGS_BYTES).decode("utf-8")
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read settings file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise SettingsError(f"{path}: not valid YAML{where}") from None
    except RecursionError:
        raise SettingsError(f"{path}: nested too deeply to be a settings file") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: the top level must be a mapping, got {_kind(data)}")

    def walk(node_cls: type, node: Mapping[str, Any], trail: list[str]) -> None:
        hints = _hints(node_cls)
        for key, value in node.items():
            where = f"{path}: {'.'.join([*trail, str(key)])}"
            if key not in hints:
                raise SettingsError(f"{where}: unknown key (known: {', '.join(sorted(hints))})")
            sub = _dataclass_of(hints[key])
            if sub is not None and isinstance(value, dict):
                walk(sub, value, [*trail, key])
            else:
                _set_path(cls, raw, [*trail, key], value, where)

    walk(cls, data, [])


def _set_path(cls: type, raw: dict[str, Any], path: list[str], value: Any, where: str) -> None:
    node_cls, node = cls, raw
    for i, key in enumerate(path):
        hints = _hints(node_cls)
        if key not in hints:
            raise SettingsError(f"{where}: unknown setting '{'.'.join(path[: i + 1])}'")
        if i == len(path) - 1:
            # Parse now so the error names this layer, not the final build.
            node[key] = _coerce(hints[key], value, where)
            return
        sub = _dataclass_of(hints[key])
        if sub is None:
            raise SettingsError(f"{where}: '{'.'.join(path[: i + 1])}' has no sub-settings")
        node_cls, node = sub, node.setdefault(key, {})


def _build(cls: type[T], raw: Mapping[str, Any], trail: tuple[str, ...] = ()) -> T:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        sub = _dataclass_of(hints[name])
        if sub is not None and isinstance(value, dict):
            kwargs[name] = _build(sub, value, (*trail, name))
        else:
            kwargs[name] = value
    return _checked(cls(**kwargs), ".".join(trail))


def _checked(built: T, where: str) -> T:
    """`built` once its ranges and its own check hold; SettingsError prefixed by `where`."""
    try:
        check_ranges(built)
        if isinstance(built, Checked):  # a sub-tree's own rules, named by its path
            built.check()
    except ConfigError as exc:
        raise SettingsError(f"{where}.{exc.message}" if where else exc.message) from None
    return built


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        members = [a for a in args if a is not type(None)]
        is_null = value is None or (isinstance(value, _Str) and value in ("", "none", "null"))
        if is_null and type(None) in args:
            return None
        return _coerce(members[0], value, where)
    if origin is Literal:
        if value in args:
            return str(value)
        raise SettingsError(f"{where}: expected one of {', '.join(map(str, args))}, got {value!r}")
    if origin is tuple:
        item = args[0]
        if isinstance(value, _Str):
            parts = [p.strip() for p in value.split(",") if p.strip()]
            return tuple(_coerce(item, _Str(p), where) for p in parts)
        if isinstance(value, list):
            return tuple(_coerce(item, v, where) for v in value)
        raise SettingsError(f"{where}: expected a list, got {_kind(value)}")
    if origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
        raise SettingsError(f"{where}: expected a mapping of strings, got {_kind(value)}")
    if (sub := _dataclass_of(tp)) is not None:
        if isinstance(value, dict):  # an entry of a list or a map (YAML)
            hints = _hints(sub)
            for key in value:
                if key not in hints:
                    known = ", ".join(sorted(hints))
                    raise SettingsError(f"{where}.{key}: unknown key (known: {known})")
            built = sub(**{k: _coerce(hints[k], v, f"{where}.{k}") for k, v in value.items()})
            return _checked(built, where)
        raise SettingsError(f"{where}: expected a mapping of settings, got {_kind(value)}")
    return _scalar(tp, value, where)


def _scalar(tp: Any, value: Any, where: str) -> Any:
    from_text = isinstance(value, _Str)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise SettingsError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
        raise SettingsError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
        raise SettingsError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise SettingsError(f"{where}: expected a string, got {_kind(value)} {value!r}")
    if tp is Path:
        if isinstance(value, str) and value:
            return Path(value)
        raise SettingsError(f"{where}: expected a path, got {value!r}")
    raise TypeError(f"settings field type {tp!r} is not supported")  # a bug in a tree


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_of(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "null"}.get(
        type(value), type(value).__name__
    )
