"""Prometheus metrics of one rank (prometheus_client), labelled region, node and rank.

Names are in training.metric_names so alert rules and dashboards match them. GPU
utilisation and memory come from NVML when it is present (DCGM exporter names); process
CPU and memory always (prometheus_client's process collector).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.exposition import start_http_server

from training import metric_names as mn
from training.errors import GeotrainError

LABELS = ("region", "node", "rank")


class RuntimeMetrics:
    def __init__(self, region: str, node: str, rank: int) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self._labels = {"region": region, "node": node, "rank": str(rank)}

        def g(name: str, doc: str) -> Any:
            return Gauge(name, doc, LABELS, registry=r).labels(**self._labels)

        def c(name: str, doc: str) -> Any:
            # prometheus_client appends _total itself
            return Counter(name.removesuffix("_total"), doc, LABELS, registry=r).labels(
                **self._labels
            )

        self.step = g(mn.STEP, "Optimizer (inner) step")
        self.loss = g(mn.LOSS, "Training loss of the last step")
        self.tokens_per_s = g(mn.TOKENS_PER_SECOND, "Tokens per second of this rank")
        self.step_s = g(mn.STEP_SECONDS, "Seconds of the last step")
        self.sync_s = g(mn.SYNC_SECONDS, "Seconds of the last sync")
        self.syncs = c(mn.SYNCS, "Finished syncs (all-reduce steps or merges)")
        self.cross_raw = c(mn.CROSS_RAW_BYTES, "fp32 bytes the cross-region payloads stand for")
        self.cross_wire = c(mn.CROSS_WIRE_BYTES, "Encoded bytes sent across regions")
        self.intra = c(mn.INTRA_BYTES, "Bytes sent inside the region")
        self.link = Counter(
            mn.LINK_BYTES.removesuffix("_total"),
            "Encoded bytes sent to one peer region",
            (*LABELS, "peer_region"),
            registry=r,
        )
        self.ratio = g(mn.COMPRESSION_RATIO, "Cross-region raw / wire bytes")
        self.ckpt_age = g(mn.CHECKPOINT_AGE, "Seconds since the newest committed checkpoint")
        self.ckpt_s = g(mn.CHECKPOINT_SECONDS, "Seconds of the last checkpoint save")
        self.restarts = c(mn.RESTARTS, "Restarts of this rank (resumes from a checkpoint)")
        self.merges = c(mn.MERGES, "Periodic global merges (diloco)")
        self.rejected = c(mn.REJECTED, "Cross-region payloads that failed verification")
        self._gpu = _nvml_gauges(r, self._labels)
        self._last_ckpt: float | None = None

    def link_bytes(self, peer_region: str, n: int) -> None:
        if n:
            self.link.labels(**self._labels, peer_region=peer_region).inc(n)

    def serve(self, host: str, port: int) -> None:
        if port == 0:
            return
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise GeotrainError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                "free the port or change geotrain:monitoring.metrics_port"
            ) from None

    def checkpointed(self, seconds: float) -> None:
        self._last_ckpt = time.monotonic()
        self.ckpt_s.set(seconds)

    def tick(self) -> None:
        """Refresh gauges that are read rather than pushed."""
        if self._last_ckpt is not None:
            self.ckpt_age.set(time.monotonic() - self._last_ckpt)
        if self._gpu:
            self._gpu()


def _nvml_gauges(registry: CollectorRegistry, labels: dict[str, str]) -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML (CPU hosts): GPU gauges are simply absent
        return None
    util = Gauge(mn.GPU_UTIL, "GPU utilisation %", (*LABELS, "gpu"), registry=registry)
    mem = Gauge(mn.GPU_MEM_USED, "GPU framebuffer used MiB", (*LABELS, "gpu"), registry=registry)

    def refresh() -> None:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util.labels(**labels, gpu=str(i)).set(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            mem.labels(**labels, gpu=str(i)).set(pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20)

    return refresh
