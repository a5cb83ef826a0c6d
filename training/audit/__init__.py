"""The tamper-evident record of a run: the Ed25519-signed, SM3-chained ledger per region, its
verification (`geotrain ledger verify`), and the hooks the loop calls at syncs, merges,
commits and the end. hooks works on training.job.Job; ledger and verify import only
training.errors."""
