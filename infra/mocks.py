"""Run the Pulumi program with no engine and no cloud: `pulumi.runtime.set_mocks` plus a
monitor that records every registration (type token, name, parent, inputs).

Used by `geotrain graph` (what `pulumi up` would create), `geotrain check` (policies on
the same resources) and the tests. Command resources get a deterministic fake stdout so
values that flow through outputs (public keys, the run key) resolve.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
from pulumi.runtime.mocks import MockMonitor, MockResourceArgs, Mocks
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.model.load import PREFIX, TOP_KEYS
from infra.model.schema import StackModel

COMMAND_TYPES = ("command:local:Command", "command:remote:Command")
RANDOM_BYTES = "random:index/randomBytes:RandomBytes"
CLOUD_IDS = {
    "aws:ec2/vpc:Vpc": "vpc",
    "aws:ec2/subnet:Subnet": "subnet",
    "aws:ec2/internetGateway:InternetGateway": "igw",
    "aws:ec2/routeTable:RouteTable": "rtb",
    "aws:ec2/securityGroup:SecurityGroup": "sg",
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": "sgr",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": "sgr",
    "aws:ec2/eip:Eip": "eipalloc",
    "aws:ec2/instance:Instance": "i",
    "aws:ec2/vpcPeeringConnection:VpcPeeringConnection": "pcx",
    "alicloud:vpc/network:Network": "vpc",
    "alicloud:vpc/switch:Switch": "vsw",
    "alicloud:ecs/securityGroup:SecurityGroup": "sg",
    "alicloud:ecs/eipAddress:EipAddress": "eip",
    "alicloud:ecs/instance:Instance": "i",
    "alicloud:ecs/ecsDeploymentSet:EcsDeploymentSet": "ds",
    "alicloud:vpc/peerConnection:PeerConnection": "pcc",
    "aws:ebs/volume:Volume": "vol",
    "alicloud:ecs/ecsDisk:EcsDisk": "d",
}
"""Cloud resource types -> the prefix of the ids their provider returns (vpc-0123...)."""
MOCK_PUBLIC_NETS = {"aws": "203.0.113", "gcp": "198.51.100", "alicloud": "192.0.2"}
"""Stand-in public IPs per cloud (RFC 5737 documentation ranges: never routed), host .10
and up, so nothing here ever collides with this machine's 192.0.2.2."""


@dataclass
class Registered:
    urn: str
    parent: str | None
    type: str
    name: str
    custom: bool
    inputs: dict[str, Any]
    provider: str | None = None
    secrets: list[str] = field(default_factory=list)
    """Input keys whose values were Pulumi secrets (encrypted in state, hidden in logs)."""
    ignore_changes: list[str] = field(default_factory=list)
    """Input paths the engine keeps as the resource was made (ResourceOptions)."""
    retain_on_delete: bool = False
    """The engine leaves the cloud resource in place when it deletes it from the stack."""
    delete_before_replace: bool = False
    """A replacement deletes the old resource first."""
    id: str = ""
    """The id the (mock) provider gave the resource."""


@dataclass
class Recording:
    resources: list[Registered] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def by_type(self, token: str) -> list[Registered]:
        return [r for r in self.resources if r.type == token]


class GeotrainMocks(Mocks):
    """Provider-like answers; `epoch` is the clouds' catalogue as of a later day: from 1
    on, the image look-ups name newer images and the zone look-ups other zones (what a
    `pulumi up` a month later may hear)."""

    def new_resource(self, args: MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        state = dict(args.inputs)
        if args.typ in COMMAND_TYPES:
            # a stand-in public key: 44 base64-like chars derived from the name
            state["stdout"] = hashlib.sha256(args.name.encode()).hexdigest()[:43] + "="
            state["stderr"] = ""
        if args.typ == RANDOM_BYTES:
            # a stand-in run key (deterministic, so graphs and checks are repeatable)
            state["hex"] = hashlib.sha256(args.name.encode()).hexdigest()
        cloud = args.typ.split(":", 1)[0]
        if cloud not in MOCK_PUBLIC_NETS:
            return f"{args.name}-id", state
        # cloud resources: ids, addresses and links as the providers return them,
        # derived from the name so every run gives the same graph
        digest = hashlib.sha256(args.name.encode()).hexdigest()
        ip = f"{MOCK_PUBLIC_NETS[cloud]}.{10 + int(digest[:4], 16) % 240}"
        rid = f"{CLOUD_IDS[args.typ]}-{digest[:17]}" if args.typ in CLOUD_IDS else None
        if args.typ.startswith("pulumi:providers:"):
            self.regions[f"{args.name}-id"] = str(state.get("region", ""))
        elif args.typ == "aws:ec2/instance:Instance":
            state.update(
                publicIp=ip if state.get("associatePublicIpAddress") else "",
                privateIp=state.get("privateIp", ""),
                primaryNetworkInterfaceId=f"eni-{digest[:17]}",
                arn=f"arn:aws:ec2:::instance/{rid}",
            )
        elif args.typ == "aws:ec2/eip:Eip":
            state.update(publicIp=ip, allocationId=rid)
        elif args.typ == "aws:ec2/vpc:Vpc":
            state["mainRouteTableId"] = f"rtb-{digest[:17]}"
        elif args.typ == "alicloud:vpc/network:Network":
            state["routeTableId"] = f"vtb-{digest[:17]}"
        elif args.typ == "alicloud:ecs/eipAddress:EipAddress":
            state["ipAddress"] = ip
        elif args.typ == "alicloud:ecs/instance:Instance":
            state["publicIp"] = ip if state.get("internetMaxBandwidthOut") else ""
        elif args.typ == "gcp:compute/address:Address":
            state["address"] = ip
        elif args.typ == "gcp:compute/instance:Instance":
            nics = state.get("networkInterfaces") or [{}]
            for nic in nics:
                for ac in nic.get("accessConfigs") or []:
                    ac["natIp"] = ac.get("natIp") or ip
            state.update(networkInterfaces=nics, instanceId=str(int(digest[:15], 16)))
        if args.typ.startswith("gcp:"):
            rid = f"projects/mock/{args.typ.split(':')[-1].lower()}s/{args.name}"
            state["selfLink"] = f"https://www.googleapis.com/compute/v1/{rid}"
        return rid or f"{args.name}-id", state

    def __init__(self, epoch: int = 0) -> None:
        super().__init__()
        self.regions: dict[str, str] = {}
        """Provider id -> its cloud region, for data sources asked through it."""
        self.epoch = epoch

    def call(self, args: Any) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        # the data sources the cloud backends read at deploy time (failures: none; the
        # mock monitor iterates them, so never None)
        region = self.regions.get(str(args.provider).rsplit("::", 1)[-1], "")
        a = args.args
        later = "" if not self.epoch else f"@{self.epoch}"
        if args.token == "aws:ssm/getParameter:getParameter":
            seed = f"{region}{a['name']}{later}"
            ami = "ami-" + hashlib.sha256(seed.encode()).hexdigest()[:17]
            return {"id": a["name"], "name": a["name"], "type": "String", "value": ami}, []
        if args.token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            types = [v for f in a.get("filters", []) for v in f["values"]]
            letters = "ab"[self.epoch % 2 :] + "c"  # later: zone a no longer offers them
            zones = [f"{a.get('region') or region}{z}" for z in letters]
            pairs = [(z, t) for z in zones for t in types]
            return {
                "id": region,
                "locations": [z for z, _ in pairs],
                "instanceTypes": [t for _, t in pairs],
                "locationTypes": ["availability-zone"] * len(pairs),
            }, []
        if args.token == "alicloud:index/getZones:getZones":
            ids = [f"{region}-{z}" for z in ("hi", "ij")[self.epoch % 2]]
            return {"id": region, "ids": ids, "zones": []}, []
        if args.token == "alicloud:ecs/getImages:getImages":
            image = f"ubuntu_24_04_x64_20G_alibase_2025{1 + self.epoch:02d}01.vhd"
            return {"id": region, "ids": [image], "images": []}, []
        if args.token == "gcp:compute/getImage:getImage":
            name = f"{a['family']}-v2025{1 + self.epoch:02d}01"
            link = f"https://www.googleapis.com/compute/v1/projects/{a.get('project')}"
            link += f"/global/images/{name}"
            return {"id": link, "name": name, "family": a["family"], "selfLink": link}, []
        return {}, []


class RecordingMonitor(MockMonitor):
    def __init__(self, mocks: Mocks, recording: Recording) -> None:
        super().__init__(mocks)
        self.recording = recording

    def RegisterResource(self, request: Any) -> Any:
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            state = self.resources[response.urn].state if response.urn in self.resources else {}
            self.recording.resources.append(
                Registered(
                    urn=response.urn,
                    parent=request.parent or None,
                    type=request.type,
                    name=request.name,
                    custom=bool(request.custom),
                    inputs=unsecret(dict(state)),
                    secrets=sorted(
                        k for k, v in state.items() if isinstance(v, dict) and SECRET_SIG in v
                    ),
                    provider=request.provider or None,
                    ignore_changes=list(request.ignoreChanges),
                    retain_on_delete=bool(request.retainOnDelete),
                    delete_before_replace=bool(request.deleteBeforeReplace),
                    id=str(getattr(response, "id", "") or ""),
                )
            )
        return response


SECRET_SIG = "4dabf18193072939515e22adb298388d"
"""Pulumi's signature key of a serialized secret ({sig: secret-sig, "value": ...})."""


def unsecret(value: Any) -> Any:
    """Inputs as plain values: secrets arrive wrapped in a signature dict under mocks."""
    if isinstance(value, dict):
        if SECRET_SIG in value and "value" in value:
            return unsecret(value["value"])
        return {k: unsecret(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unsecret(v) for v in value]
    return value


def run_under_mocks(model: StackModel, epoch: int = 0) -> Recording:
    """Run the program for `model` under mocks and return what it registered; `epoch`:
    GeotrainMocks'."""
    from infra.program import program

    recording = Recording()
    mocks = GeotrainMocks(epoch)
    pulumi.runtime.set_all_config(config_of(model))
    pulumi.runtime.set_mocks(
        mocks,
        project="geotrain",
        stack=model.stack,
        preview=False,
        monitor=RecordingMonitor(mocks, recording),
    )

    def body() -> None:
        exports = program(model)
        resolved = _sync_await(pulumi.Output.all(**exports).future())
        recording.outputs.update(resolved or {})

    _sync_await(run_pulumi_func(body))
    return recording


def config_of(model: StackModel) -> dict[str, str]:
    """The model as Pulumi config, so code that reads config under mocks sees the stack."""
    raw = model.model_dump(mode="json")
    return {PREFIX + k: json.dumps(raw[k]) for k in TOP_KEYS}
