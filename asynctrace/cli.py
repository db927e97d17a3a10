"""The ``asynctrace`` command line: a small click group; each command imports its implementation lazily."""

from __future__ import annotations

from typing import Any

import click

from . import __version__

__all__ = ["main"]


def _plain_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A project or run name Trackio can store (a usage error otherwise)."""
    from ._security import check_name

    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("must not be empty")
    try:
        check_name(f"--{param.name}", value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="asynctrace")
def main() -> None:
    """Log RL rollout traces from asynchronous trainers to Trackio and friends."""


@main.command()
@click.option(
    "--project",
    default="asynctrace-demo",
    show_default=True,
    callback=_plain_name,
    help="Trackio project to log to.",
)
@click.option("--run", default=None, callback=_plain_name, help="Run name (generated when omitted).")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Training steps.")
@click.option(
    "--workers", type=click.IntRange(min=1), default=4, show_default=True, help="Concurrent rollout workers."
)
@click.option(
    "--group-size", type=click.IntRange(min=2), default=8, show_default=True, help="Completions per prompt."
)
@click.option(
    "--prompts-per-step",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Groups the trainer consumes per step.",
)
@click.option(
    "--max-traces",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Traces kept per step (top_bottom sampler).",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Policy versions a group may lag before the trainer drops it.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the simulated rollouts.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def demo(**options: Any) -> None:
    """Run a simulated asynchronous GRPO trainer that logs its rollouts to a local Trackio project.

    Trackio stores projects under $TRACKIO_DIR when it is set, else in its default directory.
    Exits non-zero when any sample is lost or the accounting invariant does not hold.
    """
    from ._demo import DemoConfig
    from ._demo import main as run_demo

    # Each option is named after a DemoConfig field: a missing or unknown one fails here.
    raise SystemExit(run_demo(DemoConfig(**options)))


@main.command()
@click.argument("spool_dir", type=click.Path(file_okay=False))
@click.option("--project", default=None, help="Deliver to this Trackio project instead of the recorded one.")
@click.option("--run", default=None, help="Deliver to this run instead of the recorded one.")
@click.option("--dead-letters", is_flag=True, help="Also retry records whose sink had failed for good.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def recover(spool_dir: str, project: str | None, run: str | None, dead_letters: bool, progress: bool) -> None:
    """Deliver the unacknowledged records of a spool (left by a killed trainer) to Trackio.

    Records already in Trackio are not written again. Torn or corrupt spool files are reported
    and skipped. Exits 1 when some records could not be delivered (records on corrupt lines or in
    files without a valid header included), 2 when the spool cannot be used.
    """
    from ._recover import main as run_recover

    raise SystemExit(
        run_recover(spool_dir, project=project, run=run, dead_letters=dead_letters, progress=progress)
    )
