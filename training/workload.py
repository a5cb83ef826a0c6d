"""A rank's workload from its launch spec: the model (a preset, `hf:<dir>` or the lab's
`python:` factory), the tokenizer, and the region's data (raw text as bytes, or token shards
that `geotrain data prepare` made on the region's hosts), checked against each other before
any step: the tokenizer must fit the model's embedding and the shards must have been
prepared with that tokenizer. Every region must start from the same weights: `agree_weights`
compares their digests over an authenticated gather before step 1."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from training.comm.session import Control
from training.data.loader import ByteLoader, load_region_text
from training.data.tokenizer import BYTES, TextTokenizer, load_tokenizer, tokenizer_for
from training.data.tokens import URI_PREFIX, MixtureLoader, TokenLoader, prepared_path
from training.errors import DataError, SpecError
from training.models.build import build_model, embedding_rows, params_digest
from training.spec import AUTOCAST_WITH_PRIVACY, LaunchSpec, RegionSpec, fsdp_conflict

Loader = ByteLoader | TokenLoader | MixtureLoader


def tokenizer_ref(spec: LaunchSpec) -> str:
    """The tokenizer of the spec's run (training.data.tokenizer.tokenizer_for)."""
    return tokenizer_for(spec.model, spec.tokenizer)


def tokenized(region: RegionSpec) -> bool:
    """Whether the region reads token shards (tokens:) rather than raw text; a region that
    mixes both is refused (the two are different token spaces)."""
    kinds = {s.uri.startswith(URI_PREFIX) for s in region.shards}
    if len(kinds) > 1:
        raise DataError(
            f"region {region.name} mixes tokens: shards with raw-text shards; prepare the "
            "text ones with geotrain data prepare too, so every shard is tokens:"
        )
    return kinds == {True}


def region_text(spec: LaunchSpec, region: RegionSpec) -> bytes | None:
    """The region's raw text (byte tokens), or None where it reads token shards."""
    if region.shards and tokenized(region):
        if region.privacy is not None:
            raise SpecError(
                f"region {region.name}: differential privacy samples records from byte "
                "shards only; give the region file: or pydoc-topics: shards, or remove its "
                "privacy settings"
            )
        return None
    index = [r.name for r in spec.regions].index(region.name)
    text = load_region_text(region, index, len(spec.regions))
    if len(text) < spec.seq_len + 2:  # a window is seq_len + 1 bytes, drawn from [0, n - it)
        raise DataError(
            f"region {region.name}'s data is {len(text)} bytes, too short for one sequence "
            f"of seq_len {spec.seq_len} plus its target byte; lower "
            "geotrain:training.seq_len or give the region more data"
        )
    return text


def model_for(spec: LaunchSpec) -> tuple[nn.Module, TextTokenizer]:
    """The model (seeded: every rank builds the same initial weights) and its tokenizer,
    refused when the tokenizer's ids do not fit the model's input embedding."""
    tokenizer = load_tokenizer(tokenizer_ref(spec))
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, spec.seq_len)
    rows = embedding_rows(model)
    if tokenizer.vocab_size > rows:
        raise SpecError(
            f"tokenizer {tokenizer_ref(spec)} has {tokenizer.vocab_size} tokens but model "
            f"{spec.model} embeds {rows}; use the model's own tokenizer or a model with a "
            "larger vocab_size"
        )
    return model, tokenizer


def loader_for(
    spec: LaunchSpec, region: RegionSpec, text: bytes | None, rank: int, tokenizer: TextTokenizer
) -> Loader:
    """The rank's batches: random windows of its region's bytes, or of its token shards
    (one shard, or a mixture by the shards' weights), checked against the tokenizer."""
    seed = spec.seed * 1000 + rank
    if text is not None:
        if tokenizer.digest != BYTES:
            raise SpecError(
                f"region {region.name} reads raw text as bytes but the model's tokenizer is "
                f"{tokenizer_ref(spec)}; prepare the region's text with geotrain data prepare "
                "--tokenizer <the model's tokenizer> and give tokens: shards"
            )
        return ByteLoader.of(text, spec.batch_size, spec.seq_len, seed)
    sources = [
        (TokenLoader(s.uri, spec.batch_size, spec.seq_len, seed), s.weight) for s in region.shards
    ]
    loader: TokenLoader | MixtureLoader
    loader = sources[0][0] if len(sources) == 1 else MixtureLoader(sources, spec.batch_size, seed)
    loader.check_tokenizer(tokenizer.digest, tokenizer.vocab_size)
    return loader


def agree_weights(spec: LaunchSpec, model: nn.Module, control: Control) -> str:
    """Every rank's weight digest, gathered authenticated; refuse (one line naming the
    region) when any region starts from other weights than region 0."""
    digest = params_digest(model)
    seen: list[Any] = control.gather(digest)
    owner = {
        n.first_rank + k: r.name for r in spec.regions for n in r.nodes for k in range(n.nprocs)
    }
    for rank, theirs in enumerate(seen):
        if theirs != seen[0]:
            raise SpecError(
                f"region {owner[rank]} starts from weights {str(theirs)[:16]} but region "
                f"{owner[0]} from {str(seen[0])[:16]}; every region must load the same "
                f"model ({spec.model}): copy the same weights to every region's hosts"
            )
    return digest


def check_fsdp(spec: LaunchSpec) -> None:
    """The stack check's refusals of `parallel.shard: fsdp`, for a spec rendered by hand."""
    conflict = fsdp_conflict(
        privacy=[r.name for r in spec.regions if r.privacy is not None],
        streaming=spec.sync == "diloco" and spec.diloco.streaming,
        balance=spec.balance == "throughput",
        fault_tolerance=spec.fault_tolerance is not None,
        secure_aggregation=spec.codec.secure_aggregation,
        workers={r.name: sum(n.nprocs for n in r.nodes) for r in spec.regions},
    )
    if conflict:
        raise SpecError(f"launch spec: parallel.shard fsdp {conflict}")


def check_autocast(spec: LaunchSpec) -> None:
    """The stack check's refusal of autocast with DP-SGD, for a spec rendered by hand."""
    private = [r.name for r in spec.regions if r.privacy is not None]
    if spec.parallel.autocast != "none" and private:
        raise SpecError("launch spec: " + AUTOCAST_WITH_PRIVACY.format(regions=", ".join(private)))


def data_digests(region: RegionSpec, text: bytes | None) -> dict[str, str]:
    """What the region trains on, as digests for its ledger: each token shard's manifest
    (which names every input's and shard's sha256), or the raw text the region read."""
    if text is not None:
        return {"text": hashlib.sha256(text).hexdigest()}
    return {
        s.name: hashlib.sha256((prepared_path(s.uri) / "manifest.json").read_bytes()).hexdigest()
        for s in region.shards
    }
