"""Prometheus metric names the runtime exports; renderers of alerts and dashboards import
these so a rename cannot silently break a rule. Every name here is exported by
training.metrics (tests/unit/test_monitoring.py checks it) and appears in a dashboard panel
or an alert rule."""

STEP = "geotrain_step"
LOSS = "geotrain_loss"
TOKENS_PER_SECOND = "geotrain_tokens_per_second"
STEP_SECONDS = "geotrain_step_seconds"
SYNC_SECONDS = "geotrain_sync_seconds"
SYNCS = "geotrain_syncs_total"
LAST_SYNC = "geotrain_last_sync_timestamp_seconds"
SYNC_THROUGHPUT = "geotrain_cross_region_sync_bytes_per_second"
CROSS_RAW_BYTES = "geotrain_cross_region_raw_bytes_total"
CROSS_WIRE_BYTES = "geotrain_cross_region_wire_bytes_total"
LINK_BYTES = "geotrain_cross_region_link_bytes_total"
INTRA_BYTES = "geotrain_intra_region_bytes_total"
COMPRESSION_RATIO = "geotrain_compression_ratio"
CHECKPOINT_AGE = "geotrain_checkpoint_age_seconds"
CHECKPOINT_SECONDS = "geotrain_checkpoint_save_seconds"
RESTARTS = "geotrain_restarts_total"
MERGES = "geotrain_merges_total"
REJECTED = "geotrain_payloads_rejected_total"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
GPU_MEM_USED = "DCGM_FI_DEV_FB_USED"
PROCESS_CPU = "process_cpu_seconds_total"
PROCESS_RSS = "process_resident_memory_bytes"

# Differential privacy (epsilon spent) comes later: add its name here, export it in
# training.metrics, and add a panel to infra.render.monitoring.PRIVACY_PANELS.
