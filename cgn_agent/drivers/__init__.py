"""Engine drivers by placement name (`engine:` in a placement)."""

from __future__ import annotations

from cgn_agent.drivers.base import (
    Driver,
    Launch,
    LaunchContext,
    PlacementRefused,
    SystemToolbox,
    Toolbox,
)
from cgn_agent.drivers.cgn_infer import CgnInferDriver
from cgn_agent.drivers.gpu_engines import SglangDriver, TrtllmDriver, VllmDriver
from cgn_agent.drivers.llama_cpp import LlamaCppDriver
from cgn_agent.drivers.mlx_and_external import MlxLmDriver, OpenAICompatDriver

DRIVERS: dict[str, Driver] = {
    d.name: d
    for d in (
        CgnInferDriver(),
        LlamaCppDriver(),
        VllmDriver(),
        SglangDriver(),
        MlxLmDriver(),
        TrtllmDriver(),
        OpenAICompatDriver(),
    )
}


def installed_engines(tools: Toolbox, offer: tuple[str, ...] = ()) -> list[str]:
    """The engines whose software is on this machine (openai_compat needs none), of those in
    `offer` when it names any (the agent's engines.offer)."""
    return [
        name for name, d in DRIVERS.items() if (not offer or name in offer) and d.installed(tools)
    ]


__all__ = [
    "DRIVERS",
    "Driver",
    "Launch",
    "LaunchContext",
    "PlacementRefused",
    "SystemToolbox",
    "Toolbox",
    "installed_engines",
]
