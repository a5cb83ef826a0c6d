"""What survives a restart: checkpoints (step-N directories, commit markers, per-host
manifests with a MAC, the high-water mark against rollback, async saves) and the run key
file. Imports training.comm, training.errors and training.spec."""
