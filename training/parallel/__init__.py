"""Sharding inside a region: FSDP2 (`fully_shard`) over the region's ranks, so parameters,
gradients and optimizer state are split L ways. Across regions the shards are replicated
by geotrain's own sync, not by FSDP: rank c of every region holds the same shard c and
exchanges it with its peers through the codec (training.sync.hier with `sharded`), which
is HSDP with the replicate dimension compressed and encrypted. Imports training.comm,
training.errors and training.spec."""
