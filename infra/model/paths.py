"""Fixed paths on hosts and pods that more than one layer names.

The model's checks refuse a run key that would overwrite one of the agent's files in
/etc/geotrain, the renderers write those files: both read the paths from here.
"""

from __future__ import annotations

ETC = "/etc/geotrain"
"""What the host agent manages on a host."""
REMOTE_SPEC_PATH = f"{ETC}/launch-spec.json"
"""The launch spec on a host."""
FIREWALL_PATH = f"{ETC}/firewall.nft"
"""The host's nftables ruleset."""
RUN_KEY_PATH = f"{ETC}/run.key"
"""The run key on a host whose training.key_file is relative (infra.render.host)."""
WG_KEY_DIR = f"{ETC}/wireguard"
"""Private keys live here on the gateway; generated there, never rendered or exported."""
GATEWAY_DIR = f"{ETC}/gateway"
"""A Kubernetes gateway pod's WireGuard and FRR config (a mounted ConfigMap)."""
AGENT_ETC_FILES = tuple(
    p.rsplit("/", 1)[1] for p in (REMOTE_SPEC_PATH, FIREWALL_PATH, WG_KEY_DIR, GATEWAY_DIR)
)
"""The names the host agent keeps directly in /etc/geotrain."""
