"""`ssh`: existing hosts, reached over SSH, configured by the host agent.

Per host, two resources (three on a gateway, one more for a host whose key is not known):
- `<node>-hostkey`, only for a host whose SSH host key neither the program (clouds) nor
  the stack (`pool.ssh.host_keys`, `known_hosts`) gives: a `local.Command` running
  `ssh-keyscan` once from the operator's machine (trust on first use); its stdout, kept
  in state, is the pin from then on (triggers: the host's address and port);
- `<node>-bundle`, a `remote.CopyToRemote` of the node's bundle to
  ~/.geotrain/bundles/<digest> (triggers: the digest; a new bundle is a new copy, and a
  copy's delete removes nothing on the host);
- `<gateway>-wgkey`, the agent's `prepare`: installs packages, makes the gateway's
  WireGuard key on the host (it never leaves it) and prints only the public key, which
  flows into the peers' agent input;
- `<node>-agent`, the agent's `apply` (create and update: a new bundle changes the
  command line, so it is an update, never a create-then-delete that would remove what
  was just applied) and `node remove` (delete). Its stdin carries the run key and the
  peers' public keys: a Pulumi secret, with logging off. Its trigger is the host's
  identity (address and port): another host is a replacement, applied there before the
  old host is cleaned up.

Every connection carries the host's key (`ConnectionArgs.host_key`, ctx.host_keys):
pulumi-command checks it in the key exchange, before it authenticates or sends a
command, its stdin (the run key) or a file.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pulumi
import pulumi_random as random
from pulumi_command import local, remote

from infra.backends.base import BackendContext, Parent
from infra.components.targets import node_target
from infra.model.hostkeys import KEEP_RECORDED_KEY, pool_host_keys, scan_command
from infra.plan import PlanNode, PlanRegion
from infra.render.bundle import REPO_ROOT, render_bundle, runtime_wheel
from infra.render.host import ROLES
from infra.render.monitoring import secret_files
from training.errors import ConfigError

STORE = ".geotrain/bundles"
"""Under the login user's home: CopyToRemote's remote_path (sftp paths are relative to
it); a bundle directory named by its digest lands below it."""
AGENT_BIN = "/usr/local/sbin/geotrain-node"
CLOUD_DIAL_ERROR_LIMIT = 60
"""SSH dial attempts to a host created in this deployment (pulumi-command backs off
between attempts: about ten minutes in all)."""
CLOUD_SCAN_ATTEMPTS = 60
"""ssh-keyscan tries (10 s apart, plus up to 10 s each) for such a host's first-contact key
scan, which runs while the instance boots."""
SCAN_ATTEMPTS = 3
"""ssh-keyscan tries for an existing host listed in the stack."""


def bundle_path(digest: str) -> str:
    return f'"$HOME/{STORE}/{digest}"'


def agent_command(verb: str, digest: str, *flags: str) -> str:
    """The agent's stage one, run by the host's python3 from the bundle (sudo -n: fail at
    once, never prompt, when the login user cannot become root)."""
    b = bundle_path(digest)
    extra = "".join(f" {f}" for f in flags)
    return f"sudo -n python3 -I {b}/agent.py {verb} --bundle {b} --digest {digest}{extra}"


def remove_command(purge: bool) -> str:
    flag = " --purge" if purge else ""
    return (
        f"if [ -x {AGENT_BIN} ]; then sudo -n {AGENT_BIN} remove{flag}; fi && "
        f'rm -rf "$HOME/{STORE}" && (rmdir "$HOME/.geotrain" 2>/dev/null || true)'
    )


class SshBackend:
    kind = "ssh"
    role = ROLES["ssh"]

    def connection(self, ctx: BackendContext, node: PlanNode) -> Any:
        key_config = ctx.plan.region(node.region).pool.ssh.private_key_config
        conn = node_target(ctx.plan, node, ctx.secret(key_config)).connection
        if conn is None:
            return None
        if node.name in ctx.addresses:  # known once deployed (clouds)
            conn.host = ctx.addresses[node.name]
            # a new instance takes minutes to boot and run cloud-init before sshd lets the
            # key in: retry far longer than pulumi-command's default 10 dials
            conn.dial_error_limit = CLOUD_DIAL_ERROR_LIMIT
        # pool() pinned every node of the region before any connection is made
        conn.host_key = ctx.host_keys[node.name]
        return conn

    def pin(self, ctx: BackendContext, region: PlanRegion, parent: Parent) -> list[pulumi.Resource]:
        """Put each node's host key into ctx.host_keys: the program's (clouds), else the
        stack's, else a first-contact scan (a `<node>-hostkey` resource, returned)."""
        stack_keys = pool_host_keys(region.pool)  # the stack check has read these already
        ssh = region.pool.ssh
        out: list[pulumi.Resource] = []
        for n in region.nodes:
            if n.name in ctx.host_keys:
                continue
            if n.name in stack_keys:
                ctx.host_keys[n.name] = stack_keys[n.name]
                continue
            if ssh.strict_host_key_checking == "yes":
                # the stack check refuses this for kind ssh; a cloud host lands here when
                # its backend made no key for it
                i = [r.name for r in ctx.plan.regions].index(region.name)
                raise ConfigError(
                    f"stacks/Pulumi.{ctx.plan.stack}.yaml",
                    f"geotrain:regions[{i}].pool.ssh.strict_host_key_checking",
                    f"yes, but the {region.kind} backend gives no host key for {n.name}; "
                    "set accept-new to record the key at first contact",
                )
            cloud = n.name in ctx.addresses
            host = pulumi.Output.from_input(ctx.addresses.get(n.name, n.address))
            attempts = CLOUD_SCAN_ATTEMPTS if cloud else SCAN_ATTEMPTS
            scan = local.Command(
                f"{parent.name}-{n.name}-hostkey",
                create=host.apply(
                    functools.partial(scan_command, port=ssh.port, attempts=attempts)
                ),
                # another host (address or port) is a new first contact; the same host
                # keeps the key recorded in state, which is what makes it a pin
                # any other change (a new scan script in a new geotrain) must not scan
                # again and trust whatever answers then: it prints the recorded key
                update=KEEP_RECORDED_KEY,
                triggers=[pulumi.Output.concat(host, ":", str(ssh.port))],
                opts=parent.opts(),
            )
            ctx.host_keys[n.name] = scan.stdout
            out.append(scan)
        return out

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        plan = ctx.plan
        wheel = runtime_wheel()
        out = self.pin(ctx, region, parent)
        for n in region.nodes:
            b = render_bundle(plan, n, self.role, wheel)
            local = b.write(REPO_ROOT / ".geotrain" / plan.stack / "bundles" / b.digest)
            copy = remote.CopyToRemote(
                f"{parent.name}-{n.name}-bundle",
                connection=self.connection(ctx, n),
                source=pulumi.FileArchive(str(local)),
                remote_path=STORE,
                triggers=[b.digest],
                opts=parent.opts(),
            )
            ctx.copies[n.name], ctx.bundles[n.name] = copy, b
            out.append(copy)
        return out

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        out: list[pulumi.Resource] = []
        for r in regions:
            gw = r.gateway
            cmd = remote.Command(
                f"{parent.name}-{gw.name}-wgkey",
                connection=self.connection(ctx, gw),
                create=agent_command("prepare", ctx.bundles[gw.name].digest),
                opts=parent.opts(ctx.copies[gw.name]),
            )
            ctx.public_keys[gw.name] = cmd.stdout
            out.append(cmd)
        return out

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []  # frr.conf travels in each gateway's bundle

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        return []  # Prometheus' config travels in the monitoring host's bundle

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        # 32 random bytes made by the engine: a secret in state, never printed anywhere
        key = random.RandomBytes(f"{parent.name}-run-key", length=32, opts=parent.opts())
        return pulumi.Output.secret(key.hex)

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        plan = ctx.plan
        purge = not plan.training.checkpoint.keep_on_destroy
        out: list[pulumi.Resource] = []
        gateway_agent: pulumi.Resource | None = None
        for n in sorted(region.nodes, key=lambda x: not x.is_gateway):
            peers = (
                {
                    plan.region(t.side(region.name).peer).gateway.name: ctx.public_keys[
                        plan.region(t.side(region.name).peer).gateway.name
                    ]
                    for t in plan.tunnels_of(region.name)
                }
                if n.is_gateway
                else {}
            )
            files = secret_file_values(ctx, n, parent)
            # addresses known only once deployed, for `<address of NODE>` in the bundle
            addrs = dict(ctx.addresses)
            secrets: pulumi.Output[str] = pulumi.Output.secret(
                pulumi.Output.all(
                    run_key,
                    pulumi.Output.all(**peers) if peers else {},
                    pulumi.Output.all(**files) if files else {},
                    pulumi.Output.all(**addrs) if addrs else {},
                ).apply(
                    lambda v: json.dumps(
                        {
                            "run_key": v[0],
                            "wireguard": v[1] or {},
                            "files": v[2] or {},
                            "addresses": v[3] or {},
                        }
                    )
                )
            )
            digest = ctx.bundles[n.name].digest
            apply = agent_command("apply", digest, "--secrets-stdin")
            after = [ctx.copies[n.name]] + ([gateway_agent] if gateway_agent else [])
            agent = remote.Command(
                f"{parent.name}-{n.name}-agent",
                connection=self.connection(ctx, n),
                create=apply,
                update=apply,
                delete=remove_command(purge),
                stdin=secrets,
                logging=remote.Logging.NONE,
                triggers=[f"{n.address}:{_port(plan, n)}"],
                opts=parent.opts(*after),
            )
            if n.is_gateway:
                gateway_agent = agent  # the region's workers route through it
            out.append(agent)
        return out


def _port(plan: Any, node: PlanNode) -> int:
    return int(plan.region(node.region).pool.ssh.port)


def secret_file_values(
    ctx: BackendContext, node: PlanNode, parent: Parent
) -> dict[str, pulumi.Output[str]]:
    """Path -> content of the node's secret files, from secret Pulumi config. Grafana's
    admin password is made by the engine when the stack sets none (read it with
    `pulumi stack output --show-secrets grafana_admin_password`); a missing alerting
    credential is a warning here and a clear error from the agent."""
    wanted = ctx.bundles[node.name].host.secret_files
    if not wanted:
        return {}
    keys = {f.path: f.config_key for f in secret_files(ctx.plan)}
    out: dict[str, pulumi.Output[str]] = {}
    for f in wanted:
        key = keys[f.path]
        value = ctx.secret(key)
        if value is None and f.path.endswith("/admin-password"):
            generated = random.RandomPassword(
                f"{parent.name}-grafana-admin-password",
                length=24,
                special=False,
                opts=parent.opts(),
            )
            ctx.grafana_password = generated.result
            value = generated.result
        if value is None:
            pulumi.log.warn(f"{key} is not set: set it with `pulumi config set --secret {key}`")
            continue
        out[f.path] = value
    return out
