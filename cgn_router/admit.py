"""A request admitted, as the OpenAI surface (server.py) and the endpoint picker (epp.py)
both admit one: its body parsed and checked against the key's scope, its prompt hashed (off
the loop when big) in its tenant's and adapter's KV namespace, the rate limiter charged, and
a place in admission (gate.py) taken; released, with what the answer cost, however it ends.

    budgeted(svc, who, acct)                     # before the body is read: out of budget
    async with admission(svc, kind, raw, who, acct) as adm:
        ... route and serve adm.prompt ...
        adm.settle(usage)                          # what the answer cost (None: unknown)

NOTE: the order bounds what a request costs before it is refused: the key is checked
before the body is read, and the rate limiter charges an estimate of the prompt (its
bytes / 4) before anything is tokenized; the exact count corrects it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from cgn_core.errors import InvalidRequest, NotFound, RateLimited
from cgn_core.http import CACHE_SALT_FIELD, parse_json
from cgn_core.kv.blockhash import adapter_salt
from cgn_core.kv.transfer import FIELD as TRANSFER_FIELD
from cgn_core.openai.request import LORA_FIELD, LORA_SCALE_FIELD, lora_scale, sampling_fields
from cgn_core.openai.resume import FIELD as RESUME_FIELD
from cgn_router.auth import Principal, may_use, visible
from cgn_router.prompts import CHARS_PER_TOKEN, HashedPrompt
from cgn_router.routing.lifecycle import Account, Admitted, Asked, Hashed, Refused
from cgn_router.service import RouterService
from cgn_router.types import Usage

# Bodies from this size on are templated, tokenized and hashed on a worker thread: ~64 KiB
# tokenizes in ~10 ms here, the longest a stream relay should wait for the loop.
OFF_LOOP_BYTES = 64 << 10


@dataclass(slots=True)
class Admission:
    """One admitted request: what routing needs of it, and what its answer cost."""

    who: Principal
    body: dict[str, Any]
    model: str  # the model it means
    adapter: str | None  # the LoRA adapter it names
    scale: float  # the adapter's (1.0 without one)
    stream: bool
    prompt: HashedPrompt
    started: float  # when the request came (its account's clock)
    waited: float = 0.0  # in admission's queue, seconds
    cost: float = 0.0  # its prompt tokens (estimated from its bytes where not hashed)
    completion: int = 0  # the answer's tokens, once known
    cached: int = 0  # prompt tokens the engine had cached

    def settle(self, usage: Usage | None) -> None:
        """What the answer cost, from its usage (None: unknown, nothing charged)."""
        if usage is not None:
            self.completion = usage.completion_tokens
            self.cached = min(usage.cached_tokens, int(self.cost))  # work nobody computed


def budgeted(svc: RouterService, who: Principal, acct: Account) -> None:
    """RateLimited for a tenant out of its budget (before its body is read: it costs
    nothing more)."""
    if svc.ledger is None:
        return
    try:
        svc.ledger.admit(who.tenant, who.key_id)
    except RateLimited:
        acct.emit(Refused(who.band, "budget_exhausted"))
        raise


@contextlib.asynccontextmanager
async def admission(
    svc: RouterService, kind: str, raw: bytes, who: Principal, acct: Account
) -> AsyncIterator[Admission]:
    """`raw` parsed, hashed and admitted (the errors a client gets, with their records);
    on leaving, admission and the rate limiter are given back what the answer cost."""
    body, model, adapter, stream = parse(svc, kind, raw, who, acct)
    scale = lora_scale(body) if adapter else 1.0
    salt = adapter_salt(who.kv_salt, adapter, scale)  # an adapter's KV is never its base's
    estimate = len(raw) // CHARS_PER_TOKEN
    try:
        svc.limiter.acquire(who, estimate)
    except RateLimited:
        acct.emit(Refused(who.band, "rate_limited"))
        raise
    adm = Admission(who, body, model, adapter, scale, stream, HashedPrompt((), 0, "none"),
                    acct.started)  # fmt: skip
    try:
        adm.prompt = await hash_off_loop(svc, kind, model, body, len(raw), acct, salt)
        if adm.prompt.tokens:
            try:
                svc.limiter.settle(who, estimate, adm.prompt.tokens)
            except RateLimited:
                acct.emit(Refused(who.band, "rate_limited"))
                raise
        weight = who.record.weight if who.record is not None else 1.0
        adm.cost = float(adm.prompt.tokens or estimate)
        if (gate := svc.gate) is not None:
            adm.waited = await gate.enter(who.band, who.tenant, model, adm.cost, weight)
        acct.emit(Admitted(adm.waited))
        try:
            yield adm
        finally:
            if gate is not None:
                charge = float(adm.completion - adm.cached)
                gate.leave(model, (who.band, who.tenant, charge, weight))
    finally:
        svc.limiter.release(who, adm.completion)


def parse(
    svc: RouterService, kind: str, raw: bytes, who: Principal, acct: Account
) -> tuple[dict[str, Any], str, str | None, bool]:
    """(body, the model it means, the LoRA adapter it names, stream?) of a request body;
    400 or 404 when it is wrong. A model (or adapter) outside `who`'s scope is a 404 worded
    as for one that does not exist, and the 404 names only the models and adapters `who`
    may use: a key learns nothing of the others. A key's scope reaches an adapter where it
    names the adapter (or is "*"): naming its base is not enough."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise InvalidRequest("'model' is required", param="model")
    acct.emit(Asked(asked, who.tenant, who.band, who.key_id))
    for field in (TRANSFER_FIELD, RESUME_FIELD):  # an engine dials what the first names, and
        if field in body:  # the second passes someone else's tokens off as the model's
            raise InvalidRequest(f"'{field}' is set by the router only", param=field)
    if CACHE_SALT_FIELD in body:  # NOTE: a client's salt would let it join another's cache
        raise InvalidRequest(
            f"'{CACHE_SALT_FIELD}' is set by the router from your API key's tenant (or its "
            "kv_share_group): leave it out",
            param=CACHE_SALT_FIELD,
        )
    # What cgn-infer would refuse for its generation fields is refused here, before any work.
    stream = kind != "embeddings" and sampling_fields(kind, body).stream
    model, adapter = svc.model_for(asked), None
    if model is None and (base := svc.catalog.adapters().get(asked)) is not None:
        model, adapter = base, asked
    check_lora_fields(body, adapter)
    if model is None or not may_use(who, adapter or model):
        names = {**svc.known_models(), **own(svc.catalog.adapters())}
        known = ", ".join(sorted(visible(who, names))) or "none"
        scoped = "" if who.record is None else " or this key may not use it"
        raise NotFound(
            f"model '{asked}' does not exist{scoped} (known: {known})",
            code="model_not_found",
            param="model",
        )
    acct.model, acct.adapter = model, adapter or ""
    return body, model, adapter, stream


def check_lora_fields(body: Mapping[str, Any], adapter: str | None) -> None:
    """A request names its adapter in `model` and may scale it (`lora_scale`, what
    llama.cpp's `lora` field's scale means: 1 the adapter as trained, 0 the base); the
    router writes the engine's own fields (an engine's adapter ids are its own)."""
    if LORA_FIELD in body:
        why = f"'{LORA_FIELD}' is set by the router: name the LoRA adapter in 'model'"
        raise InvalidRequest(f"{why} (and scale it with '{LORA_SCALE_FIELD}')", param=LORA_FIELD)
    if LORA_SCALE_FIELD in body:
        if adapter is None:
            raise InvalidRequest(f"'{LORA_SCALE_FIELD}' scales a LoRA adapter: name one in "
                                 "'model'", param=LORA_SCALE_FIELD)  # fmt: skip
        lora_scale(body)


def own(adapters: Mapping[str, str]) -> dict[str, str]:
    """Adapter → itself: `visible` checks a key's scope against an adapter's own name."""
    return {a: a for a in adapters}


async def hash_off_loop(
    svc: RouterService,
    kind: str,
    model: str,
    body: dict[str, Any],
    size: int,
    acct: Account,
    salt: str | None,
) -> HashedPrompt:
    """`hash_prompt`, on a worker thread when the body is big enough to stall other streams (the
    record is emitted back on the loop: observers are not shared with threads)."""
    if size < OFF_LOOP_BYTES:
        return hash_prompt(svc, kind, model, body, acct, salt)
    hashed = await asyncio.to_thread(_prompt, svc, kind, model, body, salt)
    return _noted(hashed, model, acct)


def hash_prompt(
    svc: RouterService,
    kind: str,
    model: str,
    body: Mapping[str, Any],
    acct: Account,
    salt: str | None,
) -> HashedPrompt:
    return _noted(_prompt(svc, kind, model, body, salt), model, acct)


def _noted(hashed: HashedPrompt, model: str, acct: Account) -> HashedPrompt:
    """`hashed`, its method recorded (an embedding's prompt is not hashed: no record)."""
    if hashed.method != "none":
        acct.emit(Hashed(model, hashed.method, hashed.reused))
    return hashed


def _prompt(
    svc: RouterService, kind: str, model: str, body: Mapping[str, Any], salt: str | None
) -> HashedPrompt:
    """The prompt's block hashes, salted by its tenant's `salt` (None: unsalted)."""
    if kind == "embeddings":
        return HashedPrompt((), 0, "none")
    return svc.catalog.hasher(model).hash(kind, body, salt)
