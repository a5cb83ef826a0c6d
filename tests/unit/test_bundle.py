"""Bundles and host descriptions: deterministic, complete, verified by the agent's first
stage; the agent's pure helpers (no root)."""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest

from geotrain.agent import bootstrap
from geotrain.agent.apply import Apply, Secrets, State, _remove_tree_except, _set_keys
from geotrain.agent.bootstrap import AgentError
from geotrain.agent.hostspec import DirSpec, HostSpec
from infra.model import load_stack
from infra.plan import build_plan
from infra.render.bundle import render_bundle, runtime_wheel
from infra.render.host import ROLES, render_firewall, render_host


def _global_bundle(node: str = "bj-0"):  # type: ignore[no-untyped-def]
    plan = build_plan(load_stack("global"))
    return render_bundle(plan, plan.node(node), ROLES["ssh"], runtime_wheel())


def test_the_same_stack_renders_the_same_bundle_digest() -> None:
    assert _global_bundle().digest == _global_bundle().digest


def test_a_changed_file_changes_the_digest_and_the_agent_refuses_a_stale_copy(
    tmp_path: Path,
) -> None:
    b = _global_bundle()
    b.write(tmp_path / "b")
    bootstrap.verify(tmp_path / "b", b.digest)  # intact: passes
    (tmp_path / "b" / "launch-spec.json").write_text("{}")
    with pytest.raises(AgentError, match=r"step verify: bundle file launch-spec\.json has digest"):
        bootstrap.verify(tmp_path / "b", b.digest)
    other = b.replace("launch-spec.json", b"{}")
    assert other.digest != b.digest
    with pytest.raises(AgentError, match="expected"):
        bootstrap.verify(tmp_path / "b", other.digest[:8] + b.digest[8:])


def test_host_spec_round_trips_through_json() -> None:
    plan = build_plan(load_stack("global"))
    spec, _ = render_host(plan, plan.node("fra-0"), ROLES["ssh"])
    assert HostSpec.from_json(spec.to_json()) == spec


def test_a_gateway_gets_tunnels_frr_forwarding_and_no_private_key() -> None:
    plan = build_plan(load_stack("global"))
    spec, files = render_host(plan, plan.node("bj-0"), ROLES["ssh"])
    assert {t.peer_node for t in spec.tunnels} == {"fra-0", "sv-0"}
    assert spec.frr is not None and spec.sysctl_src is not None
    assert all("PrivateKey" not in text for text in files.values())
    assert {"wireguard-tools", "frr", "nftables"} <= set(spec.packages)
    worker = files["systemd/geotrain-worker.service"]
    unit, service = worker.split("[Service]")
    assert "StartLimitBurst=" in unit and "StartLimitIntervalSec=" in unit
    assert "WorkingDirectory=/var/lib/geotrain" in service


def test_a_worker_routes_the_overlay_via_its_gateway_and_runs_no_frr() -> None:
    plan = build_plan(load_stack("global"))
    spec, _ = render_host(plan, plan.node("bj-1"), ROLES["ssh"])
    assert [(r.dst, r.via) for r in spec.routes] == [("10.42.0.0/16", "10.42.1.1")]
    assert spec.frr is None and spec.tunnels == ()
    assert spec.addresses[0].address == "10.42.1.11/24"
    assert spec.addresses[0].near == "192.0.2.11"


def test_the_firewall_admits_the_overlay_the_admins_and_the_peer_gateways_only() -> None:
    plan = build_plan(load_stack("global"))
    gw = render_firewall(plan, plan.node("bj-0"))
    assert "policy drop" in gw
    assert "10.42.0.0/16" in gw
    assert "tcp dport 22 ip saddr @admin accept" in gw
    assert "udp dport { 51821, 51822 } ip saddr { 198.51.100.10, 203.0.113.10 } accept" in gw
    assert "chain forward" in gw
    worker = render_firewall(plan, plan.node("bj-1"))
    assert "udp dport" not in worker and "chain forward" not in worker
    mon = render_firewall(plan, plan.node("fra-0"))  # the monitoring host: its UIs for admins
    assert "tcp dport { 9090, 9093, 3000 } ip saddr @admin accept" in mon


def test_the_firewall_admits_tcp_from_the_regions_own_hosts_lan_addresses() -> None:
    # NCCL advertises the first address of its interface: on an SSH host, the LAN one
    plan = build_plan(load_stack("global"))
    fw = render_firewall(plan, plan.node("bj-1"))
    region = next(ln for ln in fw.splitlines() if "set region" in ln)
    others = {f"192.0.2.{10 + i}" for i in range(8)} - {"192.0.2.11"}
    assert set(region.split("{ ", 2)[2].split(" }")[0].split(", ")) == others
    assert "    meta l4proto tcp ip saddr @region accept" in fw
    assert "198.51.100.10" not in region  # another region's host is not admitted
    local = build_plan(load_stack("local"))  # loopback-only regions: nothing to admit
    assert all("set region" not in render_firewall(local, n) for n in local.nodes)


def test_debians_frr_daemons_file_keeps_every_other_setting() -> None:
    text = '# comment\nbgpd=no\nospfd=no\nvtysh_enable=yes\nzebra_options="  -A 127.0.0.1"\n'
    out = _set_keys(text, {"bgpd": "yes", "bfdd": "yes"})
    assert "bgpd=yes" in out and "bfdd=yes" in out
    assert "ospfd=no" in out and 'zebra_options="  -A 127.0.0.1"' in out and "# comment" in out


def test_remove_keeps_checkpoint_dirs_inside_dirs_it_deletes(tmp_path: Path) -> None:
    root = tmp_path / "var-lib-geotrain"
    (root / "run").mkdir(parents=True)
    (root / "run" / "events.jsonl").write_text("{}")
    (root / "checkpoints" / "step-2").mkdir(parents=True)
    _remove_tree_except(root, [root / "checkpoints"])
    assert not (root / "run").exists()
    assert (root / "checkpoints" / "step-2").is_dir()


def test_secrets_on_stdin_must_be_the_json_object() -> None:
    s = Secrets.parse(json.dumps({"run_key": "ab", "wireguard": {"fra-0": "K"}}).encode(), "n")
    assert s.run_key == "ab" and s.wireguard == {"fra-0": "K"} and s.files == {}
    with pytest.raises(AgentError, match="step secrets"):
        Secrets.parse(b"not json", "bj-0")


def test_the_checkpoint_dir_is_rendered_as_the_nodes_own_root_and_never_adopted(
    write_stack: Any,
) -> None:
    f = write_stack(
        "global", lambda c: c["geotrain:training"]["checkpoint"].update(dir="/home/{node}/ckpt")
    )
    plan = build_plan(load_stack(str(f)))
    spec, _ = render_host(plan, plan.node("bj-1"), ROLES["ssh"])
    (ckpt,) = [d for d in spec.dirs if "ckpt" in d.path]
    assert ckpt.path == "/home/bj-1/ckpt" and not ckpt.adopt  # not /home
    assert all(d.adopt for d in spec.dirs if d is not ckpt)


def _dirs_apply(tmp_path: Path, made: list[str], *dirs: DirSpec) -> Apply:
    plan = build_plan(load_stack("global"))
    spec, _ = render_host(plan, plan.node("bj-1"), ROLES["ssh"])
    me, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name
    dirs = tuple(dataclasses.replace(d, owner=me, group=group) for d in dirs)
    spec = dataclasses.replace(spec, service_user=me, dirs=dirs)
    state = State({"dirs": [{"path": p, "keep": True} for p in made]})
    return Apply(tmp_path / "bundle", spec, Secrets(), state)


def test_the_agent_re_owns_only_directories_it_made_or_empty_ones(tmp_path: Path) -> None:
    """A user-named dir (adopt False) that already holds someone's files keeps its owner
    and mode: the agent stops with the fix. Empty, made by an earlier apply, or one of
    geotrain's own dirs (adopt True): brought to the bundle's mode."""
    home = tmp_path / "home-alice"
    home.mkdir(mode=0o755)
    (home / "thesis.txt").write_text("years of work")
    home.chmod(0o755)
    a = _dirs_apply(tmp_path, [], DirSpec(str(home), mode="0750", adopt=False))
    with pytest.raises(AgentError, match=r"step dirs: .*home-alice already exists with files"):
        a.users_and_dirs()
    assert home.stat().st_mode & 0o777 == 0o755 and (home / "thesis.txt").is_file()
    for made, adopt in (([str(home)], False), ([], True)):  # its own from before; geotrain's
        home.chmod(0o755)
        _dirs_apply(tmp_path, made, DirSpec(str(home), mode="0750", adopt=adopt)).users_and_dirs()
        assert home.stat().st_mode & 0o777 == 0o750
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    empty.chmod(0o755)
    _dirs_apply(tmp_path, [], DirSpec(str(empty), mode="0750", adopt=False)).users_and_dirs()
    assert empty.stat().st_mode & 0o777 == 0o750
    new = tmp_path / "new" / "ckpt"
    a = _dirs_apply(tmp_path, [], DirSpec(str(new), mode="0750", adopt=False))
    a.users_and_dirs()
    assert new.stat().st_mode & 0o777 == 0o750
    assert a.state.d["dirs"][-1]["path"] == str(new)


def test_the_firewall_admits_ssh_on_the_pools_port(write_stack: Any) -> None:
    f = write_stack(
        "global",
        lambda c: [r["pool"].update(ssh={"port": 2222}) for r in c["geotrain:regions"]],
    )
    plan = build_plan(load_stack(str(f)))
    fw = render_firewall(plan, plan.node("bj-1"))
    assert "tcp dport 2222 ip saddr @admin accept" in fw and "dport 22 " not in fw


def test_a_pools_mirrors_reach_its_hosts_spec_and_other_pools_keep_the_public_indexes(
    write_stack: Any,
) -> None:
    def put(c: dict[str, Any]) -> None:
        c["geotrain:regions"][0]["pool"]["mirrors"] = {
            "pip_index_url": "https://mirrors.aliyun.com/pypi/simple/"
        }

    plan = build_plan(load_stack(str(write_stack("global", put))))
    bj, _ = render_host(plan, plan.node("bj-1"), ROLES["ssh"])
    fra, _ = render_host(plan, plan.node("fra-1"), ROLES["ssh"])
    assert bj.mirrors is not None
    assert bj.mirrors.pip_index_url == "https://mirrors.aliyun.com/pypi/simple/"
    assert bj.mirrors.torch_index_url is None and fra.mirrors is None
    assert HostSpec.from_json(bj.to_json()) == bj  # the agent reads what was rendered


@pytest.mark.parametrize(
    ("stack", "mirrors", "words"),
    [
        ("global", {"pip_index_url": "http://mirror.example/simple"}, "pool.mirrors"),
        ("local", {"pip_index_url": "https://mirror.example/simple"}, "installs nothing"),
    ],
)
def test_mirrors_that_are_not_https_or_on_a_pool_without_hosts_are_refused(
    tmp_path: Path, stack: str, mirrors: dict[str, str], words: str
) -> None:
    import yaml
    from click.testing import CliRunner

    from geotrain.cli import cli

    repo = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((repo / "stacks" / f"Pulumi.{stack}.yaml").read_text())
    doc["config"]["geotrain:regions"][0]["pool"]["mirrors"] = mirrors
    path = tmp_path / "Pulumi.m.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert words in r.output, r.output
