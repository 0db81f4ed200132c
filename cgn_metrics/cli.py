"""cgn-metrics command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_core.cli import make_app, not_built, run
from cgn_metrics.settings import MetricsSettings

app = make_app(
    "metrics", "Power and energy exporter, metrics federation, and the dashboard.", MetricsSettings
)
not_built(app, "serve", "export power, federate metrics, serve the dashboard", None)

main = run(app)
