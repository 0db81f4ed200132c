"""cgn-ctl command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_core.cli import make_app, not_built, run
from cgn_ctl.settings import CtlSettings

app = make_app(
    "ctl",
    "Operate a Cognitora cluster: nodes, models, replicas, placement, PKI, keys.",
    CtlSettings,
)
not_built(app, "up", "start a single-node cluster", 10)
not_built(app, "down", "stop what up started", 10)
not_built(app, "status", "show what runs", 7)
not_built(app, "nodes", "list nodes", 7)
not_built(app, "models", "manage the model catalog", 7)
not_built(app, "pki", "manage the private CA", 9)
not_built(app, "keys", "manage API keys", 8)

main = run(app)
