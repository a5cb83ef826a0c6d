"""Stack output keys: shared by the program, the CLI and the tests."""

LAUNCH_SPEC = "launch_spec"
RUN_ID = "run_id"
WORLD_SIZE = "world_size"
REGIONS = "regions"
WIREGUARD_PUBLIC_KEYS = "wireguard_public_keys"
PROMETHEUS_URL = "prometheus_url"
GRAFANA_URL = "grafana_url"
ARTIFACT_DIGESTS = "artifact_digests"

TOKEN_PREFIX = "geotrain:"
