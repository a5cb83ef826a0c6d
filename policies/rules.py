"""The geotrain guardrails, one validate function per rule, each wrapped in the policy
SDK's own types. Rules read the `facts` every geotrain component registers (infra.facts)
and Kubernetes objects' own fields, so they judge exactly what `pulumi up` would create.

Messages: `[rule] <resource>: <what> (<value>); <fix>`. Numbers may arrive as floats
(the engine's JSON), so comparisons convert.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    Severity,
    StackValidationArgs,
    StackValidationPolicy,
)

from infra import tokens
from infra.guardrails import (
    GPU_LIST_PRICES,
    POLICY_DEFAULTS,
    instance_type_gpus,
    reachable,
    taggable_types,
)

Report = Callable[[str, str | None], None]
POOL, OVERLAY, ROUTING = tokens.POOL, tokens.OVERLAY, tokens.ROUTING
MONITORING, TRAINING = tokens.MONITORING, tokens.TRAINING
ALLOWED_FLOWS = {"gradients", "pseudo-gradients"}


def config_from_policy_settings(p: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Pack config (policy name -> config) from a stack's `geotrain:policy` settings (a
    full dump of infra.model.schema.Policy: its defaults are the pack's defaults)."""
    return {
        "data-residency": {},
        "encryption-in-transit": {"requiredFor": list(p["encryption_required_for"])},
        "no-public-exposure": {},
        "allowed-gpu-types-and-regions": {
            "allowedGpuTypes": p["allowed_gpu_types"],
            "allowedRegions": p["allowed_regions"],
        },
        "budget-cap": {
            "maxGpus": p["max_gpus"],
            "maxUsdPerHour": p["max_usd_per_hour"],
            "gpuPrices": dict(p["gpu_prices"] or {}),
        },
        "checkpoint-cadence": {
            "maxIntervalMinutes": p["max_checkpoint_interval_minutes"],
            "minKeep": p["min_checkpoint_keep"],
        },
        "required-tags": {"tags": list(p["required_tags"])},
        "network-integrity": {},
        "admin-ssh-only": {},
        "dp-required": {
            "requiredFor": list(p["dp_required_for"]),
            "maxEpsilon": p["max_dp_epsilon"],
        },
    }


DEFAULTS: dict[str, dict[str, Any]] = config_from_policy_settings(POLICY_DEFAULTS)
"""Used where the pack gets no config: the stack model's policy defaults, in one place."""


def _cfg(name: str, args: Any) -> dict[str, Any]:
    return {
        **DEFAULTS[name],
        **{k: v for k, v in (args.get_config() or {}).items() if v is not None},
    }


def _facts(args: ResourceValidationArgs, token: str) -> dict[str, Any] | None:
    return args.props.get("facts") if args.resource_type == token else None


def _where(args: Any) -> str:
    return f"{args.resource_type} '{args.name}'"


# -- data residency -------------------------------------------------------------------
def data_residency(args: ResourceValidationArgs, report: Report) -> None:
    f = _facts(args, TRAINING)
    if f:
        for s in f["shards"]:
            where = f["regions"].get(s["region"])
            if where != s["jurisdiction"]:
                ok = [r for r, j in f["regions"].items() if j == s["jurisdiction"]]
                report(
                    f"[data-residency] {_where(args)}: shard '{s['name']}' holds "
                    f"{s['jurisdiction']} data but is read in {s['region']} ({where}); "
                    f"place it in {' or '.join(ok) or 'a region of ' + s['jurisdiction']}",
                    None,
                )
        for flow in set(f["cross_region_flows"]) - ALLOWED_FLOWS:
            report(
                f"[data-residency] {_where(args)}: '{flow}' would cross borders; only "
                "gradients or pseudo-gradients may",
                None,
            )
    labels = (args.props.get("metadata") or {}).get("labels") or {}
    data_j, region_j = (
        labels.get("geotrain.io/data-jurisdiction"),
        labels.get("geotrain.io/jurisdiction"),
    )
    if data_j and region_j and data_j != region_j:
        report(
            f"[data-residency] {_where(args)}: holds {data_j} data in a {region_j} "
            f"region; keep raw data in a {data_j} region",
            None,
        )


# -- encryption in transit ------------------------------------------------------------
def encryption_in_transit(args: ResourceValidationArgs, report: Report) -> None:
    cfg = _cfg("encryption-in-transit", args)
    f = _facts(args, OVERLAY)
    if f:
        for link in f["links"]:
            if link["transport"] not in ("wireguard", "loopback"):
                report(
                    f"[encryption-in-transit] {_where(args)}: link {link['a']}-"
                    f"{link['b']} uses '{link['transport']}'; carry it on the WireGuard "
                    "overlay",
                    None,
                )
    f = _facts(args, TRAINING)
    if f:
        need = sorted({j for j in f["regions"].values() if j in cfg["requiredFor"]})
        if need and f["cipher"] != "sm4-gcm":
            report(
                f"[encryption-in-transit] {_where(args)}: payload cipher is "
                f"'{f['cipher']}' but {', '.join(need)} requires sm4-gcm; set "
                "geotrain:training.compression.cipher: sm4-gcm",
                None,
            )
        elif f["cipher"] == "none" and len(f["regions"]) > 1:
            report(
                f"[encryption-in-transit] {_where(args)}: payload cipher is 'none'; "
                "cross-region gradients must be encrypted (sm4-gcm or aes-gcm)",
                None,
            )


# -- differential privacy ------------------------------------------------------------
def dp_required(args: ResourceValidationArgs, report: Report) -> None:
    f = _facts(args, TRAINING)
    if not f:
        return
    cfg = _cfg("dp-required", args)
    privacy = f.get("privacy") or {}
    for region, j in f["regions"].items():
        p = privacy.get(region)
        if p is None and j in cfg["requiredFor"]:
            report(
                f"[dp-required] {_where(args)}: region {region} ({j}) trains without "
                f"differential privacy but {j} requires it; set privacy: {{target_epsilon: "
                "...}} on that region in geotrain:regions",
                None,
            )
        elif p is not None and _over(p["target_epsilon"], cfg["maxEpsilon"]):
            report(
                f"[dp-required] {_where(args)}: region {region} targets epsilon "
                f"{float(p['target_epsilon']):g}, above the cap {float(cfg['maxEpsilon']):g}; "
                "lower its privacy.target_epsilon",
                None,
            )


def _over(value: Any, cap: Any) -> bool:
    return cap is not None and float(value) > float(cap)


# -- no public exposure ---------------------------------------------------------------
CLUSTER_DNS = ".svc.cluster.local"
"""A pod's name under its headless Service resolves to its pod IP: the cluster network."""


def _public(addr: str) -> str | None:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if addr.endswith(CLUSTER_DNS):
            return None
        return f"'{addr}' is not an IP address"
    if ip.is_unspecified:
        return f"{addr} binds every interface, public ones included"
    if not (ip.is_private or ip.is_loopback):
        return f"{addr} is a public address"
    return None


def no_public_exposure(args: ResourceValidationArgs, report: Report) -> None:
    f = args.props.get("facts") if args.resource_type in (MONITORING, TRAINING) else None
    for e in (f or {}).get("endpoints", []):
        why = _public(str(e["bind"]))
        if why:
            node = f" on {e['node']}" if e.get("node") else ""
            report(
                f"[no-public-exposure] {_where(args)}: {e['service']}{node} port "
                f"{int(e['port'])}: {why}; bind it to a private or overlay address "
                "(geotrain:monitoring.bind_address: private)",
                None,
            )
    if args.resource_type == "kubernetes:core/v1:Service":
        spec = args.props.get("spec") or {}
        kind = spec.get("type", "ClusterIP")
        if kind in ("LoadBalancer", "NodePort") and not spec.get("loadBalancerSourceRanges"):
            report(
                f"[no-public-exposure] {_where(args)}: type {kind} without "
                "loadBalancerSourceRanges exposes it; use ClusterIP or add an allow-list",
                None,
            )
    for rule in ingress_rules(args.resource_type, args.props):
        why = _open(rule)
        if why:
            report(
                f"[no-public-exposure] {_where(args)}: admits {_describe(rule)}: {why}; from "
                "the internet open only WireGuard (udp, its port) to each peer gateway's /32 "
                "and SSH (tcp 22) to geotrain:network.admin_cidrs",
                None,
            )


# cloud firewalls, as (protocol, (first, last) port or None for all, source) per source
Ingress = tuple[str, tuple[int, int] | None, str]
EVERYWHERE = ("0.0.0.0/0", "::/0")
PRIVATE = [
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
]
"""Sources that are not the internet: RFC 1918 and carrier-grade NAT (RFC 6598)."""


def ingress_rules(type_: str, props: Mapping[str, Any]) -> list[Ingress]:
    """The inbound allowances of a cloud firewall resource (AWS security groups and their
    rules, GCP firewalls, Alibaba security group rules), from its inputs; [] for others.
    Values still unknown (a peer's address during a preview) are skipped."""
    out: list[Ingress] = []

    def add(proto: Any, ports: tuple[int, int] | None, sources: Any) -> None:
        proto = "all" if str(proto) in ("-1", "all") else str(proto).lower()
        for src in sources or []:
            if isinstance(src, str) and src:
                out.append((proto, None if proto == "all" else ports, src))

    def span(a: Any, b: Any) -> tuple[int, int] | None:
        return None if a is None or int(a) < 0 else (int(a), int(b if b is not None else a))

    if type_ == "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule":
        add(
            props.get("ipProtocol"),
            span(props.get("fromPort"), props.get("toPort")),
            [props.get("cidrIpv4"), props.get("cidrIpv6")],
        )
    elif type_ == "aws:ec2/securityGroupRule:SecurityGroupRule" and props.get("type") == "ingress":
        add(
            props.get("protocol"),
            span(props.get("fromPort"), props.get("toPort")),
            [*(props.get("cidrBlocks") or []), *(props.get("ipv6CidrBlocks") or [])],
        )
    elif type_ == "aws:ec2/securityGroup:SecurityGroup":
        for r in props.get("ingress") or []:
            add(
                r.get("protocol"),
                span(r.get("fromPort"), r.get("toPort")),
                [*(r.get("cidrBlocks") or []), *(r.get("ipv6CidrBlocks") or [])],
            )
    elif (
        type_ == "gcp:compute/firewall:Firewall" and props.get("direction", "INGRESS") == "INGRESS"
    ):
        for a in props.get("allows") or []:
            for p in a.get("ports") or [None]:
                lo, _, hi = str(p).partition("-") if p is not None else ("", "", "")
                add(
                    a.get("protocol"),
                    span(lo, hi or lo) if p is not None else None,
                    props.get("sourceRanges"),
                )
    elif (
        type_ == "alicloud:ecs/securityGroupRule:SecurityGroupRule"
        and props.get("type") == "ingress"
    ):
        lo, _, hi = str(props.get("portRange") or "-1/-1").partition("/")
        add(props.get("ipProtocol"), span(lo, hi), [props.get("cidrIp"), props.get("ipv6CidrIp")])
    return out


def is_internet(src: str) -> bool:
    """A source outside the private ranges (an unparsable one counts as the internet)."""
    try:
        net = ipaddress.ip_network(src, strict=False)
    except ValueError:
        return True
    return not any(net.version == p.version and net.subnet_of(p) for p in PRIVATE)  # type: ignore[arg-type]


def _open(rule: Ingress) -> str | None:
    """Why an inbound allowance exposes hosts to the internet, or None."""
    proto, ports, src = rule
    if src in EVERYWHERE:
        return f"open to the whole internet ({src})"
    if not is_internet(src):
        return None
    if proto == "tcp" and ports == (22, 22):
        return None  # SSH; that it comes from admin_cidrs is the admin-ssh-only rule's
    if proto == "udp" and ports and ports[0] == ports[1] and src.endswith("/32"):
        return None  # one WireGuard port to one peer gateway
    return "only WireGuard from one peer (udp, one port, a /32) may come from the internet"


def _describe(rule: Ingress) -> str:
    proto, ports, src = rule
    if proto == "all":
        return f"every protocol and port from {src}"
    where = "every port" if ports is None else f"port {ports[0]}"
    if ports and ports[1] != ports[0]:
        where += f"-{ports[1]}"
    return f"{proto} {where} from {src}"


# -- allowed GPU types and regions ----------------------------------------------------
INSTANCE_TYPE_INPUTS = {
    "aws:ec2/instance:Instance": "instanceType",
    "alicloud:ecs/instance:Instance": "instanceType",
    "gcp:compute/instance:Instance": "machineType",
}
"""Cloud instance resources -> the input that names their instance type."""


def allowed_gpu_types_and_regions(args: ResourceValidationArgs, report: Report) -> None:
    cfg = _cfg("allowed-gpu-types-and-regions", args)
    if args.resource_type in INSTANCE_TYPE_INPUTS:
        _instance_type(args, cfg["allowedGpuTypes"], report)
    f = _facts(args, POOL)
    if not f:
        return
    regions, gpus = cfg["allowedRegions"], cfg["allowedGpuTypes"]
    if regions is not None and f["region"] not in regions:
        report(
            f"[allowed-gpu-types-and-regions] {_where(args)}: region '{f['region']}' is "
            f"not allowed; use one of {', '.join(regions)}",
            None,
        )
    for n in f["nodes"]:
        if gpus is not None and n["gpu_type"] not in gpus:
            report(
                f"[allowed-gpu-types-and-regions] {_where(args)}: node {n['name']} uses "
                f"{n['gpu_type']}; allowed: {', '.join(gpus)}",
                None,
            )


def _instance_type(args: ResourceValidationArgs, allowed: list[str] | None, report: Report) -> None:
    """A cloud instance, judged by what it is: its type's GPUs (infra/model/clouds.py)."""
    name = args.props.get(INSTANCE_TYPE_INPUTS[args.resource_type])
    if not isinstance(name, str):
        return  # unknown during a preview
    gpus = instance_type_gpus(name.rsplit("/", 1)[-1])
    if gpus is None:
        report(
            f"[allowed-gpu-types-and-regions] {_where(args)}: instance type {name} is not in "
            "geotrain's instance table (infra/model/clouds.py); use a stack's gpu_type instead",
            None,
        )
    elif allowed is not None and gpus[0] not in allowed:
        report(
            f"[allowed-gpu-types-and-regions] {_where(args)}: {name} carries {gpus[1]} x "
            f"{gpus[0]}; allowed: {', '.join(allowed)}",
            None,
        )


# -- budget ---------------------------------------------------------------------------
def budget_cap(args: StackValidationArgs, report: Report) -> None:
    cfg = _cfg("budget-cap", args)
    prices = GPU_LIST_PRICES | dict(cfg["gpuPrices"])
    nodes = [
        n for r in args.resources if r.resource_type == POOL for n in r.props["facts"]["nodes"]
    ]
    count = sum(int(n["gpus"]) for n in nodes if n["gpu_type"] != "cpu")
    cost = sum(_node_price(n, prices, cfg["gpuPrices"]) for n in nodes)
    if cfg["maxGpus"] is not None and count > cfg["maxGpus"]:
        report(
            f"[budget-cap] stack: {count} GPUs exceed the cap of {int(cfg['maxGpus'])}; "
            "remove nodes or raise maxGpus",
            None,
        )
    if cfg["maxUsdPerHour"] is not None and cost > cfg["maxUsdPerHour"]:
        report(
            f"[budget-cap] stack: estimated ${cost:,.2f}/hour exceeds the cap of "
            f"${float(cfg['maxUsdPerHour']):,.2f}/hour; use fewer or cheaper GPUs",
            None,
        )


def _node_price(
    n: Mapping[str, Any], prices: Mapping[str, float], override: Mapping[str, Any]
) -> float:
    """USD/hour of a node: a gpu_prices override of its GPU type, else its cloud instance's
    list price in its cloud region (infra/model/clouds.py: on-demand, also for spot, so the
    cap holds whatever spot costs), else its GPUs at the GPU table's price."""
    gpus, gpu = int(n["gpus"]), n["gpu_type"]
    if gpu not in override and n.get("usd_per_hour") is not None:
        return float(n["usd_per_hour"])
    return gpus * float(prices.get(gpu, 0.0))


# -- checkpoints ----------------------------------------------------------------------
def checkpoint_cadence(args: ResourceValidationArgs, report: Report) -> None:
    f = _facts(args, TRAINING)
    if not f:
        return
    cfg = _cfg("checkpoint-cadence", args)
    every, keep = float(f["checkpoint"]["interval_minutes"]), int(f["checkpoint"]["keep"])
    if every > cfg["maxIntervalMinutes"]:
        report(
            f"[checkpoint-cadence] {_where(args)}: checkpoints every {every:g} minutes; "
            f"at most {cfg['maxIntervalMinutes']:g} (a failure loses up to one interval); "
            "lower geotrain:training.checkpoint.interval_minutes",
            None,
        )
    if keep < cfg["minKeep"]:
        report(
            f"[checkpoint-cadence] {_where(args)}: keeps {keep} checkpoint(s); at least "
            f"{int(cfg['minKeep'])} so a torn newest one has a fallback",
            None,
        )


# -- tags -----------------------------------------------------------------------------
TAGGED = (POOL, OVERLAY, ROUTING, MONITORING, TRAINING)
CLOUD_TAGGED = taggable_types()
"""Cloud resource types geotrain makes that take tags -> their tags/labels input."""


def required_tags(args: ResourceValidationArgs, report: Report) -> None:
    cfg = _cfg("required-tags", args)
    need = list(cfg["tags"])
    if args.resource_type in TAGGED:
        have = (args.props.get("facts") or {}).get("tags") or {}
        if args.resource_type == POOL:
            need.append("jurisdiction")
    elif args.resource_type.startswith("kubernetes:") and "metadata" in args.props:
        labels = (args.props.get("metadata") or {}).get("labels") or {}
        have = {k.removeprefix("geotrain.io/"): v for k, v in labels.items()}
        need.append("jurisdiction")
    elif args.resource_type in CLOUD_TAGGED:
        # the resource's own tags (AWS, Alibaba) or labels (GCP), as the cloud stores them
        have = args.props.get(CLOUD_TAGGED[args.resource_type]) or {}
        need.append("jurisdiction")
    else:
        return  # commands and providers carry no tags
    missing = [t for t in need if not have.get(t)]
    if missing:
        report(
            f"[required-tags] {_where(args)}: missing tag(s) {', '.join(missing)}; add "
            "them under geotrain:tags",
            None,
        )


# -- network integrity (stack) --------------------------------------------------------
def network_integrity(args: StackValidationArgs, report: Report) -> None:
    routing = [r for r in args.resources if r.resource_type == ROUTING]
    if not routing:
        return
    f = routing[0].props["facts"]
    seen: dict[int, str] = {}
    for region, asn in f["asns"].items():
        if int(asn) in seen:
            report(
                f"[network-integrity] stack: regions {seen[int(asn)]} and {region} share "
                f"ASN {int(asn)}; give each region its own",
                None,
            )
        seen[int(asn)] = region
    nets = {r: ipaddress.ip_network(c) for r, c in f["subnets"].items()}
    for (a, na), (b, nb) in itertools.combinations(nets.items(), 2):
        if na.overlaps(nb):
            report(f"[network-integrity] stack: subnets of {a} ({na}) and {b} ({nb}) overlap", None)
    regions, links = list(f["asns"]), [tuple(link) for link in f["links"]]
    if len(regions) > 1 and not _connected(regions, links):
        report(
            "[network-integrity] stack: the link graph does not connect every region; add links",
            None,
        )
        return
    for cut in links if len(regions) > 2 else []:
        if not _connected(regions, [lk for lk in links if lk != cut]):
            report(
                f"[network-integrity] stack: link {cut[0]}-{cut[1]} is a single point of "
                "failure (without it some regions cannot reach each other); add a link "
                "that closes a ring",
                None,
            )


def _connected(nodes: list[str], links: list[tuple[str, ...]]) -> bool:
    return reachable(nodes[0], [(a, b) for a, b in links]) == set(nodes)


# -- admin SSH (stack) ----------------------------------------------------------------
def admin_ssh_only(args: StackValidationArgs, report: Report) -> None:
    """SSH from the internet into a cloud region only from the stack's admin networks
    (the cloud pools' facts carry network.admin_cidrs)."""
    admin = {
        c
        for r in args.resources
        if r.resource_type == POOL and r.props["facts"].get("cloud")
        for c in r.props["facts"]["cloud"]["admin_cidrs"]
    }
    nets = [ipaddress.ip_network(c) for c in admin]
    for r in args.resources:
        for proto, ports, src in ingress_rules(r.resource_type, r.props):
            if proto not in ("tcp", "all") or not is_internet(src) or src in EVERYWHERE:
                continue  # 0.0.0.0/0 is no-public-exposure's
            if ports is not None and not ports[0] <= 22 <= ports[1]:
                continue
            net = ipaddress.ip_network(src, strict=False)
            if not any(net.version == a.version and net.subnet_of(a) for a in nets):  # type: ignore[arg-type]
                report(
                    f"[admin-ssh-only] {r.resource_type} '{r.name}': admits SSH from {src}, "
                    f"outside geotrain:network.admin_cidrs ({', '.join(sorted(admin)) or 'none'}); "
                    "admit SSH only from those networks",
                    r.urn,
                )


# -- the policies ---------------------------------------------------------------------
def _schema(name: str) -> PolicyConfigSchema:
    types: dict[type, dict[str, Any]] = {
        list: {"type": ["array", "null"]},
        dict: {"type": "object"},
        int: {"type": ["number", "null"]},
        type(None): {"type": ["number", "array", "null"]},
    }
    props = {k: {**types.get(type(v), {}), "default": v} for k, v in DEFAULTS[name].items()}
    return PolicyConfigSchema(properties=props)


def _resource(name: str, description: str, fn: Any, severity: Severity) -> ResourceValidationPolicy:
    return ResourceValidationPolicy(
        name=name,
        description=description,
        validate=fn,
        enforcement_level=EnforcementLevel.MANDATORY,
        config_schema=_schema(name),
        severity=severity,
    )


def _stack(name: str, description: str, fn: Any, severity: Severity) -> StackValidationPolicy:
    return StackValidationPolicy(
        name=name,
        description=description,
        validate=fn,
        enforcement_level=EnforcementLevel.MANDATORY,
        config_schema=_schema(name),
        severity=severity,
    )


RESOURCE_POLICIES = [
    _resource(
        "data-residency",
        "Raw data is placed and read only in regions of its "
        "jurisdiction; only gradients or pseudo-gradients cross borders.",
        data_residency,
        Severity.CRITICAL,
    ),
    _resource(
        "encryption-in-transit",
        "Cross-region links ride the WireGuard overlay; "
        "payloads are SM4-GCM encrypted where a jurisdiction requires it.",
        encryption_in_transit,
        Severity.CRITICAL,
    ),
    _resource(
        "dp-required",
        "Regions of the chosen jurisdictions train with record-level differential privacy "
        "(DP-SGD), within the epsilon cap.",
        dp_required,
        Severity.HIGH,
    ),
    _resource(
        "no-public-exposure",
        "Metrics, Prometheus, Grafana and rendezvous endpoints "
        "never bind public addresses; no unrestricted LoadBalancer/NodePort; cloud "
        "firewalls admit from the internet only WireGuard from peer gateways and SSH.",
        no_public_exposure,
        Severity.HIGH,
    ),
    _resource(
        "allowed-gpu-types-and-regions",
        "Pools and cloud instances use only allowed GPU types and regions.",
        allowed_gpu_types_and_regions,
        Severity.MEDIUM,
    ),
    _resource(
        "checkpoint-cadence",
        "Checkpoints at most every N minutes, keeping at least 2.",
        checkpoint_cadence,
        Severity.HIGH,
    ),
    _resource(
        "required-tags",
        "Every taggable resource carries owner, cost centre and (per region) jurisdiction.",
        required_tags,
        Severity.LOW,
    ),
]
STACK_POLICIES = [
    _stack(
        "admin-ssh-only",
        "Cloud firewalls admit SSH from the internet only from geotrain:network.admin_cidrs.",
        admin_ssh_only,
        Severity.HIGH,
    ),
    _stack(
        "budget-cap",
        "Total GPUs and estimated hourly cost (cloud instances at their regional list "
        "price) stay under the caps.",
        budget_cap,
        Severity.HIGH,
    ),
    _stack(
        "network-integrity",
        "Unique ASNs, non-overlapping subnets, and a link graph that "
        "survives any single link failure.",
        network_integrity,
        Severity.HIGH,
    ),
]
ALL = [*RESOURCE_POLICIES, *STACK_POLICIES]
