"""cgn-agent's Prometheus metrics, read from the live agent at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cgn_agent.inventory.types import Inventory
from cgn_agent.node import NodeAgent
from cgn_agent.power import PowerReading
from cgn_agent.supervisor import Phase


class AgentCollector(Collector):
    def __init__(
        self,
        agent: NodeAgent,
        inventory: Callable[[], Inventory],
        power: Callable[[], tuple[PowerReading, float]],
        etcd_connected: Callable[[], bool],
    ):
        self.agent = agent
        self.inventory = inventory
        self.power = power
        self.etcd_connected = etcd_connected

    def collect(self) -> Iterator[Metric]:
        phases = GaugeMetricFamily("cgn_agent_replicas", "Replicas by phase", labels=["phase"])
        count = Counter(str(r.state.phase) for r in self.agent.runners.values())
        count[str(Phase.FAILED)] += len(self.agent.refused)
        for phase in Phase:
            phases.add_metric([str(phase)], count.get(str(phase), 0))
        yield phases
        restarts = CounterMetricFamily(
            "cgn_agent_replica_restarts", "Engine restarts", labels=["replica", "model"]
        )
        ready = GaugeMetricFamily(
            "cgn_agent_replica_ready", "1 while the replica is Ready", labels=["replica", "model"]
        )
        for r in self.agent.runners.values():
            restarts.add_metric([r.spec.replica, r.spec.model], r.state.restarts)
            ready.add_metric([r.spec.replica, r.spec.model], int(r.state.phase == Phase.READY))
        yield restarts
        yield ready
        yield GaugeMetricFamily(
            "cgn_agent_etcd_connected",
            "1 while the agent's last etcd write succeeded",
            value=int(self.etcd_connected()),
        )
        inv = self.inventory()
        acc = GaugeMetricFamily(
            "cgn_agent_accelerators", "Accelerators by class", labels=["class", "healthy"]
        )
        by = Counter((a.accel_class, str(a.healthy).lower()) for a in inv.accelerators)
        for (cls, healthy), n in sorted(by.items()):
            acc.add_metric([cls, healthy], n)
        yield acc
        reading, energy = self.power()
        if reading.watts is not None:
            watts = GaugeMetricFamily(
                "cgn_agent_power_watts",
                "Node power draw (absent when no source exists)",
                labels=["source"],
            )
            watts.add_metric([reading.source], reading.watts)
            yield watts
            yield CounterMetricFamily(
                "cgn_agent_energy_joules", "Energy measured since the agent started", value=energy
            )


def registry_for(collector: AgentCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
