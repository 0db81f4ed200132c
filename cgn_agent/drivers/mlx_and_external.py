"""mlx_lm's server, and external OpenAI-compatible engines (nothing spawned).

* mlx_lm: `python -m cgn_agent.launchers.mlx_lm_server` runs `mlx_lm.server`
  wherever `mlx_lm` imports (Apple silicon's GPU, or MLX's CPU backend on
  Linux). A GGUF source (a bundled model, a .gguf file) is converted once per
  node into an MLX directory; an MLX directory or a hub repo id is loaded as
  it is. The runner serves it under the placement's model name, requires the
  replica secret (MLX_LM_API_KEY) and publishes /metrics in the `mlx_lm:` names.
* openai_compat: an engine someone else runs at `profile.url`; the agent only
  probes it (its /v1/models must list the model) and publishes it.
"""

from __future__ import annotations

from cgn_agent.drivers.base import (
    Launch,
    LaunchContext,
    PlacementRefused,
    Toolbox,
    model_file,
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
        if spec.devices:
            raise PlacementRefused("mlx_lm takes no device indices (MLX uses the one GPU or CPU)")
        source = model_file(spec)  # a bundled model's file; anything else as it is
        if source.endswith(".gguf") and not tools.is_file(source):
            raise PlacementRefused(f"mlx_lm: model file {source} does not exist")

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        argv = [
            ctx.python,
            "-m",
            "cgn_agent.launchers.mlx_lm_server",
            "--source",
            model_file(spec),
            "--name",
            spec.model,
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
        ]
        extra = list(spec.profile.extra_args)
        env = dict(spec.profile.env)
        if ctx.token:  # read from the environment by the runner: never on argv
            env["MLX_LM_API_KEY"] = ctx.token
        return Launch(
            tuple(argv + (["--", *extra] if extra else [])),
            env,
            url_for(ctx),
            metrics_dialect="mlx_lm",
            token=ctx.token,
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
