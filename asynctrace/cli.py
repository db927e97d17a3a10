"""The ``asynctrace`` command line: a small click group."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TypeVar

# Ctrl-C while the command's modules load says so and exits 130.
try:
    import click

    from . import __version__
    from ._demo_config import DemoConfig
except KeyboardInterrupt:
    sys.stderr.write("asynctrace: stopped\n")
    raise SystemExit(130) from None

__all__ = ["main"]

_F = TypeVar("_F", bound=Callable[..., Any])
# The demo's options take their defaults from `DemoConfig`, so the two never disagree.
_DEMO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DemoConfig)}


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


def _demo_option(name: str, help: str, *, minimum: int | None = None, **kwargs: Any) -> Callable[[_F], _F]:
    """An option of `demo` for the `DemoConfig` field `name`, with that field's default."""
    flag = "--" + name.replace("_", "-")
    default = _DEMO_DEFAULTS[name]
    if isinstance(default, bool):
        flag += "/--no-" + flag[2:]
    if minimum is not None:
        kwargs["type"] = click.IntRange(min=minimum)
    return click.option(flag, default=default, show_default=True, help=help, **kwargs)


@main.command()
@_demo_option("project", "Trackio project to log to.", callback=_plain_name)
@_demo_option("run", "Run name (generated when omitted).", callback=_plain_name)
@_demo_option("archive", "Where the Parquet archive of every sample goes (in a folder named after the run).")
@_demo_option("steps", "Training steps.", minimum=1)
@_demo_option("workers", "Concurrent rollout workers.", minimum=1)
@_demo_option("group_size", "Completions per prompt.", minimum=2)
@_demo_option("prompts_per_step", "Groups the trainer consumes per step.", minimum=1)
@_demo_option("max_traces", "Traces sent to Trackio per step (whole groups, by reward spread).", minimum=1)
@_demo_option("max_staleness", "Policy versions a group may lag before the trainer drops it.", minimum=0)
@_demo_option("seed", "Seed of the simulated rollouts.")
@_demo_option("progress", "Show a progress bar.")
def demo(**options: Any) -> None:
    """Run a simulated asynchronous GRPO trainer, logged the recommended way: every sample to a
    Parquet archive, and the groups with the most reward spread plus a watched prompt to Trackio.

    Trackio stores projects under $TRACKIO_DIR when it is set, else in its default directory.
    Without pyarrow the archive is skipped, and the demo says so.
    Exits non-zero when any sample is lost or the accounting invariant does not hold.
    """
    # Loaded here, not with the command line: the demo's modules are most of a command's start
    # (a second of `asynctrace view`'s first open). Ctrl-C meanwhile says so, exits 130.
    try:
        from ._demo import main as run_demo
    except KeyboardInterrupt:
        sys.stderr.write("asynctrace: stopped\n")
        raise SystemExit(130) from None
    # Each option is named after a DemoConfig field: a missing or unknown one fails here.
    raise SystemExit(run_demo(DemoConfig(**options)))


@main.command()
@click.argument("spool_dir", type=click.Path(file_okay=False))
@click.option("--project", callback=_plain_name, help="Deliver to this project, not the spool's.")
@click.option("--run", callback=_plain_name, help="Deliver to this run, not the spool's.")
@click.option("--dead-letters", is_flag=True, help="Also retry records whose sink had failed for good.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def recover(spool_dir: str, project: str | None, run: str | None, dead_letters: bool, progress: bool) -> None:
    """Deliver the unacknowledged records of a spool (left by a killed trainer) to its sinks.

    The sinks the run had are made again from the setup the spool keeps (each Selected tier with
    its own selection; Trackio for a spool without one), and killed Parquet sinks' journals
    become files. Only asynctrace's own sinks are made, their arguments and paths checked first;
    a session whose setup names anything else keeps its records in the spool (pass your own
    sinks to asynctrace.recover in Python). Records a sink already holds are not written again.
    Torn or corrupt spool files are reported and skipped. Prints a summary, always. Exits 1 when
    some records were not delivered (records on corrupt lines, in files without a valid header,
    or kept back by their setup included), 2 when the spool cannot be used (missing,
    unreadable, in use).
    """
    from ._recover import main as run_recover

    raise SystemExit(
        run_recover(spool_dir, project=project, run=run, dead_letters=dead_letters, progress=progress)
    )


@main.command()
@click.argument("archive", type=click.Path(exists=True))
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8321, show_default=True, help="Port (0: any free one)."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--watch", "watch", multiple=True, help="A prompt id to list first on the overview (repeatable)."
)
@click.option(
    "--no-cache",
    is_flag=True,
    help=(
        "Index the archive afresh and keep no index in the viewer's cache for the next start"
        " (the archive's own by-prompt index, in its folder, is still read and written)."
    ),
)
def view(archive: str, port: int, host: str, watch: tuple[str, ...], no_cache: bool) -> None:
    """Browse a run's archive in a local web page: steps, GRPO groups, prompts across steps, tokens.

    ARCHIVE is a ParquetSink directory, or a JsonlSink file (or a directory of them). Needs the
    `view` extra: pip install "asynctrace[view]". Everything is served from this machine, and
    answered only to requests for 127.0.0.1, localhost, [::1] or the --host address. Each
    Parquet file's index is kept under $ASYNCTRACE_VIEW_CACHE (default: ~/.cache/asynctrace/view)
    so that the next start does not read the metadata again. Exits 1 when the archive cannot be
    read or the port is taken, 130 on Ctrl-C.
    """
    stopped = False
    try:
        from .view import cache_dir, require, serve

        try:
            require()
        except ImportError as exc:
            raise click.ClickException(str(exc)) from None

        def ready(url: str) -> None:
            click.echo(f"asynctrace view: {url}  (Ctrl-C to stop)")

        try:
            serve(
                archive,
                host=host,
                port=port,
                watch=watch,
                cache=None if no_cache else cache_dir(),
                ready=ready,
            )
        except (OSError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        # Ctrl-C, at any moment: the server stopped its indexing before this. The status is set
        # out here, once the interrupt (and the archive its traceback holds) is let go.
        stopped = True
    if stopped:
        click.echo("asynctrace view: stopped", err=True)
        raise SystemExit(130)
