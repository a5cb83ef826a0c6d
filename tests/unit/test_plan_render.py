"""Plan and renderers: addresses, ranks, tunnels and every artifact's key content."""

from __future__ import annotations

import ipaddress
import json

import yaml

from infra.model import load_stack
from infra.plan import build_plan
from infra.render import (
    render_alert_rules,
    render_all,
    render_dashboard,
    render_frr,
    render_launch_spec,
    render_prometheus,
    render_wireguard,
)
from infra.render.network import strip_wg_quick
from training.spec import LaunchSpec


def test_ranks_are_contiguous_and_grouped_by_region() -> None:
    plan = build_plan(load_stack("global"))
    assert plan.world_size == 3 * 8 * 8
    ranks = [n.first_rank for n in plan.nodes]
    assert ranks == list(range(0, 192, 8))
    assert [n.region for n in plan.nodes[:8]] == ["beijing"] * 8


def test_tunnels_get_distinct_31s_ports_and_ifnames() -> None:
    plan = build_plan(load_stack("lab"))
    ips = [ip for t in plan.tunnels for ip in (t.a_ip, t.b_ip)]
    assert len(set(ips)) == len(ips) == 6
    for r in plan.regions:
        ends = [t.side(r.name) for t in plan.tunnels_of(r.name)]
        assert len({e.port for e in ends}) == len(ends)
        assert all(len(e.ifname) <= 15 for e in ends)
    for t in plan.tunnels:
        assert ipaddress.ip_address(t.a_ip) in ipaddress.ip_network("10.42.255.0/24")


def test_wireguard_config_leaves_routing_to_bgp_and_never_holds_a_private_key() -> None:
    plan = build_plan(load_stack("lab"))
    t = plan.tunnels[0]
    conf = render_wireguard(plan, "beijing", t, {"fra-gw": "PUBKEY="})
    assert "Table = off" in conf
    assert "PublicKey = PUBKEY=" in conf
    assert "PrivateKey" not in conf
    assert f"Endpoint = {t.side('beijing').peer_underlay}:{t.b_port}" in conf  # the relay
    stripped = strip_wg_quick(conf)
    assert "Table" not in stripped and "Address" not in stripped and "ListenPort" in stripped


def test_frr_has_a_bfd_session_per_tunnel_and_prepends_costly_links() -> None:
    plan = build_plan(load_stack("lab"))
    conf = render_frr(plan, "beijing")
    assert conf.count("bfd profile geotrain") == 2
    assert "network 10.42.1.0/24" in conf
    assert "router bgp 64601" in conf
    # the beijing-silicon-valley link costs 20: one prepend; beijing-frankfurt costs 10: none
    sv = conf.split("route-map GT-OUT-silicon-valley")[1].split("!")[0]
    fra = conf.split("route-map GT-OUT-frankfurt")[1].split("!")[0]
    assert "prepend 64601" in sv and "prepend" not in fra
    # BGP routes leave from the gateway's region address, not a tunnel's /31
    plan_bj = plan.region("beijing")
    assert f"set src {plan_bj.router_id}" in conf
    assert "ip protocol bgp route-map GT-SRC" in conf


def test_launch_spec_round_trips_and_keeps_shards_in_their_region() -> None:
    spec = render_launch_spec(build_plan(load_stack("local")))
    again = LaunchSpec.from_json(spec.to_json())
    assert again == spec
    assert spec.world_size == 6
    for r in spec.regions:
        assert all(s.jurisdiction == r.jurisdiction for s in r.shards)


def test_prometheus_scrapes_every_worker_with_region_labels() -> None:
    plan = build_plan(load_stack("global"))
    doc = yaml.safe_load(render_prometheus(plan))
    runtime = next(j for j in doc["scrape_configs"] if j["job_name"] == "geotrain-runtime")
    targets = [t for sc in runtime["static_configs"] for t in sc["targets"]]
    assert len(targets) == 192
    assert {sc["labels"]["region"] for sc in runtime["static_configs"]} == {
        "beijing",
        "frankfurt",
        "silicon-valley",
    }
    jobs = {j["job_name"] for j in doc["scrape_configs"]}
    assert {"node-exporter", "dcgm-exporter"} <= jobs


def test_alert_rules_cover_the_operational_failures() -> None:
    doc = yaml.safe_load(render_alert_rules(build_plan(load_stack("local"))))
    names = {r["alert"] for r in doc["groups"][0]["rules"]}
    assert names == {
        "GeotrainRegionDown",
        "GeotrainSyncStalled",
        "GeotrainCheckpointStale",
        "GeotrainGpuUtilLow",
        "GeotrainCrossRegionThroughputCollapsed",
        "GeotrainLossNaN",
        "GeotrainPayloadsRejected",
    }


def test_dashboard_is_valid_json_with_region_legends() -> None:
    dash = json.loads(render_dashboard(build_plan(load_stack("local"))))
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 6
    for p in panels:
        for t in p["targets"]:
            assert "{{region}}" in t["legendFormat"] or "{{node}}" in t["legendFormat"], p


def test_render_all_gives_every_agent_host_its_files_and_the_operator_the_rest() -> None:
    for stack in ("local", "lab", "global"):
        plan = build_plan(load_stack(stack))
        arts = {a.path for a in render_all(plan)}
        assert "launch-spec.json" in arts
        assert "monitoring/prometheus.yml" in arts
        for n in plan.nodes:
            has_agent = n.kind in ("lab", "ssh")
            assert (f"nodes/{n.name}/host.json" in arts) == has_agent, (stack, n.name)
            assert (f"nodes/{n.name}/firewall.nft" in arts) == has_agent, (stack, n.name)
            if has_agent and n.is_gateway:
                assert f"nodes/{n.name}/frr/frr.conf" in arts
                assert sum(f"nodes/{n.name}/wireguard/" in a for a in arts) == 2
            worker = f"nodes/{n.name}/systemd/geotrain-worker.service"
            assert (worker in arts) == (n.kind == "ssh"), (stack, n.name)
