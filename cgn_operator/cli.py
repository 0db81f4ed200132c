"""cgn-operator command line (typer; see cgn_core.cli for the shared parts)."""

from cgn_core.cli import make_app, not_built, run
from cgn_operator.settings import OperatorSettings

app = make_app(
    "operator",
    "Kubernetes operator for InferenceCluster, ModelPool and RoutingPolicy.",
    OperatorSettings,
)
not_built(app, "run", "reconcile the Cognitora CRDs", None)

main = run(app)
