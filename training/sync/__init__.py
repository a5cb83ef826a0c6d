"""The cross-region path of one sync: parameters in buckets, the codec (quantize,
byte-shuffle, zstd, SM4-GCM/AES-GCM, with the associated data that binds every payload),
the hierarchical all-reduce (reduce-scatter in the region, exchange across, all-gather),
the topology-aware exchange and its planner, link probes and the adaptive codec, secure
aggregation, throughput balance, DiLoCo's outer step and its streaming twin. Imports
training.comm, training.errors and training.spec; never the job or the loop."""
