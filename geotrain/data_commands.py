"""`geotrain data prepare` and `geotrain data inspect`: tokenize a region's corpus into
token shards (training.data.prepare) on the region's own hosts, and check a prepared
directory (training.data.tokens)."""

from __future__ import annotations

import json
from typing import Any

import click

from geotrain.options import friendly


@click.group()
def data() -> None:
    """Training data: tokenize a corpus into shards, inspect prepared shards."""


@data.command()
@click.option(
    "--tokenizer",
    "tokenizer_ref",
    help="bytes, a tokenizer.json, or a Hugging Face model directory holding one "
    "(with --stack: the stack's).",
)
@click.option(
    "--out", "out", type=click.Path(file_okay=False), help="Directory to write (not with --stack)."
)
@click.option(
    "--stack",
    "stack",
    help="Prepare the stack's tokens: shards from their source (every region on this "
    "machine, or --region).",
)
@click.option("--region", "region", help="With --stack: only this region's shards.")
@click.option("--text-field", default="text", show_default=True, help="JSON key / parquet column.")
@click.option(
    "--eval-fraction",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.01,
    show_default=True,
    help="Share of documents held out for evaluation.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the eval choice.")
@click.option("--overwrite", is_flag=True, help="Replace a directory prepared before.")
@click.argument("inputs", nargs=-1)
@friendly
def prepare(
    tokenizer_ref: str | None,
    out: str | None,
    stack: str | None,
    region: str | None,
    text_field: str,
    eval_fraction: float,
    seed: int,
    overwrite: bool,
    inputs: tuple[str, ...],
) -> None:
    """Tokenize INPUTS (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet files or directories)
    into --out: train-*.bin and eval-*.bin shards and manifest.json. With --stack, each
    tokens: shard of the stack (of --region) from its `source`, with the stack's tokenizer."""
    from training.data.prepare import prepare as run
    from training.data.tokenizer import load_tokenizer

    if stack is not None:
        if out or inputs:
            raise click.UsageError("--stack prepares the stack's shards: give no --out or INPUTS")
        for line in prepare_stack(stack, region, tokenizer_ref, overwrite, text_field, seed):
            click.echo(line)
        return
    if region is not None:
        raise click.UsageError("--region selects a region of --stack; give --stack too")
    if not tokenizer_ref or not out or not inputs:
        raise click.UsageError("give --tokenizer, --out and INPUTS (or --stack)")
    tok = load_tokenizer(tokenizer_ref)
    m = run(
        inputs,
        out,
        tok,
        text_field=text_field,
        eval_fraction=eval_fraction,
        seed=seed,
        overwrite=overwrite,
    )
    click.echo(f"{out}: {summary(m)}")


@data.command()
@click.argument("directory", type=click.Path())
@friendly
def inspect(directory: str) -> None:
    """Print a prepared directory's manifest summary and verify every shard's sha256."""
    from training.data.tokens import Prepared

    p = Prepared.open(directory, verify=True)
    m = p.manifest
    click.echo(f"{directory}: {summary(m)}")
    for item in m["inputs"]:
        click.echo(f"  input {item['path']}: {item['bytes']} bytes, sha256 {item['sha256'][:16]}")
    click.echo(f"verified {len(p.train) + len(p.eval)} shards (size and sha256)")


def summary(m: dict[str, Any]) -> str:
    """One line: tokens per split, shards, dtype, tokenizer."""
    tok = m["tokenizer"]
    return (
        f"{m['tokens']['train']} train tokens in {len(m['shards'])} shards, "
        f"{m['tokens']['eval']} eval tokens in {len(m['eval'])}, {m['dtype']}, "
        f"{m['documents']['train'] + m['documents']['eval']} documents from "
        f"{len(m['inputs'])} files, tokenizer {tok['digest'][:16]} (vocab {tok['vocab_size']})"
    )


def prepare_stack(
    stack: str,
    region: str | None,
    tokenizer_ref: str | None,
    overwrite: bool,
    text_field: str,
    seed: int,
) -> list[str]:
    """Prepare every tokens: shard of `stack` that has a source (of `region` only, when
    given): the raw text is read where the worker would read it (training.data.loader),
    on this host; nothing leaves it."""
    import tempfile
    from pathlib import Path

    from infra.model.load import load_stack
    from training.data.loader import pydoc_topics
    from training.data.prepare import prepare as run
    from training.data.tokenizer import load_tokenizer, tokenizer_for
    from training.data.tokens import URI_PREFIX
    from training.errors import DataError

    m = load_stack(stack)
    t = m.training
    names = [r.name for r in m.regions]
    if region is not None and region not in names:
        raise DataError(f"stack {stack} has no region {region}; use one of {', '.join(names)}")
    tok = load_tokenizer(tokenizer_ref or tokenizer_for(t.model, t.tokenizer))
    shards = [
        s
        for s in t.data_shards
        if s.uri.startswith(URI_PREFIX) and s.source and region in (None, s.region)
    ]
    if not shards:
        raise DataError(
            f"stack {stack} has no tokens: shard with a source"
            + (f" in region {region}" if region else "")
            + "; give a shard uri: tokens:<dir> and source: file:/path or pydoc-topics:auto"
        )
    lines = []
    for s in shards:
        out = s.uri[len(URI_PREFIX) :]
        assert s.source is not None  # filtered above
        with tempfile.TemporaryDirectory(prefix="geotrain-prepare-") as tmp:
            if s.source.startswith("file:"):
                inputs = [s.source[len("file:") :]]
            else:  # the region's share of Python's docs (training.data.loader), a
                # document per topic, so the eval split holds out whole topics
                path = Path(tmp) / f"{s.name}.jsonl"
                with open(path, "w", encoding="utf-8") as f:
                    for doc in pydoc_topics(names.index(s.region), len(names)):
                        f.write(json.dumps({text_field: doc}) + "\n")
                inputs = [str(path)]
            manifest = run(inputs, out, tok, text_field=text_field, seed=seed, overwrite=overwrite)
        lines.append(f"{s.region}/{s.name} -> {out}: {summary(manifest)}")
    return lines
