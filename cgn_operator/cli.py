"""cgn-operator command line (typer; see cgn_core.cli for the shared parts)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml

from cgn_core.cli import flag, load_service_settings, make_app, parse_overrides, run
from cgn_core.logs import setup_logging
from cgn_operator.settings import OperatorSettings

app = make_app(
    "operator",
    "Kubernetes operator: CognitoraCluster and CognitoraModel resources (cognitora.io/v1alpha1)"
    " become a running cluster and its model catalog.",
    OperatorSettings,
)


@app.command()
def manifests(
    namespace: Annotated[
        str, flag("--namespace", 'Where the operator runs and what it watches ("": all).')
    ] = "cognitora",
    image: Annotated[
        str | None, flag("--image", "The image of the operator and, by default, the clusters.")
    ] = None,
    crds_only: Annotated[bool, flag("--crds-only", "Print only the two CRDs.")] = False,
) -> None:
    """Print the CRDs, RBAC and the operator's Deployment as YAML: `cgn-operator manifests |
    kubectl apply -f -`. RBAC is least privilege: a Role over the kinds it manages in its
    namespace and read-only access to Nodes."""
    from cgn_operator.crds import crds
    from cgn_operator.manifests import manifests as render

    image = image or OperatorSettings().image
    docs = crds() if crds_only else render(namespace, image)
    typer.echo(yaml.safe_dump_all(docs, sort_keys=False).rstrip())


@app.command("run")
def run_(
    namespace: Annotated[
        str | None, flag("--namespace", 'Namespace to watch ("": every namespace).')
    ] = None,
    kubeconfig: Annotated[
        Path | None, flag("--kubeconfig", "A kubeconfig (default: in-cluster, then $KUBECONFIG).")
    ] = None,
    standalone: Annotated[
        bool, flag("--standalone", "No leader election: this is the only operator (development).")
    ] = False,
    liveness: Annotated[
        str | None,
        flag("--liveness", "Serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz"),
    ] = None,
    config: Annotated[
        Path | None, flag("--config", "YAML settings file.", "CGN_OPERATOR_CONFIG")
    ] = None,
    set_: Annotated[
        list[str] | None, flag("--set", "Override a setting: --set resync_s=60.")
    ] = None,
) -> None:
    """Run the operator: reconcile CognitoraCluster and CognitoraModel resources until
    stopped (SIGINT/SIGTERM). A model is validated by the same code as `cgn-ctl models
    apply` and written to its cluster's catalog in etcd; its status follows the replicas."""
    flags = parse_overrides(set_)
    for key, value in {"namespace": namespace, "kubeconfig": kubeconfig}.items():
        if value is not None:
            flags[key] = str(value)
    if standalone:
        flags["standalone"] = "true"
    settings = load_service_settings(OperatorSettings, "operator", config, flags)
    setup_logging("operator", settings.log)
    if settings.kubeconfig is not None:
        if not settings.kubeconfig.is_file():
            typer.echo(f"error: --kubeconfig {settings.kubeconfig}: no such file", err=True)
            sys.exit(2)
        os.environ["KUBECONFIG"] = str(settings.kubeconfig)
    from cgn_operator.run import start
    from cgn_operator.state import State

    asyncio.run(start(State(settings), liveness=liveness))


main = run(app)
