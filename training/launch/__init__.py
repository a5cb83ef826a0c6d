"""Starting a run: the launcher (`geotrain launch`/`train`: one torchrun agent per node,
restarts, the event log, the final claim), torchrun's entry in pods and workers, the
rendezvous store host, and child processes that die with their parent. Imports
training.comm, training.errors, training.spec, training.state.keys, and training.ft.quorum
(only under fault_tolerance, for the Lighthouse)."""
