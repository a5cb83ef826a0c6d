"""Prometheus metrics of one rank (prometheus_client), labelled region, node and rank.

Names are in training.observe.metric_names so alert rules and dashboards match them. GPU
utilisation and memory come from NVML when it is present (DCGM exporter names), for this
rank's own device only, so a sum over ranks counts every GPU once. Process CPU and memory
always (prometheus_client's process collector).

Two series are derived here rather than pushed by the worker, so alerts can compare like
with like whatever the sync cadence:
- the time of the last finished sync (a stall is "too long since", not "no increase in a
  window" that a 30-minute diloco cadence would trip);
- the cross-region bytes per second of sync time of the last sync (bursty diloco merges and
  per-step all-reduces give comparable numbers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector
from prometheus_client.exposition import start_http_server

from training.errors import GeotrainError
from training.observe import metric_names as mn

if TYPE_CHECKING:
    import torch

LABELS = ("region", "node", "rank")
BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "ternary": 0.25}
"""Bytes per value of each quantizer before zstd (the adaptive codec's gauge)."""


class _Tap:
    """A metric child whose writes also feed the derived series (the worker calls only
    `.inc()` and `.set()`)."""

    def __init__(self, child: Any, on_write: Callable[[float], None]) -> None:
        self._child = child
        self._on_write = on_write

    def inc(self, amount: float = 1.0) -> None:
        self._child.inc(amount)
        self._on_write(amount)

    def set(self, value: float) -> None:
        self._child.set(value)
        self._on_write(value)


class RuntimeMetrics:
    def __init__(self, region: str, node: str, rank: int, gpu: int | None = None) -> None:
        """`gpu`: NVML index of this rank's device (default: the CUDA device the worker
        selected, if any); no GPU series without one."""
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
        self.sync_s = _Tap(g(mn.SYNC_SECONDS, "Seconds of the last sync"), self._sync_time)
        self.syncs = _Tap(c(mn.SYNCS, "Finished syncs (all-reduce steps or merges)"), self._synced)
        self.last_sync = g(
            mn.LAST_SYNC, "Unix time of the last finished sync (process start until the first)"
        )
        self.last_sync.set(time.time())  # a fresh process gets the full stall window
        self._throughput = Gauge(
            mn.SYNC_THROUGHPUT,
            "Cross-region wire bytes per second of sync time, of the last sync",
            LABELS,
            registry=r,
        )  # no child until the first sync: absent rather than a misleading 0
        self._pending = [0.0, 0.0]  # wire bytes, sync seconds since the last finished sync
        self.cross_raw = c(mn.CROSS_RAW_BYTES, "fp32 bytes the cross-region payloads stand for")
        self.cross_wire = _Tap(
            c(mn.CROSS_WIRE_BYTES, "Encoded bytes sent across regions"), self._wire
        )
        self.intra = c(mn.INTRA_BYTES, "Bytes sent inside the region")
        self.link = Counter(
            mn.LINK_BYTES.removesuffix("_total"),
            "Encoded bytes sent to one peer region",
            (*LABELS, "peer_region"),
            registry=r,
        )
        self.ratio = g(mn.COMPRESSION_RATIO, "Cross-region raw / wire bytes")
        pair = (*LABELS, "src_region", "dst_region")
        self._link_bw = Gauge(
            mn.LINK_BANDWIDTH, "Bytes/s this rank's transfers get on a link", pair, registry=r
        )  # children per link once measured: absent with one region
        self._link_rtt = Gauge(
            mn.LINK_RTT, "Round-trip seconds of a link (probe)", pair, registry=r
        )
        self._link_width = Gauge(
            mn.LINK_CODEC_BYTES, "Bytes per value of the adaptive codec on a link", pair, registry=r
        )
        self.ckpt_age = g(
            mn.CHECKPOINT_AGE,
            "Seconds since this process's newest checkpoint (or since it started)",
        )
        self.ckpt_age.set_function(self._checkpoint_age)  # computed at scrape: a hang ages
        self.ckpt_s = g(mn.CHECKPOINT_SECONDS, "Seconds of the last checkpoint save")
        self.restarts = c(mn.RESTARTS, "Restarts of this rank (resumes from a checkpoint)")
        self.merges = c(mn.MERGES, "Periodic global merges (diloco)")
        self.rejected = c(
            mn.REJECTED, "Cross-region payloads and control messages that failed verification"
        )
        self._epsilon = Gauge(
            mn.PRIVACY_EPSILON, "Epsilon spent by this region so far (DP-SGD)", LABELS, registry=r
        )  # no child without DP: absent rather than a misleading 0
        self._epsilon_target = Gauge(
            mn.PRIVACY_EPSILON_TARGET, "Target epsilon of this region", LABELS, registry=r
        )
        self._quorum_regions = Gauge(
            mn.QUORUM_REGIONS, "Regions in the current quorum", LABELS, registry=r
        )  # the four quorum series: no child without fault_tolerance
        self._quorum_excluded = Gauge(
            mn.QUORUM_EXCLUDED,
            "1 for a region the current quorum leaves out",
            (*LABELS, "excluded_region"),
            registry=r,
        )
        self._heals = Counter(
            mn.HEALS.removesuffix("_total"), "Heals from a live peer", LABELS, registry=r
        )
        self._failed_rounds = Counter(
            mn.QUORUM_FAILED_ROUNDS.removesuffix("_total"),
            "Cross-region rounds voted down and run again",
            LABELS,
            registry=r,
        )
        self.rejected_total = 0
        """This rank's rejects, including those before a restart (`reject`)."""
        self.serving = False
        """Whether the endpoint is up (`serve` with a port)."""
        self._started = time.monotonic()
        self._last_ckpt: float | None = None
        self.gpu = _own_device() if gpu is None else gpu
        self.has_gpu_series = self.gpu is not None and _nvml_gauges(r, self._labels, self.gpu)

    def quorum(self, members: list[str], excluded: list[str]) -> None:
        """A new quorum (training.ft.quorum): its size, and which regions it leaves out."""
        self._quorum_regions.labels(**self._labels).set(len(members))
        for name in members + excluded:
            self._quorum_excluded.labels(**self._labels, excluded_region=name).set(name in excluded)
        self._heals.labels(**self._labels)  # present at 0 from the first quorum
        self._failed_rounds.labels(**self._labels)

    def heal(self) -> None:
        self._heals.labels(**self._labels).inc()

    def round_failed(self) -> None:
        self._failed_rounds.labels(**self._labels).inc()

    def link_bytes(self, peer_region: str, n: int) -> None:
        if n:
            self.link.labels(**self._labels, peer_region=peer_region).inc(n)

    def links(self, report: dict[str, Any]) -> None:
        """Per-link gauges from training.loop.link_report: bandwidth and RTT of each
        measured link, and the bytes per value of the adaptive codec on each link this rank
        sends over (`all`, the gather stage, is labelled dst_region=all)."""
        for link in report["links"]:
            if not link["samples"]:
                continue
            ends = {"src_region": link["src"], "dst_region": link["dst"]}
            self._link_bw.labels(**self._labels, **ends).set(link["bandwidth"])
            self._link_rtt.labels(**self._labels, **ends).set(link["rtt"])
        for peer, c in report["codecs"].items():
            ends = {"src_region": self._labels["region"], "dst_region": peer}
            width = BYTES_PER_VALUE[str(c["codec"]).split("/")[0]]
            self._link_width.labels(**self._labels, **ends).set(width)

    def serve(self, host: str, port: int) -> None:
        """Serve on `host` only (never every interface); port 0: not at all."""
        if port == 0:
            return
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise GeotrainError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                "free the port or change geotrain:monitoring.metrics_port"
            ) from None
        self.serving = True

    def reject(self, count: int = 1) -> int:
        """Count `count` rejected messages; returns this rank's total. A restarted worker
        first adds what the event log says it rejected before, so the counter (and the
        GeotrainPayloadsRejected alert) survive the restart."""
        if count:
            self.rejected.inc(count)
            self.rejected_total += count
        return self.rejected_total

    def privacy(self, epsilon: float, target: float) -> None:
        """The region's epsilon spent so far, and its budget."""
        self._epsilon.labels(**self._labels).set(epsilon)
        self._epsilon_target.labels(**self._labels).set(target)

    def checkpointed(self, seconds: float) -> None:
        self._last_ckpt = time.monotonic()
        self.ckpt_s.set(seconds)

    def tick(self) -> None:
        """Called once per step. Gauges that are read rather than pushed (checkpoint age,
        GPU) are computed at scrape time, so nothing is left to refresh here."""

    def _checkpoint_age(self) -> float:
        return time.monotonic() - (self._last_ckpt or self._started)

    def _wire(self, n: float) -> None:
        self._pending[0] += n

    def _sync_time(self, seconds: float) -> None:
        self._pending[1] += seconds

    def _synced(self, _: float) -> None:
        """One sync finished: its bytes over its seconds, then start the next tally."""
        self.last_sync.set(time.time())
        wire, seconds = self._pending
        if wire > 0 and seconds > 0:
            self._throughput.labels(**self._labels).set(wire / seconds)
        self._pending = [0.0, 0.0]


def _own_device() -> int | None:
    """The CUDA device the worker selected with torch.cuda.set_device, when CUDA is in use.
    torch's index equals NVML's when CUDA_VISIBLE_DEVICES is unset and the node's GPUs are
    of one model (CUDA orders equal devices by PCI bus, like NVML)."""
    try:
        import torch
    except ImportError:  # pragma: no cover (torch is a dependency)
        return None
    if not torch.cuda.is_initialized():  # a CPU worker must not create a CUDA context
        return None
    return int(torch.cuda.current_device())


def _nvml_gauges(registry: CollectorRegistry, labels: dict[str, str], gpu: int) -> bool:
    """Utilisation and framebuffer of device `gpu`, read from NVML at scrape time."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    except Exception:  # no NVML (CPU hosts) or no such device: GPU gauges are absent
        return False
    util = Gauge(mn.GPU_UTIL, "GPU utilisation %", (*LABELS, "gpu"), registry=registry)
    mem = Gauge(mn.GPU_MEM_USED, "GPU framebuffer used MiB", (*LABELS, "gpu"), registry=registry)
    util.labels(**labels, gpu=str(gpu)).set_function(
        _safe(lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
    )
    mem.labels(**labels, gpu=str(gpu)).set_function(
        _safe(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20)
    )
    return True


def _safe(read: Callable[[], float]) -> Callable[[], float]:
    """An NVML error (device lost, driver reset) is NaN for that sample, never a failed
    scrape of every other series."""

    def value() -> float:
        try:
            return read()
        except Exception:
            return float("nan")

    return value


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: on CUDA the caching allocator's high-water mark
    of tensors on `device` (what a larger batch or model would run out of first), on CPU
    the kernel's high-water mark of the whole process (VmHWM)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
