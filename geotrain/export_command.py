"""`geotrain export`: a run's final merged weights as a directory the lab's own tools load
(training.models.export): for hf: models a Hugging Face directory (safetensors, config,
tokenizer) that transformers' `from_pretrained` reads."""

from __future__ import annotations

from pathlib import Path

import click

from geotrain.options import STACK, friendly


@click.command("export")
@STACK
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Directory.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Default: .geotrain/<stack>.")
@click.option("--overwrite", is_flag=True, help="Replace a directory exported before.")
@friendly
def export_cmd(stack: str, out: str, run_dir: str | None, overwrite: bool) -> None:
    """Write the stack's final weights (RUN_DIR/final.pt) to --out."""
    import torch

    from geotrain.commands import local_run_dir
    from infra.model import load_stack
    from training.data.tokenizer import BYTES, tokenizer_for
    from training.errors import OutputError
    from training.models.build import build_model
    from training.models.export import export

    m = load_stack(stack)
    t = m.training
    final = Path(run_dir) if run_dir else local_run_dir(m)
    final = final / "final.pt"
    if not final.is_file():
        raise OutputError(
            f"{final} does not exist: the run has not finished; run geotrain train --stack "
            f"{m.stack} first, or give --run-dir where final.pt is"
        )
    state = torch.load(final, map_location="cpu", weights_only=True)
    model = build_model(t.model, t.seq_len)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise OutputError(
            f"{final} does not fit model {t.model} ({str(e).splitlines()[0][:120]}); export "
            "with the stack the run trained"
        ) from None
    ref = tokenizer_for(t.model, t.tokenizer)
    path = export(model, t.model, out, None if ref == BYTES else ref, overwrite=overwrite)
    click.echo(f"exported {t.model} from {final} to {path}")
