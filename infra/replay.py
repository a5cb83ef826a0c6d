"""Deployments without the Pulumi engine: the program runs under `set_mocks`, and every
command, copy and random resource it registers is carried out for real, following the
semantics of pulumi-command (provider/pkg/provider/remote in pulumi/pulumi-command):

- a new resource is created (remote.Command: its `create` over SSH; CopyToRemote: the
  source copied with sftp; RandomBytes: fresh random bytes);
- unchanged inputs: nothing runs, the outputs are the stored ones;
- changed inputs listed in the resource's replaceOnChanges (`triggers[*]`): a
  replacement, created before the old one is deleted (unless deleteBeforeReplace), the
  deletes deferred to the end of the deployment;
- other changed inputs: an update (Command: `update`, else `create` again; CopyToRemote:
  copy again when the source or path changed);
- a resource no longer registered: deleted (Command: the stored `delete`, over the stored
  connection; CopyToRemote: nothing, as pulumi-command removes no remote files);
- deletes run dependents first;
- a local command's update and delete see the previous stdout and stderr in
  PULUMI_COMMAND_STDOUT and PULUMI_COMMAND_STDERR (addPreviousOutputInEnv, on by default);
- a connection's `hostKey` is checked as the provider checks it: that key only, refused
  in the key exchange before anything is sent; without one, any host key is accepted.

Registrations arrive as the engine would send them: after the resources they depend on
(data or depends_on) are done, concurrently otherwise. The state (inputs and outputs of
every resource) is kept in a JSON file between deployments, like a Pulumi state file;
it holds secrets, so it is written 0600.

This is how the SSH integration test deploys the ssh stack to namespace hosts. It is a
stand-in for the engine, not for the program: the program, its components and the
provider semantics above are the real ones; the engine's own behaviour (previews,
refresh, parallelism limits, state encryption) is not covered.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets as pysecrets
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import rpc, settings
from pulumi.runtime.mocks import MockMonitor, Mocks
from pulumi.runtime.proto import resource_pb2
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.mocks import config_of, unsecret
from infra.model.schema import StackModel
from training.errors import GeotrainError

CUSTOM_TYPES = (
    "command:remote:Command",
    "command:remote:CopyToRemote",
    "command:local:Command",
    "random:index/randomBytes:RandomBytes",
)


class DeploymentError(GeotrainError):
    """A resource's create, update or delete failed (as `pulumi up` would report it)."""


@dataclass
class Stored:
    urn: str
    type: str
    name: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    dependencies: list[str] = field(default_factory=list)
    replace_on_changes: list[str] = field(default_factory=list)
    delete_before_replace: bool = False


@dataclass
class Step:
    op: str
    """create | update | replace | delete | same."""
    urn: str
    name: str


@dataclass
class Deployment:
    steps: list[Step] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    def ops(self, op: str) -> list[str]:
        return [s.name for s in self.steps if s.op == op]

    def changed(self) -> list[Step]:
        return [s for s in self.steps if s.op != "same"]


class Executor:
    """Runs what the providers would: commands over SSH, copies with sftp, locally."""

    def __init__(self, prefix: tuple[str, ...] = (), timeout: float = 600) -> None:
        self.prefix = prefix
        """Prepended to ssh/sftp (e.g. `ip netns exec OPERATOR` to reach test hosts)."""
        self.timeout = timeout

    @contextlib.contextmanager
    def _key(self, conn: dict[str, Any]) -> Iterator[list[str]]:
        with tempfile.TemporaryDirectory(prefix="geotrain-ssh-") as tmp:
            key = Path(tmp) / "id"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(str(conn.get("privateKey") or "").rstrip("\n") + "\n")
            yield [
                "-F", "/dev/null",
                "-i", str(key),
                "-o", "BatchMode=yes",
                *_host_key_options(conn, Path(tmp) / "known_hosts"),
                "-o", "LogLevel=ERROR",
                "-o", "ConnectTimeout=10",
            ]  # fmt: skip

    def ssh(self, conn: dict[str, Any], command: str, stdin: str | None) -> tuple[str, str]:
        with self._key(conn) as opts:
            argv = [
                *self.prefix, "ssh", *opts, "-p", str(int(conn.get("port") or 22)),
                f"{conn['user']}@{conn['host']}", command,
            ]  # fmt: skip
            r = subprocess.run(
                argv, input=stdin or "", capture_output=True, text=True, timeout=self.timeout
            )
        if r.returncode != 0:
            raise DeploymentError(
                f"{conn['host']}: command exited {r.returncode}: "
                f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ''}"
            )
        return r.stdout.removesuffix("\n"), r.stderr.removesuffix("\n")

    def copy(self, conn: dict[str, Any], source: str, remote_path: str) -> None:
        """pulumi-command's sftpCopy for a directory without a trailing slash: into
        remote_path/<basename>, creating directories, overwriting files."""
        src = Path(source)
        dest = f"{remote_path.rstrip('/')}/{src.name}"
        batch = [f"-mkdir {_sftp_quote(p)}" for p in _parents(remote_path)]
        batch.append(f"-mkdir {_sftp_quote(dest)}")
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src).as_posix()
            if p.is_dir():
                batch.append(f"-mkdir {_sftp_quote(dest + '/' + rel)}")
            else:
                batch.append(f"put {_sftp_quote(str(p))} {_sftp_quote(dest + '/' + rel)}")
        with self._key(conn) as opts, tempfile.NamedTemporaryFile("w", suffix=".sftp") as f:
            f.write("\n".join(batch) + "\n")
            f.flush()
            argv = [
                *self.prefix, "sftp", *opts, "-b", f.name, "-P", str(int(conn.get("port") or 22)),
                f"{conn['user']}@{conn['host']}",
            ]  # fmt: skip
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout)
        if r.returncode != 0:
            raise DeploymentError(f"{conn['host']}: sftp copy of {source} failed: {r.stderr}")

    def local(
        self, command: str, stdin: str | None, previous: dict[str, Any] | None = None
    ) -> tuple[str, str]:
        """A command on the operator's machine: behind the prefix too, as the operator's
        network is where it reaches the hosts from (the first-contact key scan).
        `previous`: the outputs of the prior create/update, for an update or a delete."""
        env = dict(os.environ)
        for key, out in (("PULUMI_COMMAND_STDOUT", "stdout"), ("PULUMI_COMMAND_STDERR", "stderr")):
            if (previous or {}).get(out):  # the provider sets only non-empty ones
                env[key] = str((previous or {})[out])
        r = subprocess.run(
            [*self.prefix, "/bin/sh", "-c", command],
            input=stdin or "",
            capture_output=True,
            text=True,
            timeout=self.timeout,
            env=env,
        )
        if r.returncode != 0:
            raise DeploymentError(f"local command exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout.removesuffix("\n"), r.stderr.removesuffix("\n")


def _host_key_options(conn: dict[str, Any], known_hosts: Path) -> list[str]:
    """pulumi-command's host key check in OpenSSH terms. With `hostKey`: the key is the
    only one known for the host (`[host]:port` as OpenSSH files it), anything else is
    refused during the key exchange, before authentication, and the host key algorithm is
    the key's own type (the provider's HostKeyAlgorithms). Without: any key is accepted
    (the provider's InsecureIgnoreHostKey)."""
    pin = conn.get("hostKey")
    if not pin:
        return ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    fields = str(pin).split()
    if len(fields) < 2:
        raise DeploymentError(f"{conn['host']}: failed to parse host key {str(pin)[:40]!r}")
    port = int(conn.get("port") or 22)
    name = conn["host"] if port == 22 else f"[{conn['host']}]:{port}"
    known_hosts.write_text(f"{name} {fields[0]} {fields[1]}\n")
    return [
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", f"HostKeyAlgorithms={fields[0]}",
        "-o", "CheckHostIP=no",
    ]  # fmt: skip


def _parents(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    prefix = "/" if path.startswith("/") else ""
    return [prefix + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _sftp_quote(s: str) -> str:
    return '"' + s.replace('"', '\\"') + '"'


class Providers:
    """create/update/delete per resource type, as the providers implement them."""

    def __init__(self, ex: Executor) -> None:
        self.ex = ex

    def create(self, typ: str, inputs: dict[str, Any]) -> dict[str, Any]:
        if typ == "random:index/randomBytes:RandomBytes":
            raw = pysecrets.token_bytes(int(inputs["length"]))
            return {"hex": raw.hex(), "base64": base64.b64encode(raw).decode()}
        if typ == "command:remote:CopyToRemote":
            self.ex.copy(
                inputs["connection"], _archive_path(inputs["source"]), inputs["remotePath"]
            )
            return {}
        return self._run(typ, inputs, inputs.get("create"))

    def update(self, typ: str, old: Stored, inputs: dict[str, Any]) -> dict[str, Any]:
        if typ == "command:remote:CopyToRemote":
            if (
                _archive_hash(inputs["source"]) != _archive_hash(old.inputs["source"])
                or inputs["remotePath"] != old.inputs["remotePath"]
            ):
                return self.create(typ, inputs)
            return {}
        if typ.startswith("command:"):
            cmd = inputs.get("update") or inputs.get("create")
            return self._run(typ, inputs, cmd, old.outputs)
        return self.create(typ, inputs)

    def delete(self, old: Stored) -> None:
        if old.type in ("command:remote:Command", "command:local:Command"):
            cmd = old.inputs.get("delete")
            if cmd:
                self._exec(old.type, old.inputs, cmd, old.outputs)

    def _run(
        self,
        typ: str,
        inputs: dict[str, Any],
        cmd: str | None,
        previous: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if not cmd:
            return {"stdout": "", "stderr": ""}
        out, err = self._exec(typ, inputs, cmd, previous)
        return {"stdout": out, "stderr": err}

    def _exec(
        self,
        typ: str,
        inputs: dict[str, Any],
        cmd: str,
        previous: dict[str, Any] | None = None,
    ) -> tuple[str, str]:
        if typ == "command:local:Command":
            return self.ex.local(cmd, inputs.get("stdin"), previous)
        return self.ex.ssh(inputs["connection"], cmd, inputs.get("stdin"))


def _archive_path(source: Any) -> str:
    if isinstance(source, pulumi.FileArchive):
        return str(source.path)
    if isinstance(source, dict) and "$archive" in source:
        return str(source["$archive"])
    if isinstance(source, dict) and "path" in source:
        return str(source["path"])
    raise DeploymentError(f"CopyToRemote source {source!r} is not a directory archive")


def _archive_hash(source: Any) -> str:
    """What the engine diffs an archive by: its content (relative paths and bytes)."""
    if isinstance(source, dict) and "$hash" in source:
        return str(source["$hash"])
    try:
        root = Path(_archive_path(source))
    except DeploymentError:
        return json.dumps(source, sort_keys=True, default=str)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _plain(value: Any) -> Any:
    """Inputs as comparable JSON: secrets unwrapped, archives by path and content."""
    value = unsecret(value)
    if isinstance(value, pulumi.FileArchive):
        return {"$archive": str(value.path), "$hash": _archive_hash(value)}
    if isinstance(value, dict):
        if "$archive" in value:
            return value
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class ReplayMonitor(MockMonitor):
    """A mock monitor that carries out each registration against the stored state."""

    def __init__(self, mocks: Mocks, prior: dict[str, Stored], providers: Providers) -> None:
        super().__init__(mocks)
        self.prior = prior
        self.now: dict[str, Stored] = {}
        self.providers = providers
        self.deployment = Deployment()
        self.pending_deletes: list[Stored] = []
        self.lock = threading.Lock()

    def RegisterResource(self, request: Any) -> Any:
        urn = self.make_urn(request.parent, request.type, request.name)
        if request.type == "pulumi:pulumi:Stack" or not request.custom:
            return resource_pb2.RegisterResourceResponse(urn=urn)
        if request.type not in CUSTOM_TYPES:
            raise DeploymentError(f"{request.type} ({request.name}) cannot be replayed here")
        inputs = _plain(rpc.deserialize_properties(request.object))
        new = Stored(
            urn=urn,
            type=request.type,
            name=request.name,
            inputs=inputs,
            outputs={},
            dependencies=sorted(set(request.dependencies)),
            replace_on_changes=list(request.replaceOnChanges),
            delete_before_replace=bool(request.deleteBeforeReplace),
        )
        old = self.prior.get(urn)
        op = _diff(old, new)
        try:
            if op == "same":
                assert old is not None
                new.outputs = old.outputs
            elif op == "create":
                new.outputs = self.providers.create(new.type, inputs)
            elif op == "update":
                assert old is not None
                new.outputs = {**old.outputs, **self.providers.update(new.type, old, inputs)}
            else:  # replace
                assert old is not None
                if new.delete_before_replace:
                    self.providers.delete(old)
                    new.outputs = self.providers.create(new.type, inputs)
                else:
                    new.outputs = self.providers.create(new.type, inputs)
                    with self.lock:
                        self.pending_deletes.append(old)
        except DeploymentError as e:
            raise DeploymentError(f"{op} of {new.name} ({new.type}) failed: {e}") from None
        with self.lock:
            self.now[urn] = new
            self.deployment.steps.append(Step(op, urn, new.name))
        state = {**inputs, **new.outputs}
        obj = _sync_await(rpc.serialize_properties(state, {}))
        return resource_pb2.RegisterResourceResponse(urn=urn, id=f"{request.name}-id", object=obj)

    def finish(self) -> None:
        """The deletes: replaced resources and those no longer registered, dependents
        first."""
        gone = [s for urn, s in self.prior.items() if urn not in self.now]
        for s in _dependents_first([*self.pending_deletes, *gone], {**self.prior}):
            try:
                self.providers.delete(s)
            except DeploymentError as e:
                raise DeploymentError(f"delete of {s.name} ({s.type}) failed: {e}") from None
            self.deployment.steps.append(Step("delete", s.urn, s.name))


def _diff(old: Stored | None, new: Stored) -> str:
    if old is None:
        return "create"
    if old.inputs == new.inputs:
        return "same"
    if new.type.startswith("random:"):
        return "replace"  # every input of a random resource forces a new value
    keys = {p.split("[", 1)[0].split(".", 1)[0] for p in new.replace_on_changes}
    if any(old.inputs.get(k) != new.inputs.get(k) for k in keys):
        return "replace"
    return "update"


def _dependents_first(items: list[Stored], known: dict[str, Stored]) -> list[Stored]:
    """Order deletes so a resource goes before what it depends on."""
    urns = {s.urn for s in items}
    order: list[Stored] = []
    seen: set[int] = set()

    def visit(s: Stored) -> None:
        if id(s) in seen:
            return
        seen.add(id(s))
        for other in items:  # those that depend on s go first
            if s.urn in other.dependencies and other.urn in urns:
                visit(other)
        order.append(s)

    for s in reversed(items):
        visit(s)
    return order


class NullMocks(Mocks):
    def new_resource(self, args: Any) -> tuple[str | None, dict[str, Any]]:
        return None, {}

    def call(self, args: Any) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        return {}, None


@dataclass
class Replay:
    """A stack's deployments, one after another, with their state in `state_file`."""

    state_file: Path
    executor: Executor
    secrets: dict[str, str] = field(default_factory=dict)
    """Secret config (e.g. geotrain:sshPrivateKey) as `pulumi config set --secret` would."""

    def load(self) -> dict[str, Stored]:
        if not self.state_file.exists():
            return {}
        return {k: Stored(**v) for k, v in json.loads(self.state_file.read_text()).items()}

    def save(self, state: dict[str, Stored]) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: asdict(v) for k, v in state.items()}, f, indent=1, default=str)

    def up(
        self, model: StackModel, program: Callable[[StackModel], dict[str, Any]] | None = None
    ) -> Deployment:
        """`pulumi up`: run the program (geotrain's, unless another is given), carry out
        its steps, save the state."""
        if program is None:
            from infra.program import program as geotrain_program

            program = geotrain_program

        prior = self.load()
        monitor = ReplayMonitor(NullMocks(), prior, Providers(self.executor))
        config = {**config_of(model), **self.secrets}
        pulumi.runtime.set_all_config(config, list(self.secrets))
        pulumi.runtime.set_mocks(
            NullMocks(), project="geotrain", stack=model.stack, preview=False, monitor=monitor
        )
        result: dict[str, Any] = {}

        run = program

        def body() -> None:
            exports = run(model)
            resolved: Any = _sync_await(pulumi.Output.all(**exports).future())
            result.update(resolved or {})

        try:
            _sync_await(run_pulumi_func(body))
        except Exception as e:  # the engine stops at the first failed step and keeps state
            _settle_outputs(self.executor.timeout)
            self.save({**prior, **monitor.now})
            raise _first_deployment_error(e) from None
        monitor.finish()
        self.save(monitor.now)
        monitor.deployment.outputs = result
        return monitor.deployment

    def destroy(self) -> Deployment:
        """`pulumi destroy`: delete every resource, dependents first."""
        prior = self.load()
        providers = Providers(self.executor)
        d = Deployment()
        for s in _dependents_first(list(prior.values()), prior):
            providers.delete(s)
            d.steps.append(Step("delete", s.urn, s.name))
        self.save({})
        return d


def _settle_outputs(timeout: float) -> None:
    """After a failed run: let the rest of its output tasks finish and keep their errors.
    The SDK's set of pending outputs outlives set_mocks, so the next `up` would otherwise
    await them and raise this run's failure again; and a failure nobody retrieves is
    logged by asyncio when it is collected, in the middle of whatever runs then."""

    async def settle() -> None:
        outputs = settings.SETTINGS.outputs
        while outputs:
            pending = list(outputs)
            outputs.clear()
            _, stuck = await asyncio.wait(pending, timeout=timeout)
            for t in stuck:  # a step still running after the deployment failed
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    _sync_await(settle())
    asyncio.get_event_loop().set_exception_handler(_quiet_reported_failures)


def _quiet_reported_failures(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The SDK also puts a failed step's error into each output future of its resource,
    which nothing awaits once the run is over; asyncio would log every one when it is
    collected. The error was raised to the caller already: drop those, log the rest."""
    if isinstance(context.get("exception"), DeploymentError) and "never retrieved" in str(
        context.get("message")
    ):
        return
    loop.default_exception_handler(context)


def _first_deployment_error(e: BaseException) -> BaseException:
    x: BaseException | None = e
    while x is not None:
        if isinstance(x, DeploymentError):
            return x
        x = x.__cause__ or x.__context__
    return DeploymentError(str(e).strip().splitlines()[-1] if str(e).strip() else repr(e))
