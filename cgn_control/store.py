"""Catalog writes, checked the same way whoever writes: `cgn-ctl models apply` and cgn-operator.

A model is stored only after `parse_model` accepted its fields and `check_catalog`
accepted its names against the whole catalog as it will be (fallbacks name models,
aliases are unique); the error names the field path.

An entry may carry an owner: cgn-operator writes `/cognitora/catalog/owners/<model>`
(the CognitoraModel resource's namespace, name and uid) in the same transaction as the
entry, so it deletes only what it wrote and never takes over a model applied by hand;
and `cgn-ctl models apply`/`delete` refuse an owned entry (the operator would put it
back): the resource is where such a model changes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cgn_control.cluster_reader import read_snapshot
from cgn_control.decide.adapters import check_files
from cgn_control.decide.catalog import (
    Bounds,
    CatalogError,
    ModelSpec,
    check_catalog,
    parse_model,
)
from cgn_core import keys
from cgn_core.errors import NotFound, PermanentError
from cgn_core.etcd import Compare, EtcdClient, Op
from cgn_core.etcd.types import json_value

OWNERS = keys.CATALOG_OWNERS  # <model>: {"kind", "namespace", "name", "uid"}


class InUse(PermanentError):
    """The catalog entry is referenced by another model."""


class NotYours(PermanentError):
    """The catalog entry was written by someone else (by hand, or another resource)."""


def parse_models(docs: Sequence[Any], source: str) -> dict[str, ModelSpec]:
    """Every model in `docs` (CatalogError names the document and field); names must differ."""
    new: dict[str, ModelSpec] = {}
    for i, doc in enumerate(docs):
        where = f"{source}: model {i}" if len(docs) > 1 else source
        try:
            spec = parse_model(doc)
        except CatalogError as exc:
            raise CatalogError(f"{where}: {exc}") from None
        if spec.name in new:
            raise CatalogError(f"{where}: model {spec.name} is defined twice")
        new[spec.name] = spec
    return new


async def apply_models(client: EtcdClient, docs: Sequence[Any], source: str) -> list[str]:
    """Validate every model in `docs` against the whole catalog, then write them; returns names.
    A model a CognitoraModel owns is refused (NotYours): the operator would write it back."""
    new = parse_models(docs, source)
    for spec in new.values():
        try:  # the adapter files this machine has, read against their base (cgn-ctl's)
            check_files(spec)
        except CatalogError as exc:
            raise CatalogError(f"{source}: {exc}") from None
    await _not_owned(client, new)
    current = (await read_snapshot(client)).models
    check_catalog({**current, **new})
    for name, spec in new.items():
        await client.put_json(keys.CATALOG + name, spec.to_json())
    return sorted(new)


async def apply_owned(client: EtcdClient, spec: ModelSpec, owner: Mapping[str, str]) -> bool:
    """Write `spec` as owned by `owner` (a resource's kind, namespace, name, uid): checked
    against the catalog like `apply_models`, refused (NotYours) when the entry exists without
    this owner. Returns whether anything changed. The entry and its owner record are written
    in one transaction that fails if either changed since they were read."""
    snap = await read_snapshot(client)
    check_catalog({**snap.models, spec.name: spec})
    entry, owner_key = keys.CATALOG + spec.name, OWNERS + spec.name
    current, held = await client.get(entry), await client.get(owner_key)
    mine = held is not None and _owner(held.value) == dict(owner)
    if current is not None and not mine:
        by = describe_owner(_owner(held.value)) if held is not None else "hand"
        raise NotYours(
            f"model {spec.name!r} is already in the catalog, written by {by}; "
            "delete it there first (cgn-ctl models delete)"
        )
    doc = json_value(spec.to_json())
    if current is not None and current.value == doc:
        return False
    guard = [
        Compare.mod_revision(entry, "==", current.mod_revision if current else 0),
        Compare.mod_revision(owner_key, "==", held.mod_revision if held else 0),
    ]
    res = await client.txn(guard, [Op.put(entry, doc), Op.put_json(owner_key, dict(owner))])
    if not res.succeeded:
        raise NotYours(f"model {spec.name!r} changed in the catalog meanwhile; will retry")
    return True


async def delete_owned(client: EtcdClient, name: str, uid: str | None = None) -> bool:
    """Delete model `name` and its owner record if an owner wrote it (and, given `uid`, that
    owner); a model applied by hand is left alone. Returns whether it was deleted."""
    owner_key = OWNERS + name
    held = await client.get(owner_key)
    if held is None or (uid is not None and _owner(held.value).get("uid") != uid):
        return False
    guard = [Compare.mod_revision(owner_key, "==", held.mod_revision)]
    ops = [Op.delete(keys.CATALOG + name), Op.delete(owner_key)]
    return (await client.txn(guard, ops)).succeeded


async def owners(client: EtcdClient) -> dict[str, dict[str, str]]:
    """model -> its owner record, for every owned entry (a malformed record reads as {})."""
    kvs, _ = await client.get_prefix(OWNERS)
    return {kv.key[len(OWNERS) :]: _owner(kv.value) for kv in kvs}


async def scale_model(
    client: EtcdClient,
    name: str,
    lo: int | None,
    hi: int | None,
    role: str | None = None,
) -> ModelSpec:
    """Change a model's replica bounds (a disaggregated model's: one pool's, `role`) and
    store it, checked like `apply`; NotFound, NotYours or CatalogError otherwise."""
    await _not_owned(client, [name])
    current = (await read_snapshot(client)).models
    spec = current.get(name)
    if spec is None:
        raise NotFound(f"model {name!r} is not in the catalog")
    if spec.disaggregated and role not in spec.pools:
        raise CatalogError(f"{name} has pools ({', '.join(spec.pools)}): name one with --role")
    if not spec.disaggregated and role is not None:
        raise CatalogError(f"{name} has no pools: --role applies to a disaggregated model")
    pool = role if role is not None and spec.disaggregated else spec.role
    old = spec.pools[pool]
    bounds = Bounds(old.min if lo is None else lo, old.max if hi is None else hi)
    if not spec.disaggregated and hi is None and bounds.min > bounds.max:
        bounds = Bounds(bounds.min, bounds.min)  # raising min alone raises max with it
    doc = dataclasses.replace(spec, pools={**spec.pools, pool: bounds}).to_json()
    new = parse_model(doc, name)  # the catalog's checks (max >= min, the pool limits)
    check_catalog({**current, name: new})
    await client.put_json(keys.CATALOG + name, new.to_json())
    return new


async def delete_model(client: EtcdClient, name: str) -> None:
    """`cgn-ctl models delete`: refused while another model falls back to it."""
    snap = await read_snapshot(client)
    if name not in snap.models:
        raise NotFound(f"model {name!r} is not in the catalog")
    users = sorted(m for m, s in snap.models.items() if name in s.fallbacks)
    if users:
        raise InUse(f"{name} is the fallback of {', '.join(users)}; change those first")
    await _not_owned(client, [name])
    await client.delete(keys.CATALOG + name)


async def _not_owned(client: EtcdClient, names: Iterable[str]) -> None:
    held = await owners(client)
    for name in names:
        who = held.get(name)
        if who is not None:
            raise NotYours(
                f"model {name!r} is managed by {describe_owner(who)} (Kubernetes): change or "
                "delete that resource instead"
            )


def describe_owner(who: Mapping[str, str]) -> str:
    """An owner record as a person reads it: `CognitoraModel ns/name`."""
    return f"{who.get('kind', 'an owner')} {who.get('namespace')}/{who.get('name')}"


def _owner(raw: bytes) -> dict[str, str]:
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}
