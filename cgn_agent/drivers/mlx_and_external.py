"""mlx_lm.server on Apple silicon, and external OpenAI-compatible engines (nothing spawned).

* mlx_lm: `python -m mlx_lm.server --model <source> --host --port`. It serves
  a model under its source name and has no alias flag, so the placement's
  model must equal its source; it has /health but no Prometheus /metrics.
* openai_compat: an engine someone else runs at `profile.url`; the agent only
  probes it (its /v1/models must list the model) and publishes it.
"""

from __future__ import annotations

from cgn_agent.drivers.base import (
    Launch,
    LaunchContext,
    PlacementRefused,
    Toolbox,
    require_connector_none,
    require_source,
    url_for,
)
from cgn_agent.inventory.types import Inventory
from cgn_agent.spec import ReplicaSpec


class MlxLmDriver:
    name = "mlx_lm"

    def installed(self, tools: Toolbox) -> bool:
        return tools.has_module("mlx_lm")

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        require_source(spec, self.name)
        require_connector_none(spec, self.name)
        if not any(a.kind == "apple" for a in node.accelerators):
            raise PlacementRefused(
                f"mlx_lm needs Apple silicon; node {node.node} is class {node.node_class}"
            )
        if spec.devices:
            raise PlacementRefused("mlx_lm takes no device indices (Apple has one GPU)")
        if spec.model != spec.source:
            raise PlacementRefused(
                f"mlx_lm.server serves a model under its source name; set model to {spec.source!r}"
            )

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        argv = [
            ctx.python,
            "-m",
            "mlx_lm.server",
            "--model",
            spec.source,
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
        ]
        return Launch(
            tuple(argv + list(spec.profile.extra_args)), dict(spec.profile.env), url_for(ctx)
        )


class OpenAICompatDriver:
    name = "openai_compat"

    def installed(self, tools: Toolbox) -> bool:
        return True

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        require_connector_none(spec, self.name)
        url = spec.profile.url or ""
        if not url.startswith(("http://", "https://")):
            raise PlacementRefused("openai_compat: profile.url must be the engine's http(s) URL")

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        return Launch(
            (),
            url=(spec.profile.url or "").rstrip("/"),
            health_path="/v1/models",
            spawn=False,
        )
