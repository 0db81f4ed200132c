"""`POST /debug/route` on the admin listener: where a request would go now, and why (#57).

The body names a model and a prompt as a client would (`prompt`, or chat `messages`),
and optionally the `tenant` whose cached prompts count (with KV isolation, a prompt is
hashed in its tenant's namespace). The router hashes it as the request path does, takes
the same snapshot of the model's endpoints and runs its routing chain over it, without
sending anything or counting anything. The answer lists every endpoint of the model:

* the filter that dropped it, if one did;
* each scorer's score and the weighted total, and which one the picker chose;
* what the time scorer predicts there (whether or not it is in the chain), split into
  its terms: the wait behind the prefill queued there, the prefill of the prompt tokens
  it does not hold (its node's KV store's blocks at their restore cost), the other
  requests' share of its steps, its overhead, all times its lag; and the hit (prompt
  tokens it holds, blocks its node's store holds), its learned speed and load.

Pure apart from the live registry and the chain's random generator (a random picker
may pick otherwise on the request itself).
"""

from __future__ import annotations

import time
from typing import Any

from cgn_core.errors import InvalidRequest, NotFound
from cgn_core.kv.blockhash import BLOCK_SIZE, adapter_salt, tenant_salt
from cgn_router.routing.plugins.ttft import TimeScorer
from cgn_router.service import RouterService
from cgn_router.types import EndpointView, RequestInfo

FIELDS = frozenset({"model", "prompt", "messages", "tenant"})


def explain(svc: RouterService, body: Any) -> dict[str, Any]:
    """The routing decision for `body` with every candidate's account; InvalidRequest (a
    400) for a body that is not one, NotFound (404) for a model nothing serves."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object: {model, prompt | messages}")
    if unknown := sorted(body.keys() - FIELDS):
        raise InvalidRequest(f"unsupported field(s) {unknown} (known: {sorted(FIELDS)})")
    name, tenant = body.get("model"), body.get("tenant")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("'model' must name a model")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidRequest("'tenant' must be a tenant's name")
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("give one of 'prompt' (a completion's) or 'messages' (a chat's)")
    adapter = name if name in svc.catalog.adapters() else None
    model = svc.catalog.adapters()[name] if adapter else svc.catalog.names().get(name, name)
    if model not in svc.registry.by_model:
        raise NotFound(f"no endpoint serves {name!r}", code="model_not_found", param="model")
    kind = "chat" if "messages" in body else "completion"
    auth = svc.settings.auth
    salt = None
    if tenant is not None and auth.enabled and auth.kv_isolation:
        salt = tenant_salt("tenant", tenant)
    salt = adapter_salt(salt, adapter)  # at scale 1 (explain takes no lora_scale)
    prompt = svc.catalog.hasher(model).hash(kind, {"model": model, **body}, salt)
    if prompt.method == "none":
        raise InvalidRequest(f"the {kind} prompt is not one a client could send")
    role = "decode" if svc.registry.has_prefill_pool(model) else "both"
    req = RequestInfo(model, role, prompt.blocks, prompt.tokens, None, adapter)
    now = time.monotonic()
    views = svc.registry.views(req, now, frozenset())
    decision = svc.chain.route(req, views, svc.rng)
    timer = next((s for s in svc.chain.scorers if isinstance(s, TimeScorer)), TimeScorer())
    rows = []
    for v in sorted(views, key=lambda v: -decision.totals.get(v.id, -1.0)):
        dropped = next((f.name for f in svc.chain.filters if not f.keep(req, v)), None)
        scores = {s: round(got[v.id], 4) for s, got in decision.scores.items() if v.id in got}
        rows.append({
            "id": v.id, "engine": v.endpoint.engine, "node": v.endpoint.node,
            "chosen": v.id == decision.chosen, "dropped_by": dropped,
            "total": None if v.id not in decision.totals else round(decision.totals[v.id], 4),
            "scores": scores, **_account(timer, req, v),
        })  # fmt: skip
    return {
        "model": model,
        "prompt_tokens": prompt.tokens,
        "hashed_by": prompt.method,
        "blocks": len(prompt.blocks),
        "chosen": decision.chosen,
        "picker": type(svc.chain.picker).__name__,
        "weights": svc.chain.weights,
        "candidates": rows,
    }


def _account(timer: TimeScorer, req: RequestInfo, v: EndpointView) -> dict[str, Any]:
    """What the time scorer predicts on `v`, term by term, and what it reads."""
    speed, lag = v.speed, v.lag
    uncached = timer.uncached(req, v)
    ms = 1000.0 * lag
    return {
        "predicted_ttft_ms": round(timer.predict(req, v) * 1000.0, 1),
        "terms_ms": {
            "wait": round(speed.prefill_s * v.queued_tokens * ms, 1),
            "prefill": round(speed.prefill_s * uncached * ms, 1),
            "others": round(speed.ttft_per_other_s * v.in_flight * ms, 1),
            "overhead": round(speed.overhead_s * ms, 1),
        },
        "lag": round(lag, 2),
        "hit_tokens": min(req.prompt_tokens, v.matched_blocks * BLOCK_SIZE),
        "node_store_blocks": {"ram": v.node_ram_blocks, "ssd": v.node_ssd_blocks},
        "uncached_tokens": round(uncached, 1),
        "queued_tokens": round(v.queued_tokens),
        "in_flight": v.in_flight,
        "speed": {
            "learned": speed.warm,
            "prefill_ms_per_token": round(speed.prefill_s * 1e3, 5),
            "decode_ms_per_token": round(speed.decode_s * 1e3, 3),
        },
    }
