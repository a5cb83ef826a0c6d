"""What one host must look like: the `host.json` inside every bundle.

Rendered by `infra.render.bundle` from the stack's plan; read by the agent. Standard
library only (the agent's first stage runs on a bare python3). Paths named `src` are
inside the bundle, paths named `dest`/`path` are on the host.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, get_args, get_origin, get_type_hints

HOSTSPEC_FORMAT = 1
HOSTSPEC_FILE = "host.json"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class DirSpec:
    path: str
    """Directory on the host."""
    owner: str = "root"
    """Owner (user name)."""
    group: str = "root"
    """Group name."""
    mode: str = "0755"
    """Octal mode."""
    keep_on_remove: bool = False
    """`node remove` keeps it when it holds data (checkpoints) unless --purge is given."""
    adopt: bool = True
    """Whether the agent may change the owner and mode of a directory that exists with files
    in it and that it did not make. False for a directory the user names (the checkpoint
    dir): a stack that points it at a home or a data disk must not take that from its
    users."""


@dataclass(frozen=True)
class FileSpec:
    src: str
    """File inside the bundle."""
    dest: str
    """Where it goes on the host; a file that was there before is backed up and restored
    by `node remove`."""
    mode: str = "0644"
    """Octal mode."""
    owner: str = "root"
    """Owner."""
    group: str = "root"
    """Group."""


@dataclass(frozen=True)
class AddressSpec:
    address: str
    """CIDR to assign, e.g. 10.42.1.1/24 (the node's address in its region subnet)."""
    interface: str | None = None
    """Interface to put it on; None: the interface that holds `near`, else the one of the
    default route."""
    near: str | None = None
    """An address the host already has on the wanted interface (its underlay address)."""


@dataclass(frozen=True)
class Mirrors:
    """Where a host gets the runtime's Python packages when the public indexes are slow
    or unreachable (mainland China). apt keeps the host's own sources: a cloud's images
    already point at its mirror, and an SSH host's are its operator's."""

    pip_index_url: str | None = None
    """A PyPI mirror (`pip install --index-url`), e.g. https://mirrors.aliyun.com/pypi/simple/."""
    torch_index_url: str | None = None
    """A mirror of https://download.pytorch.org/whl: the CUDA build's tag is appended
    (<url>/cu128), as on PyTorch's own index."""


@dataclass(frozen=True)
class RouteSpec:
    dst: str
    """Destination CIDR."""
    via: str
    """Next hop."""


@dataclass(frozen=True)
class TunnelSpec:
    ifname: str
    """WireGuard interface (wg-quick@<ifname>)."""
    src: str
    """wg-quick config inside the bundle; `PublicKey = <public key of NODE>` placeholders
    are filled from the peers' public keys given to `apply` on stdin."""
    peer_node: str
    """The peer gateway whose public key this tunnel needs."""


@dataclass(frozen=True)
class FrrSpec:
    src: str
    """frr.conf inside the bundle (goes to /etc/frr/frr.conf)."""
    daemons: dict[str, str] = field(default_factory=dict)
    """Settings changed in Debian's /etc/frr/daemons (the rest of that file is kept)."""


@dataclass(frozen=True)
class RepoSpec:
    name: str
    """Stem of /etc/apt/sources.list.d/<name>.list and /etc/apt/keyrings/<name>.asc."""
    line: str
    """sources.list line; `{keyring}`, `{distro}` (debian12, ubuntu2204, ...) and `{arch}`
    (x86_64, sbsa) are filled in on the host."""
    key_url: str
    """Its signing key (ASCII armoured; apt reads .asc keyrings)."""


@dataclass(frozen=True)
class SecretFileSpec:
    path: str
    """File on the host; its content comes from stdin (`files` of the secrets JSON)."""
    owner: str = "root"
    """Owner."""
    group: str = "root"
    """Group that must read it (mode 0640)."""
    config_key: str = ""
    """The secret Pulumi config key it comes from (named in errors)."""


@dataclass(frozen=True)
class UnitSpec:
    name: str
    """systemd unit name."""
    src: str | None = None
    """Unit file inside the bundle (goes to /etc/systemd/system); None: a packaged unit."""
    enable: bool = True
    """Enable it (start at boot)."""
    start: bool = True
    """Start it during apply."""
    restart_on: tuple[str, ...] = ()
    """Bundle files (or `run-key`, `runtime`) whose change restarts the unit."""
    run_once: bool = False
    """A job that exits when done (the worker): started once per change, not every apply."""
    check: str | None = None
    """Command that must pass before the unit is (re)started with changed files."""


@dataclass(frozen=True)
class HostSpec:
    stack: str
    """Stack the bundle was rendered from."""
    node: str
    """This host's node name."""
    region: str
    """Its region."""
    run_id: str
    """The training run this host serves."""
    packages: tuple[str, ...] = ()
    """Debian packages the host needs (installed with apt when missing)."""
    repos: tuple[RepoSpec, ...] = ()
    """apt repositories added before packages are installed (Grafana's)."""
    secret_files: tuple[SecretFileSpec, ...] = ()
    """Files whose content arrives on stdin (alerting credentials, Grafana's password)."""
    service_user: str = "geotrain"
    """System user the workers run as (created when missing)."""
    dirs: tuple[DirSpec, ...] = ()
    """Directories to create."""
    files: tuple[FileSpec, ...] = ()
    """Files to install."""
    sysctl_src: str | None = None
    """sysctl.d file inside the bundle (gateways: forwarding)."""
    addresses: tuple[AddressSpec, ...] = ()
    """Private addresses."""
    routes: tuple[RouteSpec, ...] = ()
    """Static routes (workers: the overlay via their gateway)."""
    tunnels: tuple[TunnelSpec, ...] = ()
    """WireGuard tunnels (gateways)."""
    wireguard_key_dir: str = "/etc/geotrain/wireguard"
    """Where the gateway's private key is generated; it never leaves the host."""
    frr: FrrSpec | None = None
    """FRR config (gateways)."""
    units: tuple[UnitSpec, ...] = ()
    """systemd units, in start order."""
    run_key_path: str | None = None
    """Where the run key (from stdin) is written, mode 0400, owned by service_user."""
    mirrors: Mirrors | None = None
    """Package indexes to install the runtime from instead of the public ones."""
    format: int = HOSTSPEC_FORMAT
    """host.json format version."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str) -> HostSpec:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != HOSTSPEC_FORMAT:
            raise ValueError(
                f"host.json format {raw.get('format') if isinstance(raw, dict) else '?'} "
                f"is not {HOSTSPEC_FORMAT}"
            )
        return _build(HostSpec, raw)


def _build(cls: Any, raw: Any) -> Any:
    """A (nested, frozen) dataclass from JSON: lists become tuples, dicts dataclasses."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        kwargs[f.name] = _value(hints[f.name], raw[f.name])
    unknown = set(raw) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    return cls(**kwargs)


def _value(tp: Any, v: Any) -> Any:
    origin = get_origin(tp)
    args = [a for a in get_args(tp) if a is not type(None)]
    if v is None:
        return None
    if origin is tuple:
        return tuple(_value(args[0], x) for x in v)
    if origin is dict:
        return dict(v)
    if is_dataclass(tp):
        return _build(tp, v)
    if args and is_dataclass(args[0]):  # Optional[Dataclass]
        return _build(args[0], v)
    return v
