"""Engine-side KV connector flags, per the engines' documented integrations.

vLLM takes one `--kv-transfer-config` JSON (kv_role kv_both):
* none: nothing;
* lmcache: kv_connector LMCacheConnectorV1;
* nixl: kv_connector NixlConnector;
* kvbm: kv_connector DynamoConnector from kvbm.vllm_integration.connector;
* hicache: refused (SGLang's hierarchical cache).

SGLang:
* none: nothing;
* hicache: --enable-hierarchical-cache;
* lmcache: --enable-lmcache;
* nixl: --disaggregation-mode <prefill|decode> --disaggregation-transfer-backend nixl
  (disaggregated roles only; refused for role both);
* kvbm: refused (KVBM integrates with vLLM and TensorRT-LLM).

Every other engine takes `none` only.

With the node's KV store on (cgn_agent/kvcached.py), an engine whose connector
is `none` gets its own built-in CPU offload instead (`offload_args`): vLLM
`--kv-offloading-backend native --kv-offloading-size <GiB>`, SGLang
`--enable-hierarchical-cache --hicache-size <GB>`. Those engines keep offloaded
blocks in their own process: they do not use cgn-kvcached's tiers.
"""

from __future__ import annotations

import json

from cgn_agent.drivers.base import PlacementRefused
from cgn_agent.spec import KvConnector, Role

_VLLM: dict[str, dict[str, str]] = {
    "lmcache": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    "nixl": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    "kvbm": {
        "kv_connector": "DynamoConnector",
        "kv_connector_module_path": "kvbm.vllm_integration.connector",
        "kv_role": "kv_both",
    },
}


def vllm_args(connector: KvConnector) -> list[str]:
    if connector == "none":
        return []
    if connector not in _VLLM:
        raise PlacementRefused(
            f"vllm has no '{connector}' KV connector (hicache is SGLang's); "
            f"use one of none, {', '.join(_VLLM)}"
        )
    return ["--kv-transfer-config", json.dumps(_VLLM[connector], separators=(",", ":"))]


def sglang_args(connector: KvConnector, role: Role) -> list[str]:
    if connector == "none":
        return []
    if connector == "hicache":
        return ["--enable-hierarchical-cache"]
    if connector == "lmcache":
        return ["--enable-lmcache"]
    if connector == "nixl":
        if role == "both":
            raise PlacementRefused(
                "sglang moves KV over NIXL only between disaggregated replicas: "
                "kv_connector nixl needs role prefill or decode"
            )
        return ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl"]
    raise PlacementRefused(
        f"sglang has no '{connector}' KV connector (KVBM integrates with vLLM and "
        "TensorRT-LLM); use one of none, hicache, lmcache, nixl"
    )


def offload_args(engine: str, connector: KvConnector, gib: float) -> list[str]:
    """Built-in CPU KV offload flags for `engine` (vllm, sglang), when it has no connector."""
    if gib <= 0 or connector != "none":
        return []
    size = f"{gib:g}"
    if engine == "vllm":
        return ["--kv-offloading-backend", "native", "--kv-offloading-size", size]
    if engine == "sglang":
        return ["--enable-hierarchical-cache", "--hicache-size", size]
    return []
