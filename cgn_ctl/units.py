"""systemd units for the installed executables (`cgn-ctl install-units`).

One unit per daemon that exists today (cgn-router, cgn-agent, a cgn-infer@
template for standalone engines, cognitora-etcd for the embedded etcd) and
cognitora.target to start them together. cgn-router, cgn-agent and cgn-infer
are Type=notify: each sends READY=1 once it serves (cgn_core.readiness, the
sd_notify protocol) and STOPPING=1 when it shuts down; the agent keeps the
notification socket from its engines. The embedded etcd is Type=simple. Hardening: a
dedicated user, NoNewPrivileges, a read-only system, private /tmp, state
under /var/lib/cognitora/<service>, configuration in /etc/cognitora.
cgn-kvcached (the node's KV block store; its SSD tier under
/var/lib/cognitora/kv) and cgn-metrics (the fleet dashboard) are Type=notify too.

systemd/ in the repository holds the units rendered for /opt/cognitora/bin
(`render(in_directory(Path("/opt/cognitora/bin")), Path("/opt/cognitora/bin/etcd"))`;
tests/test_units.py keeps it in step with this module).
"""

from __future__ import annotations

from collections.abc import Mapping
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
    --listen-client-urls={scheme}://127.0.0.1:2379 \\
    --advertise-client-urls={scheme}://127.0.0.1:2379 \\
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \\
    --initial-cluster=cgn=http://127.0.0.1:2380{etcd_tls}
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
Type=notify
ExecStart={cgn_router} serve --config /etc/cognitora/router.yaml
# its workers restart one by one, reading the config again, refusing no request
ExecReload=/bin/kill -HUP $MAINPID
Restart=always
RestartSec=2
TimeoutStopSec=45
LimitNOFILE=65536
StateDirectory=cognitora/router
{tls}{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-agent.service": """\
[Unit]
Description=Cognitora node agent (inventory, engine supervision, registration in etcd)
PartOf=cognitora.target
After=network-online.target cognitora-etcd.service

[Service]
Type=notify
ExecStart={cgn_agent} run --config /etc/cognitora/agent.yaml \\
    --state-dir /var/lib/cognitora/agent
Restart=always
RestartSec=2
# Engines run in their own process groups and outlive an agent restart: the next agent
# adopts them. KillMode=process stops only the agent (engines.stop_on_exit stops them too).
KillMode=process
TimeoutStopSec=60
LimitNOFILE=65536
StateDirectory=cognitora/agent
# cgn-infer compiles its CPU kernels once per machine; the home directory is hidden here
CacheDirectory=cognitora/kernels
Environment=CGN_KERNEL_CACHE=%C/cognitora/kernels
{tls}{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-kvcached.service": """\
[Unit]
Description=Cognitora KV block store (RAM, then SSD) for this node's engines
PartOf=cognitora.target
After=network-online.target

[Service]
Type=notify
ExecStart={cgn_kvcached} serve --config /etc/cognitora/kvcached.yaml
Restart=always
RestartSec=2
TimeoutStopSec=30
StateDirectory=cognitora/kv
{tls}{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-metrics.service": """\
[Unit]
Description=Cognitora fleet metrics and dashboard (scrapes the fleet found in etcd)
PartOf=cognitora.target
After=network-online.target cognitora-etcd.service

[Service]
Type=notify
ExecStart={cgn_metrics} serve --config /etc/cognitora/metrics.yaml
Restart=always
RestartSec=2
TimeoutStopSec=15
StateDirectory=cognitora/metrics
{tls}{hardening}
[Install]
WantedBy=cognitora.target
""",
    "cgn-infer@.service": """\
[Unit]
Description=Cognitora standalone engine %i (settings in /etc/cognitora/infer-%i.yaml)
PartOf=cognitora.target
After=network-online.target

[Service]
Type=notify
ExecStart={cgn_infer} serve --config /etc/cognitora/infer-%i.yaml
# Loading weights can take minutes: READY=1 comes only once the model serves.
TimeoutStartSec=900
Restart=always
RestartSec=2
TimeoutStopSec=45
StateDirectory=cognitora/infer-%i
# its CPU kernels, compiled once per machine; the home directory is hidden here
CacheDirectory=cognitora/kernels
Environment=CGN_KERNEL_CACHE=%C/cognitora/kernels
{hardening}
[Install]
WantedBy=cognitora.target
""",
}


EXECUTABLES = ("cgn-router", "cgn-agent", "cgn-kvcached", "cgn-metrics", "cgn-infer")


# With a PKI directory (`install-units --pki DIR --node N`, the layout `cgn-ctl up` makes):
# each unit's service, the leaf it presents, and the settings that take that leaf (`-`: the
# certificate without the CA: the OpenAI port, whose clients show none).
TLS_UNITS = {
    "cgn-router.service": ("router", "router", ("etcd.tls", "admin_tls", "engine_tls", "tls-")),
    "cgn-agent.service": ("agent", "agent", ("etcd.tls", "admin_tls", "engines.tls")),
    "cgn-kvcached.service": ("kvcached", "agent", ("tls",)),
    "cgn-metrics.service": ("metrics", "metrics", ("etcd.tls", "tls")),
}


def tls_environment(service: str, pki: Path, name: str, settings: tuple[str, ...]) -> str:
    """`Environment=` lines giving `service` the CA and leaf `name` under each of `settings`
    (settings' environment variables: CGN_<SERVICE>_<PATH>, nested fields joined by `__`)."""
    lines = []
    for setting in settings:
        files = {"cert_file": pki / f"{name}.pem", "key_file": pki / f"{name}.key"}
        if not setting.endswith("-"):
            files = {"ca_file": pki / "ca.pem", **files}
        path = setting.rstrip("-").replace(".", "__").upper()
        for key, value in files.items():
            lines.append(f'Environment="CGN_{service.upper()}_{path}__{key.upper()}={value}"\n')
    return "".join(lines)


def render(
    paths: Mapping[str, Path],
    etcd: Path | None,
    user: str = "cognitora",
    pki: tuple[Path, str] | None = None,
) -> dict[str, str]:
    """Unit name -> text, given each executable's path (cgn-infer lives in its own venv, so
    the paths need not share a directory); etcd's unit only when `etcd` is given. `pki`: (the
    PKI directory, this node's id): every unit whose leaf is there gets its TLS settings,
    and etcd serves HTTPS and requires client certificates."""
    hardening = HARDENING.format(user=user)
    exe = {name.replace("-", "_"): paths[name] for name in EXECUTABLES}
    out = {}
    for name, text in UNITS.items():
        if name == "cognitora-etcd.service" and etcd is None:
            continue
        tls, scheme, etcd_tls = "", "http", ""
        if pki is not None:
            directory, node = pki
            if name in TLS_UNITS:
                service, role, settings = TLS_UNITS[name]
                if (directory / f"{node}-{role}.pem").exists():
                    tls = tls_environment(service, directory, f"{node}-{role}", settings)
            scheme = "https"
            d = directory
            etcd_tls = (f" \\\n    --cert-file={d}/etcd.pem --key-file={d}/etcd.key"
                        f" \\\n    --trusted-ca-file={d}/ca.pem --client-cert-auth")  # fmt: skip
        out[name] = text.format(etcd=etcd, hardening=hardening, tls=tls, scheme=scheme,
                                etcd_tls=etcd_tls, **exe)  # fmt: skip
    return out


def missing_leaves(pki: Path, node: str, with_etcd: bool) -> list[str]:
    """The units that get no TLS settings because their leaf is not in `pki` (a joined
    machine holds only its agent's)."""
    out = [f"{unit} ({node}-{role}.pem)" for unit, (_, role, _) in TLS_UNITS.items()
           if not (pki / f"{node}-{role}.pem").exists()]  # fmt: skip
    if with_etcd and not (pki / "etcd.pem").exists():
        out.append("cognitora-etcd.service (etcd.pem)")
    return out


def in_directory(bin_dir: Path) -> dict[str, Path]:
    """Every executable in one directory (pipx's shared bin directory, /opt/cognitora/bin)."""
    return {name: bin_dir / name for name in EXECUTABLES}
