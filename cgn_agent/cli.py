"""cgn-agent command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_agent.settings import AgentSettings
from cgn_core.cli import make_app, not_built, run

app = make_app(
    "agent",
    "Per-node agent: hardware inventory, engine supervision, registration in etcd.",
    AgentSettings,
)
not_built(app, "run", "supervise engines and register them in etcd", 6)
not_built(app, "inventory", "print the node's hardware inventory", 6)

main = run(app)
