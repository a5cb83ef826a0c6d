"""Per-host renderers: what one node must look like (the agent's host.json) and the files
that go with it: the firewall, the worker and firewall units.

`render_host` is the single description of a host, for every backend that runs the agent
(ssh, the clouds, the lab); `HostRole` says which parts a backend wants.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from pathlib import Path

from geotrain.agent.hostspec import (
    AddressSpec,
    DirSpec,
    FileSpec,
    FrrSpec,
    HostSpec,
    Mirrors,
    RepoSpec,
    RouteSpec,
    SecretFileSpec,
    TunnelSpec,
    UnitSpec,
)
from infra.model.paths import ETC, FIREWALL_PATH, REMOTE_SPEC_PATH, RUN_KEY_PATH
from infra.model.schema import Mirrors as PoolMirrors
from infra.plan import Plan, PlanNode
from infra.render.monitoring import (
    GRAFANA_DASHBOARDS,
    MonitoringFile,
    monitoring_files,
    secret_files,
)
from infra.render.network import render_frr, render_sysctl, render_wireguard, underlay_of
from infra.render.packages import HostService, host_services
from infra.render.runtime import (
    REMOTE_RUN_DIR,
    REMOTE_STATE_DIR,
    SERVICE_USER,
    render_launch_spec,
    render_worker_unit,
)
from training.spec import node_root

FIREWALL_UNIT = "geotrain-firewall.service"
WORKER_UNIT = "geotrain-worker.service"
BASE_PACKAGES = ("iproute2", "nftables", "python3-venv")
GATEWAY_PACKAGES = ("wireguard-tools", "frr", "frr-pythontools")
"""frr-pythontools holds frr-reload.py, which `systemctl reload frr` runs: without it a
changed frr.conf (a new peer, or a hand edit the next apply puts back) fails to apply."""
FRR_DAEMONS = {"bgpd": "yes", "bfdd": "yes"}
"""Set in Debian's /etc/frr/daemons (zebra and mgmtd always run)."""


@dataclass(frozen=True)
class HostRole:
    """What a backend wants the agent to do on its hosts."""

    training: bool = True
    """Deliver the launch spec, the run key and the worker service (ssh, clouds); the lab
    runs its workers from `geotrain train` instead."""
    lan_interface: str | None = None
    """Interface for the private address when the backend knows it (the lab: eth0)."""


ROLES = {
    "ssh": HostRole(),
    "aws": HostRole(),
    "gcp": HostRole(),
    "alicloud": HostRole(),
    "lab": HostRole(training=False, lan_interface="eth0"),
}
"""Pool kinds whose hosts run the agent, and what they want of it (the lab's hosts get
the network, firewall and monitoring parts; its workers run from `geotrain train`)."""


def role_for(kind: str) -> HostRole | None:
    """The agent's role on hosts of `kind`; None where no agent runs (local, kubernetes)."""
    return ROLES.get(kind)


def render_host(plan: Plan, node: PlanNode, role: HostRole) -> tuple[HostSpec, dict[str, str]]:
    """(host.json, bundle files) of `node`."""
    region = plan.region(node.region)
    files: dict[str, str] = {"firewall.nft": render_firewall(plan, node)}
    file_specs = [FileSpec("firewall.nft", FIREWALL_PATH, "0640")]
    units = [UnitSpec(FIREWALL_UNIT, "systemd/" + FIREWALL_UNIT, restart_on=("firewall.nft",))]
    files["systemd/" + FIREWALL_UNIT] = render_firewall_unit()
    packages = list(BASE_PACKAGES)
    dirs = [DirSpec(ETC, "root", SERVICE_USER, "0750")]
    tunnels: list[TunnelSpec] = []
    frr = None
    sysctl_src = None
    if node.is_gateway:
        packages += GATEWAY_PACKAGES
        for t in plan.tunnels_of(region.name):
            end = t.side(region.name)
            src = f"wireguard/{end.ifname}.conf"
            files[src] = render_wireguard(plan, region.name, t)
            tunnels.append(TunnelSpec(end.ifname, src, plan.region(end.peer).gateway.name))
        files["frr/frr.conf"] = render_frr(plan, region.name)
        frr = FrrSpec("frr/frr.conf", dict(FRR_DAEMONS))
        files["sysctl.d/90-geotrain.conf"] = render_sysctl()
        sysctl_src = "sysctl.d/90-geotrain.conf"
    mon_files, mon_units, repos, secrets, mon_dirs = _monitoring(plan, node)
    files.update({f.artifact: f.content for f in mon_files})
    file_specs += [
        FileSpec(f.artifact, str(f.host_path), "0644", *f.owner.split(":")) for f in mon_files
    ]
    units += mon_units
    dirs += mon_dirs
    packages += [p for s in host_services_of(plan, node) for p in s.packages]
    run_key_path = None
    if role.training:
        spec = render_launch_spec(plan)
        run_key_path = host_key_path(spec.key_file)
        spec = replace(spec, key_file=run_key_path)  # the workers read it where it is written
        files["launch-spec.json"] = spec.to_json()
        file_specs.append(
            FileSpec("launch-spec.json", REMOTE_SPEC_PATH, "0640", "root", SERVICE_USER)
        )
        files["systemd/" + WORKER_UNIT] = render_worker_unit(plan, node)
        ckpt = on_host(spec.checkpoint.dir)
        dirs += [
            DirSpec(REMOTE_STATE_DIR, SERVICE_USER, SERVICE_USER, "0750"),
            DirSpec(REMOTE_RUN_DIR, SERVICE_USER, SERVICE_USER, "0750"),
            DirSpec(  # this node's root: {node} and {region} filled in
                str(node_root(ckpt, plan.stack, node.name, node.region)),
                SERVICE_USER,
                SERVICE_USER,
                "0750",
                keep_on_remove=plan.training.checkpoint.keep_on_destroy,
                adopt=False,
            ),
        ]
        units.append(
            UnitSpec(
                WORKER_UNIT,
                "systemd/" + WORKER_UNIT,
                restart_on=("launch-spec.json", "run-key", "runtime", "systemd/" + WORKER_UNIT),
                run_once=True,
            )
        )
    host = HostSpec(
        stack=plan.stack,
        node=node.name,
        region=node.region,
        run_id=plan.run_id,
        packages=tuple(dict.fromkeys(packages)),
        service_user=SERVICE_USER,
        dirs=tuple(dirs),
        files=tuple(file_specs),
        sysctl_src=sysctl_src,
        addresses=(
            AddressSpec(
                f"{node.private_ip}/{_prefixlen(region.subnet)}",
                interface=role.lan_interface or node.interface,
                near=None if node.address.startswith("127.") else node.address,
            ),
        ),
        repos=repos,
        secret_files=secrets,
        routes=()
        if node.is_gateway
        else (RouteSpec(str(plan.network.overlay_cidr), region.gateway.private_ip),),
        tunnels=tuple(tunnels),
        frr=frr,
        units=tuple(units),
        run_key_path=run_key_path,
        mirrors=_mirrors(region.pool.mirrors),
    )
    return host, files


def host_key_path(key_file: str) -> str:
    """Where a host keeps the run key: an absolute training.key_file as it is, a relative
    one in /etc/geotrain (root's; the workers' group reads it), never in the workers' own
    working dir, where the worker user could swap the directory the agent writes it in."""
    return key_file if key_file.startswith("/") else RUN_KEY_PATH


def _mirrors(m: PoolMirrors) -> Mirrors | None:
    """The pool's package mirrors as the agent reads them (None: the public indexes)."""
    if m.pip_index_url is None and m.torch_index_url is None:
        return None
    return Mirrors(pip_index_url=m.pip_index_url, torch_index_url=m.torch_index_url)


def on_host(path: str) -> str:
    """A spec path as the workers see it: relative paths resolve in their working dir."""
    return path if path.startswith("/") else f"{REMOTE_STATE_DIR}/{path}"


def _prefixlen(cidr: str) -> int:
    return int(cidr.split("/")[1])


def render_firewall(plan: Plan, node: PlanNode) -> str:
    """nftables table `inet geotrain` of one host: inbound is dropped unless it is
    - loopback, a reply, ICMP (ping, path MTU);
    - from the overlay (region subnets + tunnel nets): rendezvous, gloo's ephemeral ports,
      metrics and exporters, BGP and BFD over the tunnels;
    - TCP from the region's own hosts' underlay addresses (`_region_peers`): NCCL, and
      gloo under GLOO_SOCKET_IFNAME, advertise the *first* address of the interface they
      are told to use (training/comm/iface.py), which on an SSH host is its LAN address,
      not the region-subnet address the agent adds beside it;
    - SSH (and on the monitoring host its UIs) from network.admin_cidrs;
    - WireGuard UDP on the tunnel ports from the peer gateways' underlay addresses.
    Gateways forward only overlay to overlay. One table, replaced atomically (the
    `table` + `delete table` idiom), so an apply never leaves a half-loaded ruleset."""
    net = plan.network
    overlay = str(net.overlay_cidr)
    admin = ", ".join(str(c) for c in net.admin_cidrs)
    lines = [
        f"# geotrain {plan.stack}: firewall of {node.name} ({node.region}); rendered, do not edit",
        "table inet geotrain",
        "delete table inet geotrain",
        "table inet geotrain {",
        f"  set overlay {{ type ipv4_addr; flags interval; elements = {{ {overlay} }} }}",
    ]
    if admin:
        lines.append(f"  set admin {{ type ipv4_addr; flags interval; elements = {{ {admin} }} }}")
    peers = []
    ports = []
    if node.is_gateway:
        for t in plan.tunnels_of(node.region):
            end = t.side(node.region)
            peer_gw = plan.region(end.peer).gateway.name
            peers.append(underlay_of(plan, peer_gw, end.peer_underlay))
            ports.append(str(end.port))
    lines += [
        "  chain input {",
        "    type filter hook input priority filter; policy drop;",
        '    iif "lo" accept',
        "    ct state established,related accept",
        "    ct state invalid drop",
        "    meta l4proto { icmp, ipv6-icmp } accept",
        "    ip saddr @overlay accept",
    ]
    region_peers = _region_peers(plan, node)
    if region_peers:
        lines.insert(5, f"  set region {{ type ipv4_addr; elements = {{ {region_peers} }} }}")
        lines.append("    meta l4proto tcp ip saddr @region accept")
    if admin:  # the pool's SSH port: the operator's next `pulumi up` comes in on it
        ssh_port = plan.region(node.region).pool.ssh.port
        lines.append(f"    tcp dport {ssh_port} ip saddr @admin accept")
        ui = [
            port
            for s in host_services_of(plan, node)
            for port in s.ports
            if s.unit != "prometheus-node-exporter.service"
            and s.unit != "nvidia-dcgm-exporter.service"
        ]
        if ui:
            listed = ", ".join(str(p) for p in ui)
            lines.append(f"    tcp dport {{ {listed} }} ip saddr @admin accept")
    if peers:
        lines.append(
            f"    udp dport {{ {', '.join(sorted(set(ports)))} }} "
            f"ip saddr {{ {', '.join(sorted(set(peers)))} }} accept"
        )
    lines.append("  }")
    if node.is_gateway:
        lines += [
            "  chain forward {",
            "    type filter hook forward priority filter; policy drop;",
            "    ct state established,related accept",
            "    ip saddr @overlay ip daddr @overlay accept",
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _region_peers(plan: Plan, node: PlanNode) -> str:
    """The underlay addresses of `node`'s region's other hosts, as an nft element list
    ('' when there are none to admit). Only literal addresses: a cloud node's underlay is
    its public IP, filled in at deploy time, while its VPC address, the one its NICs
    carry first, is already in the region subnet and so in @overlay."""
    out = []
    for n in plan.region(node.region).nodes:
        if n.name == node.name:
            continue
        try:
            ip = ipaddress.IPv4Address(n.address)
        except ValueError:
            continue
        if not ip.is_loopback:
            out.append(str(ip))
    return ", ".join(sorted(set(out), key=ipaddress.IPv4Address))


def render_firewall_unit() -> str:
    return (
        "[Unit]\n"
        "Description=geotrain firewall (nftables table inet geotrain)\n"
        "Wants=network-pre.target\n"
        "Before=network-pre.target\n"
        "\n[Service]\n"
        "Type=oneshot\n"
        "RemainAfterExit=yes\n"
        f"ExecStart=/usr/sbin/nft -f {FIREWALL_PATH}\n"
        "ExecStop=/usr/sbin/nft delete table inet geotrain\n"
        "\n[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def host_services_of(plan: Plan, node: PlanNode) -> list[HostService]:
    """The monitoring services this node runs (Grafana only when the stack wants it)."""
    return [
        s
        for s in host_services(plan, node)
        if plan.monitoring.grafana or s.unit != "grafana-server.service"
    ]


def _monitoring(
    plan: Plan, node: PlanNode
) -> tuple[
    list[MonitoringFile],
    list[UnitSpec],
    tuple[RepoSpec, ...],
    tuple[SecretFileSpec, ...],
    list[DirSpec],
]:
    """Files, units, repositories, secrets and directories of the node's monitoring
    services (prometheus, alertmanager, grafana on the monitoring host; node-exporter and
    dcgm-exporter everywhere they apply)."""
    services = host_services_of(plan, node)
    names = {s.unit for s in services}
    grafana = "grafana-server.service" in names
    files = [
        f
        for f in monitoring_files(plan)
        if f.node == node.name
        and f.host_path is not None
        and (f.unit in names or (f.unit is None and grafana))
    ]
    units = [
        UnitSpec(
            s.unit,
            restart_on=tuple(f.artifact for f in files if f.unit == s.unit),
            check=s.check,
        )
        for s in services
    ]
    repos = tuple(
        RepoSpec(s.repo.name, s.repo.line, s.repo.key_url) for s in services if s.repo is not None
    )
    secrets: tuple[SecretFileSpec, ...] = ()
    dirs: list[DirSpec] = []
    if node.name == plan.monitoring_host.name and services:
        wanted = [f for f in secret_files(plan) if grafana or "/grafana/" not in f.path]
        secrets = tuple(
            SecretFileSpec(
                f.path, f.owner.split(":")[0], f.owner.split(":")[-1], config_key=f.config_key
            )
            for f in wanted
        )
        for d in sorted({str(Path(f.path).parent) for f in wanted}):
            group = "grafana" if "/grafana/" in d else "prometheus"
            dirs.append(DirSpec(d, "root", group, "0750"))
        if grafana:
            dirs.append(DirSpec(GRAFANA_DASHBOARDS, "root", "grafana", "0755"))
    return files, units, repos, secrets, dirs


def monitoring_urls(plan: Plan) -> tuple[str, str]:
    """(Prometheus, Grafana) that the stack runs on its monitoring host, '' for none: a
    Kubernetes stack's monitoring is each cluster's kube-prometheus-stack, not ours."""
    host = plan.monitoring_host
    if role_for(host.kind) is None and host.kind != "local":
        return "", ""
    mon = plan.monitoring
    grafana = any(s.unit == "grafana-server.service" for s in host_services_of(plan, host))
    return (
        f"http://{host.private_ip}:{mon.prometheus_port}",
        f"http://{host.private_ip}:{mon.grafana_port}" if grafana else "",
    )
