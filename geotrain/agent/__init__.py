"""The host agent: `geotrain node apply --bundle DIR` / `geotrain node remove`, run *on* a
host (an SSH host, a cloud instance, a lab namespace) to bring it idempotently to the
state its bundle describes, and back to how it was.

Two stages, so that a fresh host needs nothing but python3:
- `bootstrap` (standard library only; runs from the wheel inside the bundle under the
  system python): verifies the bundle, installs packages, creates or checks the runtime
  venv, then runs the second stage with the venv's python;
- `apply` / `remove` (in the runtime venv: pyroute2 for netlink): users, directories,
  files, sysctl, addresses, routes, WireGuard, FRR, the firewall and systemd units.
"""
