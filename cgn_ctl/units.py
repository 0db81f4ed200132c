"""systemd units for the installed executables (`cgn-ctl install-units`).

One unit per daemon that exists today (cgn-router, cgn-agent, a cgn-infer@
template for standalone engines, cognitora-etcd for the embedded etcd) and
cognitora.target to start them together. Type=simple: the daemons do not
send sd_notify READY=1 (they write --ready-file instead). Hardening: a
dedicated user, NoNewPrivileges, a read-only system, private /tmp, state
under /var/lib/cognitora/<service>, configuration in /etc/cognitora.
cgn-kvcached and cgn-metrics get their units with the daemons themselves.

systemd/ in the repository holds the units rendered for /opt/cognitora/bin
(tests/test_units.py keeps it in step with this module).
"""

from __future__ import annotations

from pathlib import Path

HARDENING = """\
User={user}
Group={user}
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes
ConfigurationDirectory=cognitora
"""

UNITS = {
    "cognitora.target": """\
[Unit]
Description=Cognitora: every service on this machine
Wants=network-online.target
After=network-online.target

[Install]
WantedBy=multi-user.target
""",
    "cognitora-etcd.service": """\
[Unit]
Description=Cognitora embedded etcd (single member; use your own etcd cluster for production)
PartOf=cognitora.target
After=network-online.target

[Service]
Type=simple
ExecStart={etcd} --name=cgn --data-dir=/var/lib/cognitora/etcd \\
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \\
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \\
    --initial-cluster=cgn=http://127.0.0.1:2380
Restart=always
RestartSec=2
StateDirectory=cognitora/etcd
{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-router.service": """\
[Unit]
Description=Cognitora router (OpenAI gateway, admission, reconciler)
PartOf=cognitora.target
After=network-online.target cognitora-etcd.service

[Service]
Type=simple
ExecStart={bin}/cgn-router serve --config /etc/cognitora/router.yaml
Restart=always
RestartSec=2
TimeoutStopSec=45
LimitNOFILE=65536
StateDirectory=cognitora/router
{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-agent.service": """\
[Unit]
Description=Cognitora node agent (inventory, engine supervision, registration in etcd)
PartOf=cognitora.target
After=network-online.target cognitora-etcd.service

[Service]
Type=simple
ExecStart={bin}/cgn-agent run --config /etc/cognitora/agent.yaml \\
    --state-dir /var/lib/cognitora/agent
Restart=always
RestartSec=2
# Engines run in their own process groups and outlive an agent restart: the next agent
# adopts them. KillMode=process stops only the agent (engines.stop_on_exit stops them too).
KillMode=process
TimeoutStopSec=60
LimitNOFILE=65536
StateDirectory=cognitora/agent
{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-infer@.service": """\
[Unit]
Description=Cognitora standalone engine %i (settings in /etc/cognitora/infer-%i.yaml)
PartOf=cognitora.target
After=network-online.target

[Service]
Type=simple
ExecStart={bin}/cgn-infer serve --config /etc/cognitora/infer-%i.yaml
Restart=always
RestartSec=2
TimeoutStopSec=45
StateDirectory=cognitora/infer-%i
{hardening}
[Install]
WantedBy=cognitora.target
""",
}


def render(bin_dir: Path, etcd: Path | None, user: str = "cognitora") -> dict[str, str]:
    """Unit name -> text for executables in `bin_dir` (etcd's unit only when `etcd` is given)."""
    hardening = HARDENING.format(user=user)
    out = {}
    for name, text in UNITS.items():
        if name == "cognitora-etcd.service" and etcd is None:
            continue
        out[name] = text.format(bin=bin_dir, etcd=etcd, hardening=hardening)
    return out
