"""The lab's workload: the model reference (preset, hf:<dir>, python:<module>:<callable>),
its tokenizer against the model's embedding, and prepared token shards against the
tokenizer. Directories are read only where they are on this machine (the single-machine
kinds); on a fleet they live on the hosts, and the workers check the same at start."""

from __future__ import annotations

import json
from pathlib import Path

from infra.model.checks.common import SINGLE_MACHINE_KINDS, err
from infra.model.schema import StackModel
from training.data.tokenizer import BYTES
from training.errors import GeotrainError
from training.models.refs import PRESET_NAMES, PRESET_VOCAB, known_form


def check(m: StackModel, source: str) -> None:
    t = m.training
    ref = t.model
    if not known_form(ref):
        raise err(
            source,
            "training.model",
            f"unknown model '{ref}'; use a preset ({', '.join(PRESET_NAMES)}), "
            "hf:<model dir> or python:<module>:<callable>",
        )
    if not all(r.pool.kind in SINGLE_MACHINE_KINDS for r in m.regions):
        return  # the directories are on the hosts; the workers check them at start
    vocab = _embedding_rows(ref, source, t.seq_len)
    tokenizer = _tokenizer(m, source)
    if vocab is not None and tokenizer is not None and tokenizer[1] > vocab:
        raise err(
            source,
            "training.tokenizer",
            f"tokenizer {tokenizer[2]} has {tokenizer[1]} tokens but model {ref} embeds "
            f"{vocab}; use the model's own tokenizer or a model with a larger vocab_size",
        )
    digest = tokenizer[0] if tokenizer is not None else None
    for i, s in enumerate(t.data_shards):
        where = f"training.data_shards[{i}].uri"
        if s.source is not None and not s.uri.startswith("tokens:"):
            raise err(
                source,
                f"training.data_shards[{i}].source",
                f"shard {s.name} has a source but its uri is {s.uri}; a source is what a "
                "tokens: shard is prepared from: set uri to tokens:<dir>, or drop source",
            )
        if s.source is not None and not (
            s.source == "pydoc-topics:auto" or s.source.startswith("file:")
        ):
            raise err(
                source,
                f"training.data_shards[{i}].source",
                f"unsupported source '{s.source}'; use pydoc-topics:auto or file:/path/to/text",
            )
        if s.uri.startswith("tokens:"):
            _prepared(s.uri[len("tokens:") :], digest, source, where)
        elif digest not in (None, BYTES):
            raise err(
                source,
                where,
                f"shard {s.name} is raw text, read as bytes, but the model has its own "
                "tokenizer: run geotrain data prepare on it and give uri: tokens:<dir> "
                f"(tokenizer {tokenizer[2] if tokenizer else '?'})",
            )


def _embedding_rows(ref: str, source: str, seq_len: int) -> int | None:
    if ref in PRESET_NAMES:
        return PRESET_VOCAB
    if not ref.startswith("hf:"):
        return None  # a factory's module is built only by the workers
    from training.models.hf import hf_facts

    try:
        return int(hf_facts(ref[3:], seq_len=seq_len)["vocab_size"])
    except GeotrainError as e:
        raise err(source, "training.model", str(e)) from None


def _tokenizer(m: StackModel, source: str) -> tuple[str, int, str] | None:
    """(digest, vocab size, reference) of the stack's tokenizer."""
    from training.data.tokenizer import load_tokenizer, tokenizer_for

    ref = tokenizer_for(m.training.model, m.training.tokenizer)
    try:
        tok = load_tokenizer(ref)
    except GeotrainError as e:
        raise err(source, "training.tokenizer", str(e)) from None
    return tok.digest, tok.vocab_size, ref


def _prepared(directory: str, digest: str | None, source: str, where: str) -> None:
    manifest = Path(directory) / "manifest.json"
    if not manifest.is_file():  # not prepared yet: `geotrain data prepare` reads this stack
        return
    try:
        have = json.loads(manifest.read_text())["tokenizer"]["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        raise err(source, where, f"{manifest} is malformed; rerun geotrain data prepare") from None
    if digest is not None and have != digest:
        raise err(
            source,
            where,
            f"{directory} was prepared with tokenizer {str(have)[:16]}, the model's is "
            f"{digest[:16]}; rerun geotrain data prepare with --tokenizer <the model's tokenizer>",
        )


def parallel(m: StackModel, source: str) -> None:
    """`parallel.shard: fsdp` against the rest of the stack (training.spec.fsdp_conflict)."""
    from training.spec import AUTOCAST_WITH_PRIVACY, fsdp_conflict

    t = m.training
    private = [r.name for r in m.regions if r.privacy]
    if t.parallel.autocast != "none" and private:
        raise err(
            source,
            "training.parallel.autocast",
            AUTOCAST_WITH_PRIVACY.format(regions=", ".join(private)),
        )
    if t.parallel.shard != "fsdp":
        for key in ("param_dtype", "activation_checkpointing"):
            if key in t.parallel.model_fields_set:
                raise err(
                    source,
                    f"training.parallel.{key}",
                    "applies to parallel.shard: fsdp only; set shard: fsdp or drop it",
                )
        return
    conflict = fsdp_conflict(
        privacy=[r.name for r in m.regions if r.privacy],
        streaming=t.sync == "diloco" and (t.diloco.fragments > 1 or t.diloco.tau > 0),
        balance=t.balance == "throughput",
        fault_tolerance=t.fault_tolerance is not None,
        secure_aggregation=t.compression.secure_aggregation,
        workers={r.name: sum(n.gpus for n in r.pool.nodes) for r in m.regions},
    )
    if conflict:
        raise err(source, "training.parallel.shard", f"fsdp {conflict}")
