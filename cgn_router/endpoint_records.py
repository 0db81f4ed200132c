"""Endpoint records as the router reads them: etcd's `/cognitora/endpoints/` keys and values,
and the `endpoints:` of its settings, each checked field by field (nothing read is trusted)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cgn_core import keys
from cgn_core.keys import NAME
from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_core.lora import MAX_PER_REPLICA
from cgn_router.settings import StaticEndpoint
from cgn_router.types import Endpoint, EndpointId


def endpoint_from_etcd(key: str, value: bytes) -> Endpoint:
    """Parse an endpoint record (`endpoint_key_parts` says which keys); ValueError says why."""
    endpoint_key_parts(key)
    try:
        data = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{key}: value is not JSON ({exc})") from None
    return endpoint_from_doc(key, data)


def endpoint_key_parts(key: str) -> tuple[EndpointId, str, str]:
    """(endpoint id, model, node) of an endpoint key, in either layout:

    * `/cognitora/endpoints/<node>/<model>/<replica>`: what agents write, so a node's etcd
      role can be limited to its own prefix (docs/security.md); id `<model>/<node>.<replica>`;
    * `/cognitora/endpoints/<model>/<replica>`: registered by hand (an admin's key); node "".
    """
    parts = key[len(keys.ENDPOINTS) :].split("/")
    if len(parts) == 3 and all(parts):
        node, model, replica = parts
        return EndpointId(f"{model}/{node}.{replica}"), model, node
    if len(parts) == 2 and all(parts):
        return EndpointId("/".join(parts)), parts[0], ""
    raise ValueError(
        f"{key}: expected {keys.ENDPOINTS}<node>/<model>/<replica> or <model>/<replica>"
    )


def endpoint_from_doc(key: str, data: Any) -> Endpoint:
    """`endpoint_from_etcd` for a value already decoded from JSON."""
    eid, model, node = endpoint_key_parts(key)
    if not isinstance(data, dict):
        raise ValueError(f"{key}: value must be a JSON object")
    if node and data.get("node", node) != node:  # NOTE: a node speaks for itself only
        raise ValueError(f"{key}: the record names node {data.get('node')!r}, the key {node!r}")
    return _endpoint(eid, model, {"node": node, **data} if node else data, key)


def endpoint_from_static(name: str, s: StaticEndpoint) -> Endpoint:
    if not s.model:
        raise ValueError(f"endpoints.{name}.model is required")
    data: dict[str, Any] = {"url": s.url, "engine": s.engine, "role": s.role, "node": s.node}
    data["adapters"] = list(s.adapters)
    if s.kv_events_url is not None:
        data["kv_events_url"] = s.kv_events_url
    return _endpoint(EndpointId(f"{s.model}/{name}"), s.model, data, f"endpoints.{name}")


def _endpoint(eid: EndpointId, model: str, data: Mapping[str, Any], where: str) -> Endpoint:
    url = data.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: 'url' must be an http(s) URL, got {url!r}")
    fields: dict[str, Any] = {}
    for name in ("engine", "role", "node", "hash_scheme", "kv_events_url"):
        if name in data:
            if not isinstance(data[name], str):
                raise ValueError(f"{where}: '{name}' must be a string")
            fields[name] = data[name]
    if fields.get("role", "both") not in ("both", "prefill", "decode"):
        raise ValueError(f"{where}: 'role' must be both, prefill or decode")
    block_size = data.get("block_size", BLOCK_SIZE)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}: 'block_size' must be a positive integer")
    token = data.get("api_token", "")
    if not isinstance(token, str):
        raise ValueError(f"{where}: 'api_token' must be a string")
    fields["adapters"] = _adapters(data.get("adapters", []), where)
    endpoint = Endpoint(eid, model, url.rstrip("/"), block_size=block_size, token=token, **fields)
    if "kv_events_url" not in fields and endpoint.engine == "cgn-infer":
        endpoint = replace(endpoint, kv_events_url=endpoint.url + "/v1/kv/events")
    if endpoint.kv_events_url and (
        block_size != BLOCK_SIZE or endpoint.hash_scheme != keys.HASH_SCHEME
    ):  # its hashes cannot equal ours: track it approximately instead
        endpoint = replace(endpoint, kv_events_url="")
    return endpoint


def _adapters(raw: Any, where: str) -> tuple[str, ...]:
    """An endpoint's loaded LoRA adapters: at most MAX_PER_REPLICA distinct names."""
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_PER_REPLICA
        or not all(isinstance(a, str) and NAME.match(a) for a in raw)
        or len(set(raw)) != len(raw)
    ):
        raise ValueError(f"{where}: 'adapters' must list at most {MAX_PER_REPLICA} "
                         "distinct adapter names")  # fmt: skip
    return tuple(raw)


def cordon_node(key: str) -> str:
    return key[len(keys.CORDON) :]
