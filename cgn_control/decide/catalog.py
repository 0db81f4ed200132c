"""The model catalog: what a model is, how it may run, validated before it is stored.

`/cognitora/catalog/models/<name>` holds one model as JSON; `cgn-ctl models
apply -f model.yaml` writes it after `parse_model` (one model's fields) and
`check_catalog` (names across models) accept it. Errors name the field path:
`profiles[1].tensor_parallel: 4 does not divide devices × nodes = 2`.

    name: llama-8b
    source: meta-llama/Llama-3.1-8B-Instruct   # GGUF path, bundled name or engine model id
    tokenizer: /models/llama-8b.gguf           # for routing; default: source when it is a GGUF
    role: both                                 # both | prefill | decode
    replicas: {min: 1, max: 2}                 # with max > min, replicas follow the load
    # or, disaggregated (prefill/decode): replicas per role instead of `replicas`, a count
    # or {min, max}; a profile's `role` (default both) says which pool it may serve
    # pools: {prefill: 1, decode: {min: 1, max: 4}}
    scaling: {stabilization_s: 120}            # optional: the autoscaler's policy (scaling.py)
    slo: {ttft_p90_ms: 800}                    # optional: scale up while the router sees worse
    aliases: [llama]
    fallbacks: [smollm2]
    migration_limit: 3                         # optional: continuations per stream
    migrate_across_engines: false              # optional: one source, engines that take ids
    adapters: {sql: {source: /models/sql.gguf}}  # optional: LoRA adapters (adapters.py)
    max_adapters: 4                            # optional: adapters loaded at once per replica
    profiles:                                  # in priority order: the first that fits is used
      - {engine: vllm, accelerator: h100-80g, devices: 1, tensor_parallel: 1, ctx: 8192}
      - {engine: llama_cpp, accelerator: cpu, source: /models/llama-8b.Q4_K_M.gguf, threads: 8}
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cgn_control.decide.adapters import DEFAULT_LOADED, AdapterSpec, check_names, parse_adapters
from cgn_control.decide.names import NAME as _NAME
from cgn_control.decide.names import CatalogError as CatalogError
from cgn_control.decide.scaling import ScalingPolicy
from cgn_core import engine_args, multinode
from cgn_core.errors import ConfigError
from cgn_core.records import Placement

ENGINES = ("cgn_infer", "llama_cpp", "vllm", "sglang", "mlx_lm", "trtllm", "openai_compat")
ROLES = ("both", "prefill", "decode")
KV_CONNECTORS = ("none", "lmcache", "nixl", "hicache", "kvbm")
_CLASS = re.compile(r"^[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True, slots=True)
class Profile:
    engine: str
    accelerator: str = "cpu"  # an accelerator class (h100-80g, m2-ultra-192g) or cpu
    devices: int = 0  # accelerators per node for one replica (0 on cpu)
    nodes: int = 1  # nodes one replica spans
    tensor_parallel: int = 1
    source: str = ""  # overrides the model's source for this engine
    ctx: int | None = None
    threads: int | None = None
    dtype: str | None = None
    gpu_memory_utilization: float | None = None
    kv_connector: str = "none"
    backend: str | None = None
    launcher: str = "auto"
    url: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    role: str = "both"  # the pool(s) of a disaggregated model it may serve
    quantization: str | None = None  # vllm / sglang --quantization (fp8 needs sm 8.9+)
    # vllm across nodes: ray (the default) or mp, whichever the installed vLLM supports
    launch_mode: str | None = None
    rendezvous_timeout_s: float | None = None  # ranks 1.. wait this long for rank 0

    @property
    def on_cpu(self) -> bool:
        return self.accelerator == "cpu"


@dataclass(frozen=True, slots=True)
class Bounds:
    """A pool's replicas: at least `min`, at most `max` (the autoscaler moves between)."""

    min: int
    max: int

    def to_json(self) -> int | dict[str, int]:
        """As the catalog writes it: a count when fixed, else {min, max}."""
        return self.min if self.min == self.max else {"min": self.min, "max": self.max}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    source: str
    profiles: tuple[Profile, ...]
    tokenizer: str = ""
    role: str = "both"
    # Each pool's bounds by role: an aggregated model has one pool (its role's); a
    # disaggregated one (`pools:` in the catalog) a prefill and a decode pool
    pools: Mapping[str, Bounds] = field(default_factory=lambda: {"both": Bounds(1, 1)})
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)  # and the `slo:` targets
    migration_limit: int | None = None  # continuations per stream; None: the router's setting
    # a stream may continue on a replica of another engine kind (one source: one tokenizer)
    migrate_across_engines: bool = False
    adapters: Mapping[str, AdapterSpec] = field(default_factory=dict)  # LoRA, by name
    max_adapters: int = DEFAULT_LOADED  # loaded at once per replica

    @property
    def disaggregated(self) -> bool:
        return len(self.pools) > 1

    def wants(self) -> list[tuple[str, int, int]]:
        """(role, min, max) replicas of each pool (prefill before decode)."""
        return [(role, b.min, b.max) for role, b in sorted(self.pools.items(), reverse=True)]

    def in_pool(self, placement: Placement, role: str) -> bool:
        """Whether a placement counts in this model's pool of `role` (an aggregated model's
        one pool holds all its placements)."""
        return placement.model == self.name and (not self.disaggregated or placement.role == role)

    def for_role(self, role: str) -> ModelSpec:
        """This model with only the profiles that may serve `role`'s pool."""
        keep = tuple(p for p in self.profiles if p.role in ("both", role))
        return dataclasses.replace(self, profiles=keep) if keep != self.profiles else self

    def to_json(self) -> dict[str, Any]:
        """The stored form: the YAML schema above (and what `parse_model` reads back)."""
        return {
            "name": self.name,
            "source": self.source,
            "tokenizer": self.tokenizer,
            "role": self.role,
            **(
                {}
                if self.disaggregated
                else {"replicas": dataclasses.asdict(self.pools[self.role])}
            ),
            "aliases": list(self.aliases),
            "fallbacks": list(self.fallbacks),
            "profiles": [_profile_json(p) for p in self.profiles],
            **(
                {"pools": {role: b.to_json() for role, b in self.pools.items()}}
                if self.disaggregated
                else {}
            ),
            **_scaling_json(self.scaling),
            **({} if self.migration_limit is None else {"migration_limit": self.migration_limit}),
            **({"migrate_across_engines": True} if self.migrate_across_engines else {}),
            **(
                {
                    "adapters": {n: a.to_json() for n, a in sorted(self.adapters.items())},
                    "max_adapters": self.max_adapters,
                }
                if self.adapters
                else {}
            ),
        }


def _profile_json(p: Profile) -> dict[str, Any]:
    doc = dataclasses.asdict(p)
    doc["extra_args"] = list(p.extra_args)
    doc["env"] = dict(p.env)
    return {
        k: v for k, v in doc.items() if v is not None and v != "" and (k, v) != ("role", "both")
    }


MODEL_FIELDS = frozenset({
    "name", "source", "tokenizer", "role", "replicas", "aliases", "fallbacks", "profiles",
    "pools", "scaling", "slo", "migration_limit", "migrate_across_engines", "adapters",
    "max_adapters",
})  # fmt: skip


def parse_model(doc: Any, where: str = "") -> ModelSpec:
    """One model's spec; CatalogError names the first bad field."""
    if not isinstance(doc, Mapping):
        raise CatalogError(f"{where or 'model'}: expected a mapping")
    _known(doc, MODEL_FIELDS, where)
    name = _text(doc, "name", where, required=True)
    if not _NAME.match(name):
        raise CatalogError(f"{_p(where, 'name')}: use 1-128 of [A-Za-z0-9._:-]")
    source = _text(doc, "source", where)
    role = _text(doc, "role", where) or "both"
    if role not in ROLES:
        raise CatalogError(f"{_p(where, 'role')}: must be one of {', '.join(ROLES)}")
    replicas = _replicas(doc, where)
    raw_profiles = doc.get("profiles")
    if not isinstance(raw_profiles, list) or not raw_profiles:
        raise CatalogError(f"{_p(where, 'profiles')}: at least one profile is required")
    profiles = tuple(
        _parse_profile(p, _p(where, f"profiles[{i}]")) for i, p in enumerate(raw_profiles)
    )
    for i, p in enumerate(profiles):
        if not (p.source or source) and p.engine != "openai_compat":
            raise CatalogError(
                f"{_p(where, f'profiles[{i}]')}: no source (set source: on the model)"
            )
    across = doc.get("migrate_across_engines", False)
    if not isinstance(across, bool):
        raise CatalogError(f"{_p(where, 'migrate_across_engines')}: expected true or false")
    if across:
        _one_tokenizer(profiles, source, where)
    adapters, max_adapters = parse_adapters(doc, f"{where}." if where else "")
    return ModelSpec(
        name=name,
        source=source,
        profiles=profiles,
        pools=_pools(doc, where, role, profiles) or {role: replicas},
        scaling=_scaling(doc, where),
        tokenizer=_text(doc, "tokenizer", where),
        role=role,
        aliases=_names(doc, "aliases", where),
        fallbacks=_names(doc, "fallbacks", where),
        migration_limit=(
            None
            if doc.get("migration_limit") is None
            else _int(doc, "migration_limit", where, 0, minimum=0, maximum=16)
        ),
        migrate_across_engines=across,
        adapters=adapters,
        max_adapters=max_adapters,
    )


# Engines whose OpenAI `/v1/completions` takes a prompt of token ids: a stream of one may
# continue on another (cgn_core/openai/continuation.py)
IDS_PROMPT_ENGINES = ("cgn_infer", "llama_cpp", "vllm", "sglang", "trtllm")


def _one_tokenizer(profiles: tuple[Profile, ...], source: str, where: str) -> None:
    """`migrate_across_engines` continues one engine's answer on another from its token
    ids: every profile must take ids and serve one source (the same weights, so one
    tokenizer; two sources may tokenize differently and are refused)."""
    at = _p(where, "migrate_across_engines")
    for i, p in enumerate(profiles):
        if p.engine not in IDS_PROMPT_ENGINES:
            raise CatalogError(
                f"{at}: profiles[{i}] ({p.engine}) cannot take a prompt of token ids; "
                f"engines that can: {', '.join(IDS_PROMPT_ENGINES)}"
            )
    sources = sorted({p.source or source for p in profiles})
    if len(sources) > 1:
        raise CatalogError(
            f"{at}: the profiles serve different sources ({', '.join(sources)}), whose "
            "tokenizers may differ; one source for all profiles, or leave it off"
        )


MAX_POOL = 1000


def _replicas(doc: Mapping[str, Any], where: str) -> Bounds:
    """An aggregated model's `replicas: {min, max}` (min 0: scaled from zero)."""
    replicas = doc.get("replicas", {})
    if not isinstance(replicas, Mapping):
        raise CatalogError(f"{_p(where, 'replicas')}: expected {{min, max}}")
    _known(replicas, {"min", "max"}, _p(where, "replicas"))
    lo = _int(replicas, "min", _p(where, "replicas"), 1, minimum=0, maximum=MAX_COUNT)
    hi = _int(replicas, "max", _p(where, "replicas"), max(lo, 1), minimum=1, maximum=MAX_COUNT)
    if lo > hi:
        raise CatalogError(f"{_p(where, 'replicas')}: min {lo} is above max {hi}")
    return Bounds(lo, hi)


def pool_record(name: str, spec: ModelSpec, role: str) -> str:
    """The name of the pool's autoscaler record under /cognitora/scaling/: the model's name,
    or "m/prefill" for a disaggregated model's pool ("/" is in no model name; ":" is). A
    reader takes model and role from the record itself (`cgn_core.records.scaling`)."""
    return f"{name}/{role}" if spec.disaggregated else name


def pool_label(name: str, spec: ModelSpec, role: str) -> str:
    """How the pool of `role` of the catalog's model `name` is shown: "m (prefill)" for a
    disaggregated model, the model's name for an aggregated one."""
    return f"{name} ({role})" if spec.disaggregated else name


def _pools(
    doc: Mapping[str, Any], where: str, role: str, profiles: tuple[Profile, ...]
) -> dict[str, Bounds]:
    """A disaggregated model's `pools: {prefill: N, decode: {min: M, max: K}}` as bounds per
    role; {} when it has none."""
    raw = doc.get("pools")
    if raw is None:
        return {}
    at = _p(where, "pools")
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{at}: expected {{prefill: N, decode: M}}")
    _known(raw, {"prefill", "decode"}, at)
    if "replicas" in doc:
        raise CatalogError(f"{at}: a model has pools or replicas, not both")
    if role != "both":
        raise CatalogError(f"{_p(where, 'role')}: a model with pools has role both, got {role}")
    pools: dict[str, Bounds] = {}
    for r in ("prefill", "decode"):
        if isinstance(raw.get(r), Mapping):
            _known(raw[r], {"min", "max"}, _p(at, r))
            lo = _int(raw[r], "min", _p(at, r), 1, minimum=1, maximum=MAX_COUNT)
            top = _int(raw[r], "max", _p(at, r), lo, minimum=1, maximum=MAX_COUNT)
            if top < lo:
                raise CatalogError(f"{_p(at, r)}: min {lo} is above max {top}")
            pools[r] = Bounds(lo, top)
        else:
            n = _int(raw, r, at, 0, minimum=1, maximum=MAX_COUNT)
            pools[r] = Bounds(n, n)
    for r, b in pools.items():
        if b.min > MAX_POOL:
            raise CatalogError(f"{_p(at, r)}: at most {MAX_POOL}, got {b.min}")
        if not any(p.role in ("both", r) for p in profiles):
            raise CatalogError(
                f"{_p(at, r)}: no profile may serve it (a profile's role is both or {r})"
            )
    return pools


_SCALING_FLOATS = (
    "utilization",
    "hysteresis",
    "warmup_s",
    "window_s",
    "up_cooldown_s",
    "down_cooldown_s",
    "stabilization_s",
)
_SLO = ("ttft_p90_ms", "itl_p90_ms")


def _scaling(doc: Mapping[str, Any], where: str) -> ScalingPolicy:
    """The `scaling:` and `slo:` blocks as one policy, every field checked (types, ranges,
    inverted values) with its path named."""
    raw, slo = doc.get("scaling") or {}, doc.get("slo") or {}
    for block, value in (("scaling", raw), ("slo", slo)):
        if not isinstance(value, Mapping):
            raise CatalogError(f"{_p(where, block)}: expected a mapping")
    _known(raw, {*_SCALING_FLOATS, "enabled", "max_step_up"}, _p(where, "scaling"))
    _known(slo, set(_SLO), _p(where, "slo"))
    fields: dict[str, Any] = {}
    if "enabled" in raw:
        if not isinstance(raw["enabled"], bool):
            raise CatalogError(f"{_p(where, 'scaling.enabled')}: expected true or false")
        fields["enabled"] = raw["enabled"]
    if "max_step_up" in raw:
        fields["max_step_up"] = _int(raw, "max_step_up", _p(where, "scaling"), 4, 1, 1000)
    for block, names, values in (("scaling", _SCALING_FLOATS, raw), ("slo", _SLO, slo)):
        for name in names:
            value = values.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CatalogError(f"{_p(where, f'{block}.{name}')}: expected a number")
            fields[name] = float(value) if -1e300 < value < 1e300 else math.inf
    policy = ScalingPolicy(**fields)
    try:
        policy.check(_p(where, "scaling"))
    except ConfigError as exc:
        raise CatalogError(str(exc).replace("slo.", _p(where, "slo") + ".", 1)) from None
    return policy


def _scaling_json(policy: ScalingPolicy) -> dict[str, Any]:
    """The blocks as stored: only what differs from the defaults."""
    default = ScalingPolicy()
    changed = {
        f.name: getattr(policy, f.name)
        for f in dataclasses.fields(policy)
        if getattr(policy, f.name) != getattr(default, f.name)
    }
    out: dict[str, Any] = {}
    if scaling := {k: v for k, v in changed.items() if k not in _SLO}:
        out["scaling"] = scaling
    if slo := {k: v for k, v in changed.items() if k in _SLO}:
        out["slo"] = slo
    return out


def _parse_profile(raw: Any, where: str) -> Profile:
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{where}: expected a mapping")
    _known(raw, {f.name for f in dataclasses.fields(Profile)}, where)
    engine = _text(raw, "engine", where, required=True)
    if engine not in ENGINES:
        raise CatalogError(f"{_p(where, 'engine')}: must be one of {', '.join(ENGINES)}")
    accel, devices, nodes, tp = _shape(raw, where)
    kv = _text(raw, "kv_connector", where) or "none"
    if kv not in KV_CONNECTORS:
        raise CatalogError(
            f"{_p(where, 'kv_connector')}: must be one of {', '.join(KV_CONNECTORS)}"
        )
    extra, env = _engine_args(raw, where, engine)
    gmu = raw.get("gpu_memory_utilization")
    if gmu is not None and (
        not isinstance(gmu, int | float) or isinstance(gmu, bool) or not 0 < gmu <= 1
    ):
        raise CatalogError(f"{_p(where, 'gpu_memory_utilization')}: must be in (0, 1]")
    optional_ints = {k: _opt_int(raw, k, where) for k in ("ctx", "threads")}
    role = _text(raw, "role", where) or "both"
    if role not in ROLES:
        raise CatalogError(f"{_p(where, 'role')}: must be one of {', '.join(ROLES)}")
    launch_mode, timeout = _across_nodes(raw, where, engine, nodes)
    quantization = _text(raw, "quantization", where) or None
    if quantization is not None and engine not in multinode.RANK_ENGINES:
        raise CatalogError(f"{_p(where, 'quantization')}: only vllm and sglang take it")
    return Profile(
        role=role,
        engine=engine,
        accelerator=accel,
        devices=devices,
        nodes=nodes,
        tensor_parallel=tp,
        source=_text(raw, "source", where),
        dtype=_text(raw, "dtype", where) or None,
        gpu_memory_utilization=None if gmu is None else float(gmu),
        kv_connector=kv,
        backend=_text(raw, "backend", where) or None,
        launcher=_text(raw, "launcher", where) or "auto",
        url=_text(raw, "url", where) or None,
        extra_args=extra,
        env=env,
        quantization=quantization,
        launch_mode=launch_mode,
        rendezvous_timeout_s=timeout,
        **optional_ints,
    )


def _shape(raw: Mapping[str, Any], where: str) -> tuple[str, int, int, int]:
    """A profile's accelerator class, devices per node, nodes and tensor parallelism."""
    accel = _text(raw, "accelerator", where) or "cpu"
    if not _CLASS.match(accel):
        raise CatalogError(
            f"{_p(where, 'accelerator')}: an accelerator class such as h100-80g, or cpu"
        )
    devices = _int(raw, "devices", where, 0 if accel == "cpu" else 1, minimum=0, maximum=MAX_COUNT)
    nodes = _int(raw, "nodes", where, 1, minimum=1, maximum=MAX_COUNT)
    tp = _int(raw, "tensor_parallel", where, max(devices * nodes, 1), minimum=1, maximum=1 << 24)
    if accel == "cpu" and devices:
        raise CatalogError(f"{_p(where, 'devices')}: a cpu profile takes no devices, got {devices}")
    if accel != "cpu" and devices == 0:
        raise CatalogError(f"{_p(where, 'devices')}: a {accel} profile needs at least one device")
    if accel != "cpu" and (devices * nodes) % tp:
        at, total = _p(where, "tensor_parallel"), devices * nodes
        raise CatalogError(f"{at}: {tp} does not divide devices × nodes = {total}")
    if accel == "cpu" and tp != 1:
        raise CatalogError(f"{_p(where, 'tensor_parallel')}: a cpu profile runs with 1, got {tp}")
    return accel, devices, nodes, tp


def _engine_args(
    raw: Mapping[str, Any], where: str, engine: str
) -> tuple[tuple[str, ...], dict[str, str]]:
    """`extra_args` and `env`, refused here as the agents would refuse them."""
    extra = raw.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise CatalogError(f"{_p(where, 'extra_args')}: expected a list of strings")
    env = raw.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise CatalogError(f"{_p(where, 'env')}: expected a mapping of strings")
    try:  # the agents refuse these too; saying so at `models apply` saves a placement round
        engine_args.check(engine, extra, env)
    except engine_args.ArgsRefused as exc:
        raise CatalogError(f"{where}: {exc}") from None
    return tuple(extra), dict(env)


def _across_nodes(
    raw: Mapping[str, Any], where: str, engine: str, nodes: int
) -> tuple[str | None, float | None]:
    """A multi-node profile's launch mode and rendezvous timeout (None: the defaults)."""
    launch_mode = _text(raw, "launch_mode", where) or None
    if launch_mode is not None and (engine != "vllm" or nodes < 2):
        raise CatalogError(f"{_p(where, 'launch_mode')}: only a vllm profile across nodes has one")
    if launch_mode is not None and launch_mode not in multinode.LAUNCH_MODES:
        modes = ", ".join(multinode.LAUNCH_MODES)
        raise CatalogError(f"{_p(where, 'launch_mode')}: must be one of {modes}")
    timeout = raw.get("rendezvous_timeout_s")
    number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if timeout is not None and not (number and 0 < timeout <= 86400):
        raise CatalogError(f"{_p(where, 'rendezvous_timeout_s')}: seconds in (0, 86400]")
    return launch_mode, None if timeout is None else float(timeout)


def check_catalog(models: Mapping[str, ModelSpec]) -> None:
    """Names across the catalog: every fallback names a model, no alias shadows or repeats."""
    owners: dict[str, str] = {}
    for name, m in sorted(models.items()):
        for i, alias in enumerate(m.aliases):
            if alias in models:
                raise CatalogError(f"{name}: aliases[{i}]: {alias!r} is the name of a model")
            if alias in owners and owners[alias] != name:
                raise CatalogError(
                    f"{name}: aliases[{i}]: {alias!r} is already an alias of {owners[alias]}"
                )
            owners[alias] = name
    for name, m in sorted(models.items()):
        for i, fb in enumerate(m.fallbacks):
            if fb == name:
                raise CatalogError(f"{name}: fallbacks[{i}]: a model cannot fall back to itself")
            if fb not in models:
                raise CatalogError(f"{name}: fallbacks[{i}]: {fb!r} names no model in the catalog")
    check_names(models)


# ---- field readers ------------------------------------------------------------------------


def _p(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _known(doc: Mapping[str, Any], known: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(doc) - known)
    if unknown:
        raise CatalogError(f"{_p(where, unknown[0])}: unknown field")


def _text(doc: Mapping[str, Any], key: str, where: str, required: bool = False) -> str:
    value = doc.get(key)
    if value is None:
        if required:
            raise CatalogError(f"{_p(where, key)}: required")
        return ""
    if not isinstance(value, str) or (required and not value):
        raise CatalogError(f"{_p(where, key)}: expected a string")
    return value


MAX_COUNT = 4096  # replicas of a model or a pool, devices, nodes, tensor-parallel ranks
MAX_INT = 1 << 31  # anything else counted (ctx, threads)


def _int(
    doc: Mapping[str, Any],
    key: str,
    where: str,
    default: int,
    minimum: int,
    maximum: int = MAX_INT,
) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise CatalogError(
            f"{_p(where, key)}: expected an integer in [{minimum}, {maximum}], "
            f"got {str(value)[:40]}"
        )
    return value


def _opt_int(doc: Mapping[str, Any], key: str, where: str) -> int | None:
    if doc.get(key) is None:
        return None
    return _int(doc, key, where, 0, minimum=1)


def _names(doc: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and _NAME.match(v) for v in value):
        raise CatalogError(f"{_p(where, key)}: expected a list of model names")
    if len(set(value)) != len(value):
        raise CatalogError(f"{_p(where, key)}: a name is listed twice")
    return tuple(value)
