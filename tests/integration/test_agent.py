"""The host agent on a real host (root): a namespace host with its own root filesystem and
systemd, given one node's bundle. Idempotence, exact removal (Debian's own files
included), bad bundles that change nothing, a failed check that rolls back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.hosts import Host, runtime_binds, runtime_venv
from infra.lab import VENVS
from infra.model.load import validate
from infra.plan import Plan, build_plan
from infra.render.bundle import Bundle, render_bundle, runtime_wheel
from infra.render.host import HostRole
from tests.integration.fleet import diff, snapshot

MISSING = [
    c for c in ("ip", "nsenter", "nft", "vtysh", "promtool", "amtool") if not shutil.which(c)
]
pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespace hosts"),
    pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)} (.ci/run installs)"),
]
NETNS = "gt-agent-test"
ROLE = HostRole(training=False)
"""The network, firewall, FRR and monitoring parts (the worker is the fleet test's)."""


def one_host_plan() -> Plan:
    """One region, one ssh node that is gateway and monitoring host (no Grafana: its
    repository is not reachable from here)."""
    raw = {
        "stack": "agenttest",
        "regions": [
            {
                "name": "beijing",
                "jurisdiction": "CN",
                "subnet": "10.42.1.0/24",
                "asn": 64601,
                "pool": {
                    "kind": "ssh",
                    "nodes": [{"name": "bj-0", "address": "198.18.7.10", "gpu_type": "cpu"}],
                },
            }
        ],
        "network": {"admin_cidrs": ["198.18.7.0/24"]},
        "monitoring": {"grafana": False},
        "training": {"data_shards": [{"name": "cn", "jurisdiction": "CN", "region": "beijing"}]},
        "tags": {"owner": "test", "cost-centre": "ci"},
    }
    return build_plan(validate(raw, "test"))


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    try:
        for args in (
            ["link", "add", "gtagent0", "type", "veth", "peer", "name", "eth0", "netns", NETNS],
            ["-n", NETNS, "addr", "add", "198.18.7.10/24", "dev", "eth0"],
            ["-n", NETNS, "link", "set", "eth0", "up"],
            ["-n", NETNS, "link", "set", "lo", "up"],
        ):
            subprocess.run(["ip", *args], check=True)
        venv = runtime_venv(runtime_wheel(), VENVS)
        h = Host("bj-0", NETNS, tmp_path / "host", binds=runtime_binds(venv))
        h.start()
        yield h
        h.stop()
    finally:
        subprocess.run(["ip", "link", "del", "gtagent0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


def bundle() -> Bundle:
    plan = one_host_plan()
    return render_bundle(plan, plan.nodes[0], ROLE, runtime_wheel())


def agent(h: Host, b: Bundle, tmp: Path, *args: str) -> tuple[int, str, str]:
    """Upload `b` into the host and run the agent there as `pulumi up` would over SSH."""
    local = b.write(tmp / "bundles" / b.digest)
    path = f"/root/.geotrain/bundles/{b.digest}"
    h.upload(local, path)
    r = h.exec(
        ["python3", "-I", f"{path}/agent.py", *args, "--bundle", path, "--digest", b.digest],
        check=False,
    )
    return r.returncode, r.stdout, r.stderr


def test_apply_brings_the_host_to_its_bundle_and_a_second_apply_changes_nothing(
    host: Host, tmp_path: Path
) -> None:
    b = bundle()
    rc, out, err = agent(host, b, tmp_path, "apply")
    assert rc == 0, err
    changed = json.loads(out.strip().splitlines()[-1])["changed"]
    assert "address 10.42.1.1/24 on eth0" in changed
    assert "/etc/frr/frr.conf" in changed
    active = host.sh(
        "systemctl is-active geotrain-firewall frr prometheus prometheus-alertmanager "
        "prometheus-node-exporter",
        check=False,
    ).split()
    assert active == ["active"] * 5, active
    assert "inet geotrain" in host.sh("nft list tables")
    assert "router bgp 64601" in host.sh("vtysh -c 'show running-config'")
    assert "10.42.1.1:9100" in host.sh("cat /etc/default/prometheus-node-exporter")
    rc, out, err = agent(host, b, tmp_path, "apply")
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["changed"] == []
    # drift: what `pulumi refresh` cannot see (a hand edit, a stopped service, an address)
    assert _status(host) == (0, [])
    host.sh(
        "echo '! edited by hand' >> /etc/frr/frr.conf; systemctl stop prometheus-node-exporter;"
        " ip addr del 10.42.1.1/24 dev eth0"
    )
    assert _status(host, "/run/drift.prom") == (
        3,
        [
            "file /etc/frr/frr.conf: changed",
            "unit prometheus-node-exporter.service: not active",
            "address 10.42.1.1/24 on eth0: missing",
        ],
    )
    assert 'geotrain_node_drift{node="bj-0"} 3' in host.sh("cat /run/drift.prom")
    rc, out, err = agent(host, b, tmp_path, "apply")  # the next up puts it back
    assert rc == 0, err
    assert _status(host) == (0, [])


def _status(h: Host, textfile: str | None = None) -> tuple[int, list[str]]:
    argv = [
        "/usr/local/sbin/geotrain-node",
        "status",
        *(["--textfile", textfile] if textfile else []),
    ]
    r = h.exec(argv, check=False)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])["drift"]


def test_remove_returns_the_host_to_how_it_was_debians_own_files_included(
    host: Host, tmp_path: Path
) -> None:
    before = snapshot(host)
    debian_daemons = host.sh("cat /etc/frr/daemons")
    rc, _, err = agent(host, bundle(), tmp_path, "apply")
    assert rc == 0, err
    assert host.sh("cat /etc/frr/daemons") != debian_daemons
    r = host.exec(["/usr/local/sbin/geotrain-node", "remove"], check=False)
    assert r.returncode == 0, r.stderr
    host.exec(["rm", "-rf", "/root/.geotrain"])  # what Pulumi's delete removes after the agent
    assert host.sh("cat /etc/frr/daemons") == debian_daemons
    assert "geotrain" not in host.sh("nft list tables")
    assert "10.42.1.1" not in host.sh("ip -4 addr")
    left = diff(before, snapshot(host))
    assert left == [], "\n".join(left)


@pytest.mark.parametrize(
    "fault, step, words",
    [
        ("missing-file", "verify", "frr/frr.conf is missing"),
        ("wrong-digest", "verify", "has digest"),
        ("bad-package", "packages", "geotrain-no-such-package"),
    ],
)
def test_a_bad_bundle_fails_with_host_and_step_and_leaves_the_host_as_it_was(
    host: Host, tmp_path: Path, fault: str, step: str, words: str
) -> None:
    b = bundle()
    if fault == "bad-package":
        spec = json.loads(b.files["host.json"])
        spec["packages"].append("geotrain-no-such-package")
        b = b.replace("host.json", json.dumps(spec).encode())
    before = snapshot(host)
    local = b.write(tmp_path / "bad")
    if fault == "missing-file":
        (local / "frr" / "frr.conf").unlink()
    if fault == "wrong-digest":
        (local / "firewall.nft").write_text("table inet geotrain { }\n")
    path = "/root/.geotrain/bundles/bad"
    host.upload(local, path)
    r = host.exec(
        ["python3", "-I", f"{path}/agent.py", "apply", "--bundle", path, "--digest", b.digest],
        check=False,
    )
    host.exec(["rm", "-rf", "/root/.geotrain"])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert f"host bj-0: step {step}:" in lines[0] and words in lines[0], lines[0]
    left = [
        ln
        for ln in diff(before, snapshot(host))
        if "/var/lib/apt/" not in ln and "/var/cache/" not in ln
    ]
    assert left == [], "\n".join(left)


def test_a_config_its_check_rejects_restarts_nothing_and_rolls_back(
    host: Host, tmp_path: Path
) -> None:
    good = bundle()
    rc, _, err = agent(host, good, tmp_path, "apply")
    assert rc == 0, err
    running = host.sh("cat /etc/prometheus/prometheus.yml")
    pid = host.sh("systemctl show -p MainPID --value prometheus").strip()
    bad = good.replace("monitoring/prometheus.yml", b"scrape_configs: [{job_name: 1, bad: 2}]\n")
    rc, _, err = agent(host, bad, tmp_path, "apply")
    assert rc == 2
    assert "promtool check config" in err and "nothing was restarted" in err, err
    assert host.sh("cat /etc/prometheus/prometheus.yml") == running
    assert host.sh("systemctl show -p MainPID --value prometheus").strip() == pid
