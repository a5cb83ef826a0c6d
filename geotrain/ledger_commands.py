"""`geotrain ledger verify`: check a run's signed training ledger (training.audit.verify)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from geotrain.options import friendly
from training.errors import LedgerError


@click.group()
def ledger() -> None:
    """The tamper-evident training ledger (one signed SM3 chain per region)."""


@ledger.command()
@click.option(
    "--stack",
    "-s",
    default=None,
    help="Stack name or file: verify the run dir `geotrain train` keeps for it.",
)
@click.option(
    "--run",
    "run",
    type=click.Path(file_okay=False),
    default=None,
    help="Run dir holding ledger/ (and final.pt), e.g. collected from every region's leader.",
)
@click.option(
    "--trust",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help='JSON {"<region>": "<public key hex>"}: pin region keys (ledger/<region>.pub).',
)
@click.option("--open", "allow_open", is_flag=True, help="Accept chains without an end entry.")
@friendly
def verify(stack: str | None, run: str | None, trust: str | None, allow_open: bool) -> None:
    """Check every chain, signature and cross-region digest, and that the checkpoints and
    final weights on disk are the ones the ledger names. One line and exit 2 on failure."""
    from training.audit.verify import verify_run

    if (stack is None) == (run is None):
        raise LedgerError("give exactly one of --stack S or --run DIR")
    if stack is not None:
        from geotrain.commands import local_run_dir
        from infra.model import load_stack

        run_dir = local_run_dir(load_stack(stack))
    else:
        run_dir = Path(str(run))
    pins = None
    if trust is not None:
        shape = f'trust file {trust}: expected {{"<region>": "<hex public key>"}}'
        try:
            body = json.loads(Path(trust).read_text())
        except OSError as e:
            raise LedgerError(f"trust file {trust}: {e.strerror or e}") from None
        except ValueError:
            raise LedgerError(f"{shape}, not JSON") from None
        if not isinstance(body, dict):
            raise LedgerError(shape) from None
        bad = [str(k) for k, v in body.items() if not isinstance(v, str)]
        if bad:
            raise LedgerError(f"{shape}; {', '.join(bad)} has no hex string") from None
        pins = {str(k): v for k, v in body.items()}
    click.echo(verify_run(run_dir, pins, allow_open).summary())
