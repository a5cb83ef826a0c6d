"""Options and error handling shared by every `geotrain` command (a leaf module: the
command modules import it, and geotrain.cli imports them)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from training.errors import GeotrainError

STACK = click.option(
    "--stack",
    "-s",
    default="local",
    show_default=True,
    help="Stack name (stacks/Pulumi.<stack>.yaml) or a path to a stack file.",
)


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures (GeotrainError) become one line on stderr and their exit code
    (2), never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GeotrainError as e:
            click.echo(f"geotrain: error: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper
