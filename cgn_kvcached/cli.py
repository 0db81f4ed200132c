"""cgn-kvcached command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_core.cli import make_app, not_built, run
from cgn_kvcached.settings import KvcachedSettings

app = make_app(
    "kvcached", "Per-node tiered KV block store (RAM, then SSD) over gRPC.", KvcachedSettings
)
not_built(app, "serve", "serve the tiered KV block store", None)

main = run(app)
