"""Monitoring: the monitoring host, exporter and service ports, the bind address, alert
receivers and the SMTP relay."""

from __future__ import annotations

import re

from infra.model.checks import fault_tolerance
from infra.model.checks.common import err
from infra.model.schema import StackModel


def check(m: StackModel, source: str) -> None:
    mon = m.monitoring
    nodes = [n.name for r in m.regions for n in r.pool.nodes]
    if mon.host is not None and mon.host not in nodes:
        raise err(
            source,
            "monitoring.host",
            f"'{mon.host}' is not a node of this stack; use one of {', '.join(nodes)}",
        )
    most = max(n.gpus for r in m.regions for n in r.pool.nodes)
    if 0 < mon.metrics_port < 1024:
        raise err(
            source,
            "monitoring.metrics_port",
            f"{mon.metrics_port} is a privileged "
            "port; use 1024-65000, or 0 to turn runtime metrics off",
        )
    span = range(mon.metrics_port, mon.metrics_port + most) if mon.metrics_port else range(0)
    taken: dict[int, str] = {}
    for key in (
        "node_exporter_port",
        "dcgm_exporter_port",
        "prometheus_port",
        "alertmanager_port",
        "grafana_port",
    ):
        port = getattr(mon, key)
        if port in span:
            raise err(
                source,
                f"monitoring.{key}",
                f"{port} collides with the "
                f"runtime metrics ports {span.start}-{span.stop - 1}; move one of them",
            )
        if port in taken:
            raise err(
                source,
                f"monitoring.{key}",
                f"{port} is also monitoring.{taken[port]}; give every service its own port",
            )
        taken[port] = key
    rdzv = m.training.rendezvous_port
    if mon.enabled and rdzv in taken:  # the exporters run on every node, rank 0's too
        raise err(
            source,
            "training.rendezvous_port",
            f"{rdzv} is also monitoring.{taken[rdzv]} (on the nodes it runs on, rank 0's "
            "among them); give the rendezvous its own port, e.g. 29500",
        )
    fault_tolerance.quorum_ports(m, span, source)
    if mon.bind_address != "private":
        import ipaddress

        try:
            addr = ipaddress.IPv4Address(mon.bind_address)
        except ValueError:
            raise err(
                source,
                "monitoring.bind_address",
                f"'{mon.bind_address}' is neither 'private' nor an IPv4 address",
            ) from None
        hosts = [n for r in m.regions if r.pool.kind != "local" for n in r.pool.nodes]
        if len(hosts) > 1 and not addr.is_unspecified:  # 0.0.0.0: every host's own (policy)
            why = (
                "a loopback address, which Prometheus on the monitoring host cannot scrape"
                if addr.is_loopback
                else f"one address, which {len(hosts)} hosts cannot share"
            )
            raise err(
                source,
                "monitoring.bind_address",
                f"{mon.bind_address} would be every host's metrics address: {why}; leave "
                "'private' (each host's own private address)",
            )
    _alert_receivers(m, source)


def _alert_receivers(m: StackModel, source: str) -> None:
    """Each receiver names exactly one destination; email needs the SMTP relay."""
    seen: set[str] = set()
    for i, r in enumerate(m.monitoring.receivers):
        path = f"monitoring.receivers[{i}]"
        if r.name in seen or r.name == "null":
            raise err(
                source,
                f"{path}.name",
                f"receiver name '{r.name}' is used twice or reserved ('null'); "
                "give every receiver its own name",
            )
        seen.add(r.name)
        targets = [k for k in ("webhook_url", "slack_url_config", "email") if getattr(r, k)]
        if len(targets) != 1:
            raise err(
                source,
                path,
                f"receiver '{r.name}' sets {targets or 'no destination'}; "
                "set exactly one of webhook_url, slack_url_config, email",
            )
        if r.webhook_token_config and not r.webhook_url:
            raise err(
                source,
                f"{path}.webhook_token_config",
                "a webhook token needs webhook_url; set it or drop the token",
            )
        if r.webhook_url:
            from urllib.parse import urlsplit

            u = urlsplit(r.webhook_url)
            if u.scheme not in ("https", "http") or not u.hostname:
                raise err(
                    source,
                    f"{path}.webhook_url",
                    f"'{r.webhook_url}' is not an http(s) URL with a host",
                )
            if u.username or u.password:
                raise err(
                    source,
                    f"{path}.webhook_url",
                    "the URL carries credentials, which would sit in the rendered config; "
                    "put the token in webhook_token_config (a secret)",
                )
        if r.email and not EMAIL.fullmatch(r.email):
            raise err(source, f"{path}.email", f"'{r.email}' is not an e-mail address")
        if r.email and m.monitoring.smtp is None:
            raise err(
                source,
                f"{path}.email",
                "email receivers need geotrain:monitoring.smtp (smarthost, sender)",
            )
        if not r.severities:
            raise err(
                source,
                f"{path}.severities",
                "no severities: the receiver would get nothing; use critical and/or warning",
            )
    smtp = m.monitoring.smtp
    if smtp is not None:
        host, _, port = smtp.smarthost.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise err(
                source,
                "monitoring.smtp.smarthost",
                f"'{smtp.smarthost}' is not host:port (Alertmanager needs the port), e.g. "
                "smtp.example.org:587",
            )
        if not EMAIL.fullmatch(smtp.sender):
            raise err(source, "monitoring.smtp.sender", f"'{smtp.sender}' is not an e-mail address")


EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
"""An address Alertmanager can send to or from: local part, @, a dotted domain."""
