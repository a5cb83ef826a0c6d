"""`geotrain data prepare` and `geotrain data inspect`: tokenize a region's corpus into
token shards (training.data.prepare) on the region's own hosts, and check a prepared
directory (training.data.tokens)."""

from __future__ import annotations

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
    required=True,
    help="bytes, a tokenizer.json, or a Hugging Face model directory holding one.",
)
@click.option(
    "--out", "out", type=click.Path(file_okay=False), required=True, help="Directory to write."
)
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
@click.argument("inputs", nargs=-1, required=True)
@friendly
def prepare(
    tokenizer_ref: str,
    out: str,
    text_field: str,
    eval_fraction: float,
    seed: int,
    overwrite: bool,
    inputs: tuple[str, ...],
) -> None:
    """Tokenize INPUTS (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet files or directories)
    into --out: train-*.bin and eval-*.bin shards and manifest.json."""
    from training.data.prepare import prepare as run
    from training.data.tokenizer import load_tokenizer

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
