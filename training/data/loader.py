"""Data shards: each region reads only shards of its own jurisdiction.

`pydoc-topics:auto` is Python's bundled documentation (pydoc_data.topics, ~1 MB of English
prose, present in every CPython): topics are split round-robin by region index, so the
regions' texts are disjoint. `file:/path` is a text file or a directory of *.txt files.
Tokens are bytes (vocab 256).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.errors import DataError
from training.spec import RegionSpec


def load_region_text(region: RegionSpec, region_index: int, regions: int) -> bytes:
    if not region.shards:
        raise DataError(
            f"region {region.name} has no data shard; add one to "
            "geotrain:training.data_shards with region: " + region.name
        )
    parts = []
    for s in region.shards:
        if s.jurisdiction != region.jurisdiction:
            raise DataError(
                f"shard {s.name} is {s.jurisdiction} data but region "
                f"{region.name} is in {region.jurisdiction}; data must stay in "
                "its jurisdiction"
            )
        parts.append(read_shard(s.uri, s.name, region_index, regions))
    text = b"\n".join(parts)
    if len(text) < 4096:
        raise DataError(
            f"region {region.name}'s data is only {len(text)} bytes; need at least 4096"
        )
    return text


def read_shard(uri: str, name: str, index: int, regions: int) -> bytes:
    """One raw shard's bytes: the region's share of Python's docs, or a file or directory."""
    if uri.startswith("pydoc-topics:"):
        return "\n\n".join(pydoc_topics(index, regions)).encode("utf-8")
    if uri.startswith("file:"):
        path = Path(uri[len("file:") :])
        files = sorted(path.glob("**/*.txt")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise DataError(
                f"shard {name}: {path} holds no readable text; point file: at "
                "a text file or a directory of .txt files"
            )
        try:
            return b"\n".join(f.read_bytes() for f in files)
        except OSError as e:  # unreadable: a deterministic failure, not one to restart on
            raise DataError(
                f"shard {name}: cannot read {e.filename or path} ({e.strerror or e}); fix "
                "its permissions or point the shard elsewhere"
            ) from None
    raise DataError(f"shard {name}: unsupported uri '{uri}'; use pydoc-topics:auto or file:")


def pydoc_topics(index: int, regions: int) -> list[str]:
    """Region `index`'s topics of Python's bundled docs: round-robin, so regions are disjoint."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[index::regions]]


class Position:
    """A loader's place in its data, for checkpoints: batches drawn and its generator."""

    drawn: int
    gen: torch.Generator

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "rng": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])
        self.gen.set_state(state["rng"])


@dataclass
class ByteLoader(Position):
    """Random windows of T+1 bytes; the position (batches drawn + RNG) is checkpointable."""

    data: torch.Tensor  # (N,) uint8
    batch: int
    seq_len: int
    seed: int
    drawn: int = 0
    gen: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        self.gen.manual_seed(self.seed)

    @staticmethod
    def of(text: bytes, batch: int, seq_len: int, seed: int) -> ByteLoader:
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        return ByteLoader(data, batch, seq_len, seed)

    def next(self) -> torch.Tensor:
        """(B, T+1) int64."""
        hi = self.data.numel() - self.seq_len - 1
        start = torch.randint(0, hi, (self.batch,), generator=self.gen)
        idx = start[:, None] + torch.arange(self.seq_len + 1)[None, :]
        self.drawn += 1
        return self.data[idx].long()
