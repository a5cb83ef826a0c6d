"""Regions as torchft replica groups: the quorum (Lighthouse, per-region managers, the
cross-region world of each round), healing a returning region from a live peer over a
sealed transport, the fault-tolerant training loop, and fault injection for tests. The
top of the runtime: may import every other package, the job, setup and loop."""
