"""The etcd key layout every service agrees on (docs/architecture.md); values are JSON."""

import re

# a model's, alias's or LoRA adapter's name: what clients put in `model` and keys hold
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_ADAPTERS = 256  # adapters one replica may list (the catalog names at most this many)
MAX_LORA_RANK = 512  # an adapter's rank, at most

ROOT = "/cognitora/"
NODES = ROOT + "nodes/"  # <node>: inventory, leased by the agent
CATALOG = ROOT + "catalog/models/"  # <model>: model spec, written by ctl
CATALOG_OWNERS = ROOT + "catalog/owners/"  # <model>: who wrote it (cgn-operator's resource)
PLACEMENTS = ROOT + "placements/"  # <node>/<replica>: desired replica, by the reconciler
REPLICAS = ROOT + "replicas/"  # <node>/<replica>: actual state, leased by the agent
ENDPOINTS = ROOT + "endpoints/"  # <node>/<model>/<replica>: Ready and routable, by the agent
LEADER = ROOT + "leader/"  # <election>: the elected leader's candidate id (routers)
RECONCILER_ELECTION = "reconciler"  # the routers' election for the control loop
RECONCILER_LEADER = LEADER + RECONCILER_ELECTION  # its key: who runs the reconciler now
SCALING = ROOT + "scaling/"  # <model>[/<role>]: a pool's autoscaler decisions, by the leader
CORDON = ROOT + "cordon/"  # <node>: no new placements
POLICY_ROUTING = ROOT + "policy/routing"
API_KEYS = ROOT + "keys/"  # <key id>: an API key record (hash, tenant, band, limits), by ctl
KVCACHED = ROOT + "kvcached/"  # <node>: the node's KV store (cgn-kvcached), leased by the agent
EFFICIENCY = ROOT + "efficiency/"  # <node>: measured output tokens per joule, by cgn-metrics
TENANTS = ROOT + "tenants/"  # <tenant>: its budget (cgn_core/budgets.py), by ctl
USAGE = ROOT + "usage/"  # <writer>: a router worker's count of tenants' usage, by the router
WAITING = ROOT + "waiting/"  # <writer>: the tenants a router worker has waiting (fleetshare)
JOINS = ROOT + "joins/"  # <node>: which join token joined a node, and its certificate's serial
TOKENS = ROOT + "tokens/"  # <id>: a join token's record (hash, expiry, uses), by ctl (#65)
REVOKED = ROOT + "revoked/"  # <certificate serial, hex>: revoked by `cgn-ctl pki revoke`
HASH_SCHEME = "cognitora.kv.v1"  # the block-hash scheme (docs/architecture.md)
