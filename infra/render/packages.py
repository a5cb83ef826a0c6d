"""What each host installs and runs for monitoring, as data for the host agent
(`geotrain node apply`): apt repositories, packages, systemd units, ports and the command
that checks a config before a restart. Pure: no I/O. The files themselves, with their host
paths, come from `infra.render.monitoring.monitoring_files`; secrets from `secret_files`.

Where the packages come from (checked against the vendors' published docs and packaging,
not on a real GPU host):
- Debian and Ubuntu archives: prometheus (with promtool), prometheus-alertmanager (with
  amtool), prometheus-node-exporter. Debian 12 ships Alertmanager 0.25: the rendered config
  uses only *_file fields that 0.25 reads (no webhook url_file).
- Grafana is not in Debian: Grafana Labs' apt repository, package `grafana`, unit
  `grafana-server.service`.
- dcgm-exporter is not in Debian or Ubuntu. NVIDIA builds it as a container image
  (nvcr.io/nvidia/k8s/dcgm-exporter), a Helm chart, and, with DCGM 4, host packages in its
  CUDA network repository: `datacenter-gpu-manager-exporter` installs /usr/bin/dcgm-exporter
  and `nvidia-dcgm-exporter.service` (default listen :9400), paired with DCGM
  (`datacenter-gpu-manager-4-cuda<major>`). That route is the default here (no container
  runtime needed); `geotrain:monitoring.gpu_metrics: runtime` needs nothing installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.plan import Plan, PlanNode


@dataclass(frozen=True)
class AptRepo:
    name: str
    """Stem of /etc/apt/sources.list.d/<name>.list and of its keyring."""
    line: str
    """sources.list line; NVIDIA's holds `{distro}` (debian12, ubuntu2204, ubuntu2404) and
    `{arch}` (x86_64, sbsa) for the agent to fill in from /etc/os-release and uname -m."""
    key_url: str
    """Signing key (ASCII armoured): fetch, `gpg --dearmor` into `keyring`."""

    @property
    def keyring(self) -> str:
        return f"/etc/apt/keyrings/{self.name}.gpg"

    def sources_line(self, distro: str = "", arch: str = "") -> str:
        return self.line.format(distro=distro, arch=arch, keyring=self.keyring)


GRAFANA_REPO = AptRepo(
    "grafana",
    "deb [signed-by={keyring}] https://apt.grafana.com stable main",
    "https://apt.grafana.com/gpg.key",
)
NVIDIA_CUDA_REPO = AptRepo(
    "nvidia-cuda",
    "deb [signed-by={keyring}] https://developer.download.nvidia.com/compute/cuda/repos/"
    "{distro}/{arch}/ /",
    "https://developer.download.nvidia.com/compute/cuda/repos/{distro}/{arch}/3bf863cc.pub",
)


@dataclass(frozen=True)
class HostService:
    name: str
    """What it is (for logs)."""
    packages: tuple[str, ...]
    """apt packages; `{cuda}` is the driver's CUDA major (12, 13: from nvidia-smi)."""
    unit: str
    """systemd unit to enable, start, and restart when its files change."""
    repo: AptRepo | None
    """Repository to add first; None: the distribution's own archive."""
    ports: tuple[int, ...]
    """TCP ports it listens on (the node's private address): open them to the monitoring
    host on the overlay, nowhere else."""
    check: str | None = None
    """Command that must pass before a restart with new files."""


def host_services(plan: Plan, node: PlanNode) -> list[HostService]:
    """Monitoring services of one ssh node. Local and lab stacks install nothing (the CLI
    starts Prometheus itself when it is installed)."""
    mon = plan.monitoring
    if not mon.enabled or node.kind != "ssh":
        return []
    out = []
    if node.name == plan.monitoring_host.name:
        out += [
            HostService(
                "Prometheus",
                ("prometheus",),
                "prometheus.service",
                None,
                (mon.prometheus_port,),
                "promtool check config /etc/prometheus/prometheus.yml",
            ),
            HostService(
                "Alertmanager",
                ("prometheus-alertmanager",),
                "prometheus-alertmanager.service",
                None,
                (mon.alertmanager_port,),
                "amtool check-config /etc/prometheus/alertmanager.yml",
            ),
            HostService(
                "Grafana", ("grafana",), "grafana-server.service", GRAFANA_REPO, (mon.grafana_port,)
            ),
        ]
    out.append(
        HostService(
            "node-exporter",
            ("prometheus-node-exporter",),
            "prometheus-node-exporter.service",
            None,
            (mon.node_exporter_port,),
        )
    )
    if node.device == "cuda" and mon.gpu_metrics == "dcgm-exporter":
        out.append(
            HostService(
                "dcgm-exporter",
                ("datacenter-gpu-manager-4-cuda{cuda}", "datacenter-gpu-manager-exporter"),
                "nvidia-dcgm-exporter.service",
                NVIDIA_CUDA_REPO,
                (mon.dcgm_exporter_port,),
            )
        )
    return out
