"""cgn-router command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_core.cli import make_app, not_built, run
from cgn_router.settings import RouterSettings

app = make_app(
    "router",
    "The OpenAI-compatible gateway: KV-aware routing, admission, streaming proxy.",
    RouterSettings,
)
not_built(app, "serve", "serve the OpenAI API and route to engines", 5)

main = run(app)
