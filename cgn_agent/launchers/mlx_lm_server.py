"""mlx_lm's OpenAI server, run as an agent's engine: a local model, a name, a secret, metrics.

    python -m cgn_agent.launchers.mlx_lm_server --source smollm2 --name smollm2 --port 8003

`mlx_lm.server` (the `mlx-lm` package) answers /v1/chat/completions and
/v1/completions and has /health; it loads Hugging Face-style directories or
repo ids, serves a request's `model` by loading that name, and has no API key
and no /metrics. This runner closes those gaps without changing its serving:

* model: a GGUF source (a bundled model's name or a .gguf file) is converted
  once per node into an MLX directory (cgn_agent/launchers/mlx_convert.py, cached
  under --cache); an MLX directory or a hub repo id is used as it is.
* name: the engine starts in its replica's directory; a link there named like
  the served model points at the model, and mlx_lm.server is started with
  `--model <name>`, so requests naming the model hit the loaded one (mlx_lm
  takes an existing local path before the hub).
* secret: with MLX_LM_API_KEY set (never on argv), every path but /health
  needs `Authorization: Bearer <key>` (401 otherwise), as llama.cpp's server.
* metrics: GET /metrics is a Prometheus page in the `mlx_lm:` names of
  cgn_core/engine_metrics.py: requests running, prompt and generated tokens,
  prompt tokens served from its prompt cache, finished requests. It has no
  queue figure and no KV-usage figure (mlx_lm publishes neither).

It hooks `mlx_lm.server.run` and subclasses its handler and response
generator (mlx-lm 0.32); a version without those names is refused at start
with a line rather than served half-instrumented.
"""

from __future__ import annotations

import argparse
import hmac
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from cgn_core import bundled_models
from cgn_core.errors import CognitoraError

TOKEN_ENV = "MLX_LM_API_KEY"
log = logging.getLogger("cgn_agent.launchers.mlx_lm_server")


class Counters:
    """What /metrics publishes, in prometheus_client's metrics (safe from the server's
    request threads): `add(running=1, prompt_tokens=30, ...)`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._metrics: dict[str, Gauge | Counter] = {
            "running": Gauge("mlx_lm:requests_running", "Requests being answered", registry=r),
            "prompt_tokens": Counter("mlx_lm:prompt_tokens", "Prompt tokens", registry=r),
            "generation_tokens": Counter(
                "mlx_lm:generation_tokens", "Generated tokens", registry=r
            ),
            "prompt_cached": Counter(
                "mlx_lm:prompt_tokens_cached", "Prompt tokens from the prompt cache", registry=r
            ),
            "requests": Counter("mlx_lm:requests", "Requests answered", registry=r),
        }

    def add(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self._metrics[name].inc(delta)

    def page(self) -> str:
        return generate_latest(self.registry).decode()


def model_dir(source: str, cache: Path) -> str:
    """What mlx_lm.server loads for `source`: a GGUF (a bundled model's name or a .gguf
    file) converted once into `cache`, else the source itself (an MLX directory, a repo id)."""
    path = bundled_models.resolve(Path(source))
    if path.is_file():
        from cgn_agent.launchers import mlx_convert

        return str(mlx_convert.ensure(path, cache))
    return source


def link_name(name: str, target: str) -> None:
    """`./<name>` (in the replica's directory) pointing at the model `target`."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CognitoraError(f"served name {name!r} must be a relative name without '..'")
    if str(rel) == target:
        return
    rel.parent.mkdir(parents=True, exist_ok=True)
    tmp = rel.with_name(f".{rel.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(Path(target).resolve() if Path(target).exists() else target)
    os.replace(tmp, rel)


def instrumented(server: Any, counters: Counters, token: str, name: str) -> tuple[Any, Any]:
    """mlx_lm's handler and response generator, authenticating and counting; /v1/models
    lists the served model (mlx_lm's own lists the Hugging Face cache)."""
    models = json.dumps(
        {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "mlx_lm"}]}
    ).encode()

    class Generator(server.ResponseGenerator):  # type: ignore[misc]
        def generate(self, request: Any, args: Any, progress_callback: Any = None) -> Any:
            ctx, response = super().generate(request, args, progress_callback)
            cached = max(int(getattr(ctx, "prompt_cache_count", 0) or 0), 0)
            counters.add(prompt_tokens=len(ctx.prompt), prompt_cached=cached)

            def counted() -> Iterator[Any]:
                for item in response:
                    counters.add(generation_tokens=1)
                    yield item

            return ctx, counted()

    class Handler(server.APIHandler):  # type: ignore[misc]
        def _allowed(self) -> bool:
            if not token or self.path == "/health":
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            body = b'{"error": {"message": "invalid or missing API key", "type": "auth"}}'
            self._answer(body, "application/json", 401)
            return False

        def do_GET(self) -> None:
            if not self._allowed():
                return
            if self.path == "/metrics":
                self._answer(counters.page().encode(), "text/plain; version=0.0.4")
            elif self.path.split("?")[0] == "/v1/models":
                self._answer(models, "application/json")
            else:
                super().do_GET()

        def _answer(self, body: bytes, content_type: str, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            if not self._allowed():
                return
            counters.add(running=1)
            try:
                super().do_POST()
            finally:
                counters.add(running=-1, requests=1)

    return Handler, Generator


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mlx_lm_server",
        description="mlx_lm.server for one model, under a served name, with a secret and "
        "/metrics. Arguments after -- go to mlx_lm.server.",
    )
    ap.add_argument("--source", required=True, help="bundled model, .gguf, MLX dir or repo id")
    ap.add_argument("--name", required=True, help="the model name requests use")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument(
        "--cache",
        type=Path,
        default=bundled_models.cache_dir().parent / "mlx",
        help="where GGUF conversions are kept (default: %(default)s)",
    )
    ap.add_argument("rest", nargs="*", help="passed to mlx_lm.server")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        server: Any = importlib.import_module("mlx_lm.server")
        for needed in (
            "main",
            "run",
            "_run_http_server",
            "APIHandler",
            "ResponseGenerator",
            "LRUPromptCache",
        ):
            if not hasattr(server, needed):
                raise CognitoraError(
                    f"mlx_lm {getattr(server, '__version__', '')} has no server.{needed}: "
                    "this runner supports mlx-lm 0.32"
                )
        target = model_dir(args.source, args.cache)
        link_name(args.name, target)
    except (CognitoraError, OSError, ImportError) as exc:
        sys.exit(f"mlx_lm_server: {exc}")
    log.info("serving %s as %r", target, args.name)
    token = os.environ.get(TOKEN_ENV, "")
    handler, generator = instrumented(server, Counters(), token, args.name)

    def run(host: str, port: int, provider: Any) -> None:
        cache = server.LRUPromptCache(provider.cli_args.prompt_cache_size)
        server._run_http_server(host, port, generator(provider, cache), handler_class=handler)

    server.run = run
    sys.argv = ["mlx_lm.server", "--model", args.name, "--host", args.host]
    sys.argv += ["--port", str(args.port), *args.rest]
    server.main()


if __name__ == "__main__":
    main()
