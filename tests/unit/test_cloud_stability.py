"""Cloud pools stay put across `pulumi up`s (issue 36), A3 gets gVNIC, and every cloud node's
SSH host key is made by the program and pinned (issue 37).

The program runs twice under mocks, the second time against a later catalogue (newer
images behind the SSM parameter, the GCP family and the Alibaba pattern; other zones
offering the types). The engine keeps an `ignore_changes` input as the resource was made,
so "what the engine would diff" is the second run's inputs with those paths taken from the
first run: nothing may differ, or a new image release would replace GPU nodes."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra.backends.cloud import DataDisk, host_key_from_seed, mount_script
from infra.mocks import Recording, Registered, run_under_mocks
from infra.model import load_stack
from infra.model.clouds import CLOUDS, HOST_WORK_DIR
from infra.model.load import validate
from infra.render.runtime import REMOTE_STATE_DIR

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:pulumi_aws",
    "ignore::DeprecationWarning:pulumi_gcp",
    "ignore::DeprecationWarning:pulumi_alicloud",
)
STACK = "global-cloud"
INSTANCE = {
    "alicloud": "alicloud:ecs/instance:Instance",
    "gcp": "gcp:compute/instance:Instance",
    "aws": "aws:ec2/instance:Instance",
}
DISK = {
    "alicloud": "alicloud:ecs/ecsDisk:EcsDisk",
    "gcp": "gcp:compute/disk:Disk",
    "aws": "aws:ebs/volume:Volume",
}
ATTACHMENT = {
    "alicloud": "alicloud:ecs/ecsDiskAttachment:EcsDiskAttachment",
    "aws": "aws:ec2/volumeAttachment:VolumeAttachment",
}
GVNIC_FAMILIES = ("a3", "a4", "c3", "c3d", "c4", "c4a", "c4d", "h3", "n4", "z3")
"""GCP machine families that start only with gVNIC (GCP's machine-family docs)."""


def _stack(**cloud: Any) -> Any:
    """global-cloud with `cloud` settings on every region; frankfurt without its zone
    (so GCP's zone comes from geotrain's table)."""
    raw = load_stack(STACK).model_dump(mode="json", exclude_unset=True)
    for r in raw["regions"]:
        r["pool"]["cloud"].update(cloud)
        r["pool"]["cloud"].pop("zone", None)
    return validate(raw, "test")


def _operator_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return (
        ed25519.Ed25519PrivateKey.generate()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        .decode()
    )


def _run(m: Any, epoch: int = 0, key: str | None = None) -> Recording:
    """The program under mocks with geotrain:sshPrivateKey set (as a secret) to `key`."""
    import pulumi

    import infra.backends.cloud as cloud

    pem = key or _operator_key()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cloud, "secret", lambda _key: pulumi.Output.secret(pem))
        return run_under_mocks(m, epoch=epoch)


@pytest.fixture(scope="module")
def runs() -> tuple[Recording, Recording]:
    m, key = _stack(), _operator_key()
    return _run(m, 0, key), _run(m, 1, key)


def _get(d: Any, path: list[str]) -> Any:
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _set(d: dict[str, Any], path: list[str], value: Any) -> None:
    for p in path[:-1]:
        d = d.setdefault(p, {})
    if value is None:
        d.pop(path[-1], None)
    else:
        d[path[-1]] = value


def _as_engine_diffs(new: Registered, old: Registered) -> dict[str, Any]:
    """`new`'s inputs with its ignore_changes paths as `old` made them."""
    inputs = copy.deepcopy(new.inputs)
    for path in new.ignore_changes:
        keys = path.split(".")
        _set(inputs, keys, copy.deepcopy(_get(old.inputs, keys)))
    return inputs


def _by_urn(rec: Recording) -> dict[str, Registered]:
    return {r.urn: r for r in rec.resources}


def _plain(value: Any) -> Any:
    """Inputs comparable with ==: an asset or archive (no __eq__) as its kind and path."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "path"):
        return (type(value).__name__, str(value.path))
    return value


def test_a_newer_image_and_other_zones_change_nothing_the_engine_diffs(
    runs: tuple[Recording, Recording],
) -> None:
    first, later = runs
    old, new = _by_urn(first), _by_urn(later)
    assert set(old) == set(new)
    # the later catalogue really answers differently: otherwise this test proves nothing
    looked_up = {
        "aws:ec2/instance:Instance": ["ami"],
        "aws:ec2/subnet:Subnet": ["availabilityZone"],
        "alicloud:ecs/instance:Instance": ["imageId"],
        "alicloud:vpc/switch:Switch": ["zoneId"],
        "gcp:compute/instance:Instance": ["bootDisk", "initializeParams", "image"],
    }
    for token, path in looked_up.items():
        for r in first.by_type(token):
            assert _get(r.inputs, path) != _get(new[r.urn].inputs, path), (r.urn, path)
    changed = {
        urn: sorted(
            k
            for k in set(r.inputs) | set(old[urn].inputs)
            if _plain(_as_engine_diffs(r, old[urn]).get(k)) != _plain(old[urn].inputs.get(k))
        )
        for urn, r in new.items()
    }
    assert {u: c for u, c in changed.items() if c} == {}


def test_only_looked_up_inputs_are_pinned_and_instances_go_before_their_replacements(
    runs: tuple[Recording, Recording],
) -> None:
    rec = runs[0]
    pins = {r.type: r.ignore_changes for r in rec.resources if r.ignore_changes}
    assert pins == {
        "aws:ec2/subnet:Subnet": ["availabilityZone"],
        "aws:ebs/volume:Volume": ["availabilityZone"],
        "aws:ec2/instance:Instance": ["ami"],
        "alicloud:vpc/switch:Switch": ["zoneId"],
        "alicloud:ecs/ecsDisk:EcsDisk": ["zoneId"],
        "alicloud:ecs/instance:Instance": ["imageId"],
        "gcp:compute/disk:Disk": ["zone"],
        "gcp:compute/instance:Instance": ["zone", "bootDisk.initializeParams.image"],
    }
    for token in [*INSTANCE.values(), *ATTACHMENT.values()]:
        assert all(r.delete_before_replace for r in rec.by_type(token)), token


def test_images_and_zones_the_stack_sets_are_obeyed_and_image_upgrade_moves_on() -> None:
    raw = load_stack(STACK).model_dump(mode="json", exclude_unset=True)
    raw["regions"][0]["pool"]["cloud"].update(image="m-fixed", zone="cn-beijing-k")
    raw["regions"][2]["pool"]["cloud"].update(image="ami-0123456789abcdef0", zone="us-west-1c")
    rec = run_under_mocks(validate(raw, "test"))
    pinned = [r.type for r in rec.resources if r.ignore_changes]
    assert pinned == ["gcp:compute/instance:Instance"] * 2  # frankfurt's family image only
    [subnet] = rec.by_type("aws:ec2/subnet:Subnet")
    assert subnet.inputs["availabilityZone"] == "us-west-1c"
    assert {r.inputs["imageId"] for r in rec.by_type(INSTANCE["alicloud"])} == {"m-fixed"}
    # image_upgrade: the newest image reaches the instances (they are replaced)
    up0 = run_under_mocks(_stack(image_upgrade=True), epoch=0)
    up1 = _by_urn(run_under_mocks(_stack(image_upgrade=True), epoch=1))
    for token in INSTANCE.values():
        for r in up0.by_type(token):
            assert "ami" not in r.ignore_changes and "imageId" not in r.ignore_changes
            assert _plain(_as_engine_diffs(up1[r.urn], r)) != _plain(r.inputs), r.urn


# -- data disks ----------------------------------------------------------------------------
def _user_data(inst: Registered) -> dict[str, Any]:
    text = inst.inputs.get("userData") or inst.inputs["metadata"]["user-data"]
    assert text.startswith("#cloud-config\n")
    return dict(json.loads(text.removeprefix("#cloud-config\n")))


@pytest.mark.parametrize("keep", [True, False])
def test_each_node_has_a_kept_data_disk_attached_and_mounted_at_the_checkpoint_root(
    keep: bool, runs: tuple[Recording, Recording]
) -> None:
    if keep:
        rec = runs[0]
    else:
        raw = load_stack(STACK).model_dump(mode="json", exclude_unset=True)
        raw["training"]["checkpoint"]["keep_on_destroy"] = False
        rec = _run(validate(raw, "test"))
    mount = load_stack(STACK).training.checkpoint.dir  # /var/lib/geotrain/checkpoints
    for kind, token in INSTANCE.items():
        disks = {r.name: r for r in rec.by_type(DISK[kind])}
        for inst in rec.by_type(token):
            disk = disks[f"{inst.name}-data"]
            assert disk.retain_on_delete is keep, disk.name
            if kind == "gcp":
                [att] = inst.inputs["attachedDisks"]
                assert att["source"] == disk.inputs["selfLink"] and att["mode"] == "READ_WRITE"
                device = f"/dev/disk/by-id/google-{att['deviceName']}"
                assert disk.inputs["zone"] == inst.inputs["zone"]
            else:
                [att] = [
                    a
                    for a in rec.by_type(ATTACHMENT[kind])
                    if a.name == f"{inst.name}-data-attachment"
                ]
                ids = (att.inputs.get("volumeId"), att.inputs.get("diskId"))
                assert disk.id in ids and att.inputs["instanceId"] == inst.id
                assert att.delete_before_replace
                device = disk.id.replace("-", "") if kind == "aws" else disk.id[2:]
                assert disk.id.startswith("vol-" if kind == "aws" else "d-")
            script = "\n".join(_user_data(inst)["runcmd"])
            assert f"awk -v s={device} " in script or f"[ -b {device} ]" in script, inst.name
            assert f"mount {mount}" in script and f" {mount} ext4 defaults,nofail" in script
            # the disk is ready before the operator's key lets the agent in
            assert script.index(f"mount {mount}") < script.index("authorized_keys")
    assert rec.by_type(DISK["aws"])[0].inputs["encrypted"] is True


def test_the_instance_keeps_no_checkpoints_on_its_root_disk() -> None:
    rec = run_under_mocks(load_stack(STACK))
    for inst in rec.by_type(INSTANCE["aws"]):
        assert inst.inputs["rootBlockDevice"]["deleteOnTermination"] is True
        assert "volumeTags" not in inst.inputs  # AWS: they fight the data volume's tags
    assert all(d.inputs["deleteWithInstance"] is False for d in rec.by_type(DISK["alicloud"]))


def test_the_model_and_the_renderers_agree_on_the_hosts_work_dir() -> None:
    assert HOST_WORK_DIR == REMOTE_STATE_DIR


FAKE_TOOLS = {
    # NAME SERIAL of every disk: the root disk, an instance-store NVMe, the data volume
    # (its serial cut to 20 characters, as Alibaba's guests do)
    "lsblk": "printf '/dev/nvme0n1 vol0root0000000000\\n/dev/nvme2n1 AWS1234567890\\n"
    '/dev/nvme1n1 %s\\n\' "$DATA_SERIAL"',
    "blkid": '[ "$1" = -p ] && { [ -e "$STATE/formatted" ] || exit 2; exit 0; }; echo 1111-2222',
    "mkfs.ext4": 'echo "$@" >> "$STATE/mkfs"; touch "$STATE/formatted"',
    "mountpoint": "exit 1",
    "mount": 'echo "$@" >> "$STATE/mounts"',
    "mkdir": 'echo "$@" >> "$STATE/mkdirs"',
    "rmdir": 'echo "$@" >> "$STATE/rmdirs"',
    "sleep": "exit 0",
}


def _run_mount(tmp: Path, device: str, serial: str, formatted: bool) -> dict[str, str]:
    """mount_script under sh, with fake disk tools on PATH and /etc/fstab redirected."""
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    for name, body in FAKE_TOOLS.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    if formatted:
        (tmp / "formatted").touch()
    fstab = tmp / "fstab"
    fstab.touch()
    lines = mount_script(DataDisk("/var/lib/geotrain/checkpoints", device))
    script = "set -e\n" + "\n".join(lines).replace("/etc/fstab", str(fstab)) + "\n"
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "STATE": str(tmp), "DATA_SERIAL": serial}
    p = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    out = {f.name: f.read_text() for f in tmp.iterdir() if f.is_file()}
    return {**out, "rc": str(p.returncode), "stderr": p.stderr}


def test_mount_script_formats_a_blank_disk_once_and_mounts_it_by_uuid(tmp_path: Path) -> None:
    r = _run_mount(tmp_path, "2ze0123456789abcdefghij", "2ze0123456789abcdefg", False)
    assert r["rc"] == "0", r["stderr"]
    assert r["mkfs"] == "-q -L geotrain-data /dev/nvme1n1\n"
    assert r["fstab"] == "UUID=1111-2222 /var/lib/geotrain/checkpoints ext4 defaults,nofail 0 2\n"
    assert r["mounts"] == "/var/lib/geotrain/checkpoints\n"
    # empty, so the host agent takes the checkpoint root over
    assert r["rmdirs"] == "/var/lib/geotrain/checkpoints/lost+found\n"


def test_mount_script_never_formats_a_kept_disk_and_fails_without_one(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    r = _run_mount(kept, "vol0abcdef0123456789", "vol0abcdef0123456789", True)
    assert r["rc"] == "0" and "mkfs" not in r and "rmdirs" not in r and r["mounts"], r
    gone = tmp_path / "gone"
    gone.mkdir()
    r = _run_mount(gone, "vol0abcdef0123456789", "vol0ffffffffffffffff", False)
    assert r["rc"] == "1" and "mkfs" not in r and "mounts" not in r
    assert "data disk vol0abcdef0123456789 not attached" in r["stderr"]


# -- gVNIC ---------------------------------------------------------------------------------
def _gcp_variant(type_name: str) -> Any:
    t = CLOUDS["gcp"].by_name(type_name)
    assert t is not None
    region, offer = next(iter(t.offers.items()))
    raw = load_stack(STACK).model_dump(mode="json", exclude_unset=True)
    fra = next(r for r in raw["regions"] if r["name"] == "frankfurt")
    fra["pool"]["cloud"].update(region=region, zone=offer.zones[0])
    for n in fra["pool"]["nodes"]:
        n.update(gpu_type=t.gpu_type, gpus=t.gpus)
    raw["policy"] = {}
    return validate(raw, "test")


def _needs_gvnic(machine_type: str) -> bool:
    return machine_type.split("-")[0] in GVNIC_FAMILIES


@pytest.mark.parametrize("type_name", [t.name for t in CLOUDS["gcp"].instances])
def test_gcp_machine_types_that_need_gvnic_get_it(type_name: str) -> None:
    rec = run_under_mocks(_gcp_variant(type_name))
    insts = rec.by_type(INSTANCE["gcp"])
    assert insts and all(i.inputs["machineType"] == type_name for i in insts)
    for i in insts:
        nic = i.inputs["networkInterfaces"][0].get("nicType")
        assert (nic == "GVNIC") is _needs_gvnic(type_name), (type_name, nic)


def test_every_gcp_node_of_the_shipped_stacks_gets_the_nic_its_type_needs() -> None:
    stacks = sorted(p.name for p in Path("stacks").glob("Pulumi.*.yaml"))
    seen = 0
    for name in stacks:
        m = load_stack(name.removeprefix("Pulumi.").removesuffix(".yaml"))
        if not any(r.pool.kind == "gcp" for r in m.regions):
            continue
        for i in run_under_mocks(m).by_type(INSTANCE["gcp"]):
            nic = i.inputs["networkInterfaces"][0].get("nicType")
            assert (nic == "GVNIC") is _needs_gvnic(i.inputs["machineType"]), (name, i.name)
            seen += 1
    assert seen >= 2  # global-cloud's A3 nodes in Frankfurt


# -- SSH host keys ---------------------------------------------------------------------------
def test_host_key_files_are_deterministic_and_openssh_reads_them(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    k = host_key_from_seed(bytes(range(32)))
    assert k == host_key_from_seed(bytes(range(32)))  # same seed, same user data
    assert k != host_key_from_seed(bytes(range(1, 33)))
    loaded = serialization.load_ssh_private_key(k.private.encode(), None)
    pub = loaded.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    assert pub.decode() == k.public and k.public.startswith("ssh-ed25519 ")
    if shutil.which("ssh-keygen"):
        f = tmp_path / "key"
        f.write_text(k.private)
        f.chmod(0o600)
        out = subprocess.run(["ssh-keygen", "-y", "-f", str(f)], capture_output=True, text=True)
        assert out.stdout.split()[:2] == k.public.split(), out.stderr


def test_each_cloud_node_has_its_own_host_key_in_user_data_and_pinned_in_its_connections(
    runs: tuple[Recording, Recording],
) -> None:
    rec = runs[0]
    conns = [r for r in rec.resources if "connection" in r.inputs]
    assert len(conns) >= 12  # a copy and an agent per node, and the gateways' wgkey
    keys: dict[str, str] = {}
    for token in INSTANCE.values():
        for inst in rec.by_type(token):
            doc = _user_data(inst)
            pub = doc["ssh_keys"]["ed25519_public"]
            assert doc["ssh_genkeytypes"] == [] and doc["ssh_deletekeys"] is True
            assert "OPENSSH PRIVATE KEY" in doc["ssh_keys"]["ed25519_private"]
            runcmd = "\n".join(doc["runcmd"])
            assert pub in runcmd and runcmd.index(pub) < runcmd.index("authorized_keys")
            keys[inst.name.split("-pool-")[1]] = pub
            secret = inst.secrets
            assert ("userData" in secret) or ("metadata" in secret), (inst.name, secret)
    assert len(set(keys.values())) == len(keys) == 6
    for c in conns:
        [node] = [n for n in keys if f"-{n}-" in c.name]  # <parent>-<node>-<role>
        assert c.inputs["connection"].get("hostKey") == keys[node], c.name
