"""geotrain's training runtime. It reads a launch spec (training.spec) and never imports
pulumi, infra, policies or the CLI.

Packages, in the order imports run (each imports only what is listed before it, with the
two exceptions below); errors (typed exceptions) and spec (the launch spec) come first:
- comm/     process groups and the authenticated channel every part uses: ranks and groups
            by region (topology), gloo's interface binding, sessions, key derivation, Control;
- parallel/ FSDP2 inside a region and the views of its shards;
- data/     a region's training data and the loader's position;
- observe/  metric names and the Prometheus exposition, the event log, report and plot;
- sync/     the cross-region path: codec, hierarchical all-reduce, exchange plans,
            adaptive codec, link probes, secure aggregation, DiLoCo, streaming, balance;
- models/   the model presets (and their sync bucket count);
- state/    checkpoints (DCP, commit markers, MACs, high-water mark) and run keys;
- privacy/  DP-SGD per region (Opacus' accountant);
- audit/    the signed ledger, its verification, and the hooks the loop calls;
- job, setup, gradsync, resume, loop, worker: the `Job` dataclass, building it, a step's
            gradients, what a checkpoint holds, the steps and the run, a rank's entry;
- ft/       regions as torchft replica groups: quorum, heal, the fault-tolerant loop;
- launch/   the launcher, torchrun's entry, the rendezvous store, child processes.
Exceptions: audit.hooks works on training.job.Job (job imports only audit.ledger); ft uses
launch's worker-side helpers (procs, torchrun's store), and the launcher imports ft.quorum
only under fault_tolerance, to host the Lighthouse. testing holds multi-rank test helpers.
tests/unit/test_import_graph.py fails on any circle between modules.
"""
