"""Loading and unloading LoRA adapters at run time, with vLLM's paths and bodies (#60):

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/models/sql.gguf"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Both are /v1/* paths: with an API token (the agent always sets one), only its bearer,
the router, may call them. A path must resolve (links followed, then checked) to a
file under one of the engine's `lora_dirs`; the file is read and checked against the
model on a thread of its own, off the event loop and off the worker thread, so a load
never holds up a decode step; loads run one at a time. A full set evicts its least
recently used adapter that no request holds (`Adapters.install`). Answers are vLLM's:
a line of text on success, an OpenAI error otherwise (400 a bad body or file or a
name already loaded, 403 a path outside `lora_dirs`, 404 unloading what is not loaded,
503 every slot held).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from cgn_core.errors import Forbidden, InvalidRequest, NotFound
from cgn_core.http import parse_json, read_body
from cgn_core.keys import NAME
from cgn_infer.adapters import Adapters
from cgn_infer.metrics import EngineMetrics


class InferenceService(Protocol):
    """What of server.py's service the handlers use (server.py sits above this module)."""

    body_timeout_s: float
    metrics: EngineMetrics

    def ready(self) -> Any: ...  # its Serving: .adapters, .lora_dirs


log = logging.getLogger(__name__)
MAX_PATH = 4096


def add_routes(app: web.Application, svc: InferenceService) -> None:
    lock = asyncio.Lock()
    app.router.add_post("/v1/load_lora_adapter", lambda r: _load(svc, r, lock))
    app.router.add_post("/v1/unload_lora_adapter", lambda r: _unload(svc, r))


async def _body(svc: InferenceService, request: web.Request, fields: set[str]) -> dict[str, Any]:
    body = parse_json(await read_body(request, svc.body_timeout_s))
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if unknown := sorted(set(body) - fields):
        raise InvalidRequest(f"unsupported field(s) {unknown} (known: {sorted(fields)})")
    name = body.get("lora_name")
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidRequest("'lora_name' must be a name of [A-Za-z0-9._:-]", param="lora_name")
    return body


def _adapters(svc: InferenceService) -> tuple[Adapters, tuple[Path, ...]]:
    """The engine's adapters and where it may load them from; 404 where it holds none."""
    serving = svc.ready()
    if serving.adapters is None:
        raise NotFound("this engine serves no LoRA adapters (start it with --lora or lora_dirs)")
    return serving.adapters, serving.lora_dirs


async def _load(svc: InferenceService, request: web.Request, lock: asyncio.Lock) -> web.Response:
    body = await _body(svc, request, {"lora_name", "lora_path"})
    adapters, dirs = _adapters(svc)
    path = _allowed(body.get("lora_path"), dirs)
    name = body["lora_name"]
    async with lock:
        started = time.monotonic()
        adapters.check_free(name)
        read = await asyncio.to_thread(adapters.read, path)
        _, evicted = adapters.install(name, read)
        took = time.monotonic() - started
    svc.metrics.lora_load_seconds.observe(took)
    if evicted is not None:
        svc.metrics.lora_evictions.inc()
        svc.metrics.lora_loaded.remove(evicted)
    svc.metrics.lora_loaded.set(name)
    log.info("LoRA adapter %s loaded from %s in %.2f s%s", name, path, took,
             f" (evicted {evicted})" if evicted else "")  # fmt: skip
    headers = {"x-cgn-evicted": evicted} if evicted else {}  # the router updates its view
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.", headers=headers)


async def _unload(svc: InferenceService, request: web.Request) -> web.Response:
    body = await _body(svc, request, {"lora_name", "lora_int_id"})
    adapters, _ = _adapters(svc)
    adapters.unload(body["lora_name"])
    svc.metrics.lora_loaded.remove(body["lora_name"])
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


def _allowed(raw: Any, dirs: tuple[Path, ...]) -> Path:
    """The adapter file `raw` names, resolved, under one of `dirs`; 400 or 403 otherwise."""
    if not isinstance(raw, str) or not raw.startswith("/") or len(raw) > MAX_PATH:
        raise InvalidRequest("'lora_path' must be an absolute path", param="lora_path")
    if not dirs:
        raise Forbidden("this engine loads no adapters at run time (no lora_dirs)",
                        param="lora_path")  # fmt: skip
    path = Path(raw).resolve()
    if not any(path.is_relative_to(d.resolve()) for d in dirs):
        where = ", ".join(str(d) for d in dirs)
        raise Forbidden(f"'lora_path' {raw} is not under the engine's lora_dirs ({where})",
                        param="lora_path")  # fmt: skip
    if not (path.is_file() or path.is_dir()):  # a GGUF file or a PEFT directory
        raise InvalidRequest(f"'lora_path' {raw} is neither a file nor a directory",
                             param="lora_path")  # fmt: skip
    return path
