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


@dataclass
class Recording:
    resources: list[Registered] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def by_type(self, token: str) -> list[Registered]:
        return [r for r in self.resources if r.type == token]


class GeotrainMocks(Mocks):
    def new_resource(self, args: MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        state = dict(args.inputs)
        if args.typ in COMMAND_TYPES:
            # a stand-in public key: 44 base64-like chars derived from the name
            state["stdout"] = hashlib.sha256(args.name.encode()).hexdigest()[:43] + "="
            state["stderr"] = ""
        if args.typ == RANDOM_BYTES:
            # a stand-in run key (deterministic, so graphs and checks are repeatable)
            state["hex"] = hashlib.sha256(args.name.encode()).hexdigest()
        return f"{args.name}-id", state

    def call(self, args: Any) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        return {}, None


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


def run_under_mocks(model: StackModel) -> Recording:
    """Run the program for `model` under mocks and return what it registered."""
    from infra.program import program

    recording = Recording()
    mocks = GeotrainMocks()
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
