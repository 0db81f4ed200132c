"""`cgn-ctl explain-route MODEL PROMPT`: where the router would send a request now, and why (#57).

It asks the router's admin listener (`POST /debug/route`, cgn_router/explain.py), which
hashes the prompt as the request path does and runs its routing chain over the same
snapshot, sending nothing. The router is the one `cgn-ctl up` started (its admin URL in
up's record) unless `--router-admin` names another. Over HTTPS, cgn-ctl shows the `root`
certificate `up` made (a client certificate from the cluster's CA, which the admin
listener asks for); over plaintext with auth on, an admin API key (`--admin-key`,
CGN_ADMIN_KEY).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import httpx
import typer
from rich.table import Table

from cgn_core.cli import flag, load_service_settings
from cgn_core.errors import CognitoraError
from cgn_core.settings import TlsSettings
from cgn_core.terminal import for_terminal
from cgn_core.tls import client_ssl_context
from cgn_ctl import render
from cgn_ctl.options import Config, Json, StateDir, read_capped, root_tls, up_record
from cgn_ctl.settings import CtlSettings

DEFAULT_ADMIN = "http://127.0.0.1:9091"
MAX_ANSWER_BYTES = 4 << 20  # an answer lists every endpoint of one model


class RouteUnexplained(CognitoraError):
    """The router could not be asked, or refused the question (the message says which)."""


def explain_route(
    model: Annotated[str, typer.Argument(help="The model, as a client names it.")],
    prompt: Annotated[
        str, typer.Argument(help="The prompt (a completion's, or with --chat a user message).")
    ],
    chat: Annotated[
        bool, typer.Option("--chat", help="Send the prompt as a chat's one user message.")
    ] = False,
    tenant: Annotated[
        str | None, flag("--tenant", "Whose cached prompts count (with KV isolation on).")
    ] = None,
    router: Annotated[
        str | None,
        flag(
            "--router-admin",
            "The router's admin URL (default: the one `cgn-ctl up` started, else "
            f"{DEFAULT_ADMIN}).",
            "CGN_CTL_ROUTER_ADMIN",
        ),
    ] = None,
    admin_key: Annotated[
        str | None,
        flag(
            "--admin-key",
            "An admin API key (a plaintext admin listener with auth on).",
            "CGN_ADMIN_KEY",
        ),
    ] = None,
    as_json: Json = False,
    state_dir: StateDir = None,
    config: Config = None,
) -> None:
    """Where a request would go now, and why: per endpoint of the model, the filter that
    dropped it, each scorer's score and the total, and the predicted time to first token
    term by term (wait behind its queue, prefill of what it does not hold, other requests'
    share, overhead, times its lag), its hit and whether its speed is learned. Sends
    nothing to any engine."""
    settings = load_service_settings(CtlSettings, "ctl", config, {})
    url, tls = _target(router, up_record(state_dir, settings))
    body: dict[str, Any] = {"model": model}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if tenant:
        body["tenant"] = tenant
    try:
        answer = ask(url, body, tls, admin_key)
    except CognitoraError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
    else:
        render.console.print(table(for_terminal(answer)))


def _target(router: str | None, record: dict[str, Any] | None) -> tuple[str, TlsSettings | None]:
    """The admin URL to ask and, for `up`'s HTTPS router, the root certificate to show."""
    recorded = record.get("router_admin") if record else None
    url = router or (recorded if isinstance(recorded, str) and recorded else DEFAULT_ADMIN)
    return url, root_tls(record) if url.startswith("https://") else None


def ask(
    url: str, body: dict[str, Any], tls: TlsSettings | None, admin_key: str | None
) -> dict[str, Any]:
    """The router's answer to `POST /debug/route`; RouteUnexplained says why there is none."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    verify: Any = client_ssl_context(tls) if tls is not None else True
    api = url.rstrip("/") + "/debug/route"
    try:
        with (
            httpx.Client(verify=verify, timeout=10) as client,
            client.stream("POST", api, json=body, headers=headers) as resp,
        ):
            raw = read_capped(resp, MAX_ANSWER_BYTES)
            if raw is None:
                raise RouteUnexplained(f"{api} answered more than {MAX_ANSWER_BYTES} bytes")
            status = resp.status_code
        answer = json.loads(raw)
    except (httpx.HTTPError, ValueError, OSError) as exc:
        raise RouteUnexplained(
            f"cannot ask the router at {url} ({type(exc).__name__}: {exc}); is it running? "
            "(--router-admin URL names another)"
        ) from None
    if status != 200:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise RouteUnexplained(f"the router answered {status}: {message or 'no reason given'}")
    if not isinstance(answer, dict) or not isinstance(answer.get("candidates"), list):
        raise RouteUnexplained(f"{api} answered JSON that is not a routing explanation")
    return answer


def table(answer: dict[str, Any]) -> Table:
    """One row per endpoint, the chosen one first, as the router ranked them."""
    t = Table(
        "endpoint", "engine", "chosen", "dropped by", "total", "predicted ms",
        "wait + prefill + others + overhead", "lag", "hit tokens", "speed",
        title=f"{answer.get('model')}: {answer.get('prompt_tokens')} prompt tokens "
              f"(hashed by {answer.get('hashed_by')}), chosen {answer.get('chosen') or 'none'}",
    )  # fmt: skip
    for c in answer["candidates"]:
        if not isinstance(c, dict):
            continue
        terms = _object(c.get("terms_ms"))
        speed = _object(c.get("speed"))
        t.add_row(
            str(c.get("id")),
            str(c.get("engine")),
            "*" if c.get("chosen") else "",
            str(c.get("dropped_by") or ""),
            _number(c.get("total"), 3),
            _number(c.get("predicted_ttft_ms"), 1),
            " + ".join(_number(terms.get(k), 1) for k in ("wait", "prefill", "others", "overhead")),
            _number(c.get("lag"), 2),
            _number(c.get("hit_tokens"), 0),
            "learned" if speed.get("learned") else "prior",
        )
    return t


def _number(value: Any, digits: int) -> str:
    """A figure of the answer as text; "-" for one that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return f"{value:,.{digits}f}"


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
