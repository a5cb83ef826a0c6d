"""What a run shows: Prometheus metric names (shared with the alert rules and the
dashboard) and the per-rank exposition, the event log, the end-of-run report (rich) and
its plot, against the flat fp32 all-reduce baseline. Imports only training.errors."""
