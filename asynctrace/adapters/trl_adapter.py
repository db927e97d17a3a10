"""TRL (GRPO): `attach` logs every batch a `GRPOTrainer` generates and scores; `to_samples` converts
TRL columns you already hold. Where `attach` hooks in, and what each sample holds: docs/frameworks/trl.md.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._records.types import Sample
from .._security import logger
from .._session import TraceSession
from .._sync import SyncTraceSession
from ..rollouts._align import MISSING, Shortfall
from ..rollouts._mapping import prompt_indices
from ._common import as_sequence, chat_messages, jsonable
from ._hooks import deliver, warn_once
from ._requires import UNCHANGED, Framework, Need, gaps, report

__all__ = ["GRPOTracer", "attach", "to_samples"]


_WHERE = "trl_adapter.to_samples"
_HOOK = "trl_adapter.attach"
_FRAMEWORK = Framework("TRL", "1.16.0", "trl")
_TESTED = f"{_FRAMEWORK.name} {_FRAMEWORK.tested}"
# Columns of GRPOTrainer._logs that hold one entry per generated row.
_ROW_COLUMNS = ("prompt", "completion", "advantages")
_TABLES = ("rewards", "extra")
# What `attach` wraps and reads on the trainer, as TRL 1.16's GRPOTrainer has it.
_NEEDS = (
    Need("_generate_and_score_completions", args=1),
    Need("_logs", keys=(*_ROW_COLUMNS, *_TABLES)),
    Need("reward_weights"),
    Need("reward_func_names"),
    Need("num_generations"),
    Need("num_generations_eval"),
    Need("args"),
    Need("state.global_step"),
    Need("model.training"),
    Need("accelerator.is_main_process"),
    Need("accelerator.num_processes"),
    Need("add_callback", args=1),
)


def to_samples(
    prompt: Sequence[Any],
    completion: Sequence[Any],
    *,
    rewards: Mapping[str, Sequence[float]] | None = None,
    advantages: Sequence[float] | None = None,
    extra: Mapping[str, Sequence[Any]] | None = None,
    num_generations: int | None = None,
    reward_weights: Sequence[float] | None = None,
) -> list[Sample]:
    """One sample per completion, with its prompt, rewards, advantage and extra columns.

    `num_generations` (completions per prompt, in blocks as TRL lays them out) adds
    `prompt_index`. Optional columns shorter than the completions are left out where they fall
    short, with one warning.
    """
    prompts = as_sequence(prompt, "prompt")
    completions = as_sequence(completion, "completion")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompt: has {len(prompts)} entries but completion has {n}")
    groups = None
    if num_generations is not None:
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"num_generations: expected a positive int, got {num_generations!r}")
        if n % num_generations:
            raise ValueError(f"num_generations: {n} completions are not whole groups of {num_generations}")
        groups = prompt_indices(n_prompts=n // num_generations, n_samples=n)
    columns = dict(rewards or {})
    # Plain floats: TRL keeps its weights as a tensor, whose elements would make `reward` a tensor.
    weights = (
        [float(w) for w in _weights(reward_weights)] if reward_weights is not None else [1.0] * len(columns)
    )
    if len(weights) != len(columns):
        raise ValueError(f"reward_weights: has {len(weights)} weights for {len(columns)} reward functions")
    own = {"sample_index"}
    if groups is not None:
        own.add("prompt_index")
    if columns:
        own |= {"reward", "reward_breakdown"}
    if advantages is not None:
        own.add("advantage")
    for name in extra or {}:
        if name in own:
            # Written last, it would silently replace the adapter's own value (the sampler ranks by reward).
            raise ValueError(
                f"extra[{name!r}]: clashes with a metadata key the adapter sets here; rename the column"
            )

    short = Shortfall(_WHERE, n)
    samples = []
    for i in range(n):
        messages = chat_messages(prompts[i], "user", f"prompt[{i}]") + chat_messages(
            completions[i], "assistant", f"completion[{i}]"
        )
        metadata: dict[str, Any] = {"sample_index": i}
        if groups is not None:
            metadata["prompt_index"] = groups[i]
        breakdown: dict[str, float | None] = {}
        total = 0.0
        for (name, column), weight in zip(columns.items(), weights, strict=True):
            value = short.pick(column, i, f"rewards[{name!r}]")
            if value is MISSING or value is None:
                continue
            value = float(value)
            if math.isnan(value):
                breakdown[name] = None
                continue
            breakdown[name] = value
            total += weight * value
        if columns and breakdown:
            metadata["reward_breakdown"] = breakdown
            # A row no reward function scored is unscorable: TRL sets its reward to NaN and leaves it
            # out of the baseline and of the logged mean, so it must not rank as best or worst here.
            scored = any(v is not None for v in breakdown.values())
            metadata["reward"] = total if scored else None
        advantage = short.pick(advantages, i, "advantages")
        if advantage is not MISSING and advantage is not None:
            metadata["advantage"] = float(advantage)
        for name, column in (extra or {}).items():
            value = short.pick(column, i, f"extra[{name!r}]")
            if value is not MISSING:
                metadata[name] = jsonable(value)
        samples.append(Sample(messages=messages, metadata=metadata))
    short.warn()
    return samples


def _weights(value: Any) -> list[Any]:
    """The reward weights as a list: a tensor or array (as TRL keeps them), or any iterable."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        return list(value)
    except TypeError:
        raise ValueError(
            f"reward_weights: expected a sequence of numbers, got {type(value).__name__}"
        ) from None


class _Tap(deque[Any]):
    """One of TRL's `_logs` deques that also keeps what was added since it was last drained.

    TRL's deques are bounded by the train generation batch, so an eval batch can be larger
    than what they keep; the tap sees every row whatever the bound.
    """

    def __init__(self, iterable: Iterable[Any] = (), maxlen: int | None = None) -> None:
        super().__init__(iterable, maxlen)
        self.taken: list[Any] = []

    def append(self, item: Any) -> None:
        self.taken.append(item)
        super().append(item)

    def extend(self, items: Iterable[Any]) -> None:
        items = list(items)
        self.taken.extend(items)
        super().extend(items)

    def drain(self) -> list[Any]:
        taken, self.taken = self.taken, []
        return taken


def _tapped(column: Any) -> _Tap:
    if isinstance(column, _Tap):
        return column
    maxlen = column.maxlen if isinstance(column, deque) else None
    return _Tap(column, maxlen)


class GRPOTracer:
    """What `attach` returns: the session it logs to, and how many batches it logged.

    On any process but the main one, and for a trainer without what the hook needs, it is inert
    (`session` is None) and the trainer is left untouched.
    """

    def __init__(
        self,
        trainer: Any,
        open_session: Callable[[], SyncTraceSession] | None,
        session: TraceSession | SyncTraceSession | None,
    ) -> None:
        self._trainer = trainer
        self._open_session = open_session  # set when the tracer owns (and finishes) its sessions
        self._session = session
        self._lock = threading.Lock()
        self.batches: dict[str, int] = {"train": 0, "eval": 0}
        """Batches logged so far, by split."""

    @property
    def session(self) -> TraceSession | SyncTraceSession | None:
        """The session batches go to (None on processes other than the main one, and, when TRL
        reports to Trackio, until training begins)."""
        return self._session

    def finish(self, timeout: float | None = None) -> None:
        """Finish the session this tracer opened (no-op for one you passed in); never raises.

        Called at the end of training. A batch generated later (`trainer.evaluate()` after
        `train()`) opens a new session on the same run, itself finished at exit.
        """
        with self._lock:
            session = self._session
            if self._open_session is None or not isinstance(session, SyncTraceSession):
                return
        try:
            session.finish(timeout)
        except Exception as exc:  # telemetry must never stop training
            logger.warning("asynctrace: %s: finishing the session failed (%s)", _HOOK, exc)

    # -- inside the trainer ------------------------------------------------------------

    def _current(self) -> TraceSession | SyncTraceSession:
        with self._lock:
            session = self._session
            if session is None or (
                self._open_session is not None
                and isinstance(session, SyncTraceSession)
                and not session.is_open
            ):
                if self._open_session is None:
                    raise RuntimeError("no session on this process")
                session = self._session = self._open_session()
            return session

    def _drain(self) -> tuple[dict[str, list[Any]], dict[str, dict[str, list[Any]]]]:
        """The rows TRL's `_logs` took since the last drain, by column; every per-row column is
        tapped first (new reward or extra columns too)."""
        logs = self._trainer._logs
        columns = {}
        for name in _ROW_COLUMNS:
            tap = logs[name] = _tapped(logs[name])
            columns[name] = tap.drain()
        tables = {}
        for name in _TABLES:
            table = logs[name]
            if not isinstance(table, defaultdict):
                raise TypeError(f"GRPOTrainer._logs[{name!r}] is a {type(table).__name__}, not a defaultdict")
            if not getattr(table.default_factory, "_asynctrace_tap", False):
                make = table.default_factory

                def tap_factory(make: Any = make) -> _Tap:
                    return _tapped(make() if make is not None else deque())

                tap_factory._asynctrace_tap = True  # type: ignore[attr-defined]
                table.default_factory = tap_factory
            for key in list(table):
                table[key] = _tapped(table[key])
            tables[name] = {key: tap.drain() for key, tap in table.items()}
        return columns, tables

    def _before(self) -> Exception | None:
        """Tap TRL's logs and forget rows a failed call left behind; the error if it cannot."""
        try:
            self._drain()
            return None
        except Exception as exc:  # a TRL version whose logs look different
            return exc

    def _after(self, split: str, step: int, problem: Exception | None, rows: int) -> None:
        """Log the batch `_generate_and_score_completions` just gathered (`rows` rows, by TRL's
        count), or count it when its logs could not be read; never raises."""
        try:
            session = self._current()
            if problem is not None:
                error = TypeError(f"cannot read GRPOTrainer._logs (tested with {_TESTED}): {problem}")
                convert = functools.partial(_raise, error)
                deliver(session, convert, rows=rows, step=step, split=split, where=_HOOK)
                return
            columns, tables = self._drain()
            completion = columns["completion"]
            if not completion:
                if rows:
                    # TRL generated rows but added none to `_logs["completion"]`: a version that
                    # fills its logs differently. Counted, never dropped silently.
                    error = TypeError(
                        f"GRPOTrainer._logs['completion'] got no rows for a batch of {rows} "
                        f"(tested with {_TESTED})"
                    )
                    deliver(
                        session,
                        functools.partial(_raise, error),
                        rows=rows,
                        step=step,
                        split=split,
                        where=_HOOK,
                    )
                return
            batch = self.batches[split] = self.batches.get(split, 0) + 1
            deliver(
                session,
                functools.partial(self._convert, session, split, batch - 1, columns, tables),
                rows=len(completion),
                step=step,
                split=split,
                where=_HOOK,
            )
        except Exception as exc:  # telemetry must never stop training
            warn_once(_HOOK, f"a batch could not be logged ({type(exc).__name__}: {exc})")

    def _convert(
        self,
        session: TraceSession | SyncTraceSession,
        split: str,
        batch: int,
        columns: dict[str, list[Any]],
        tables: dict[str, dict[str, list[Any]]],
    ) -> tuple[list[Sample], int]:
        trainer = self._trainer
        prompt, completion, advantages = columns["prompt"], columns["completion"], columns["advantages"]
        rewards, extra = tables["rewards"], tables["extra"]
        n = len(completion)
        names = list(trainer.reward_func_names)
        for name, column in [("prompt", prompt), ("advantages", advantages)] + [
            (f"rewards[{k!r}]", v) for k, v in rewards.items()
        ]:
            if len(column) != n:
                # Two reward functions of one name share a column in TRL: their rows cannot be told apart.
                raise ValueError(f"{name}: {len(column)} rows for {n} completions")
        if sorted(rewards) != sorted(names):
            raise ValueError(f"reward columns {sorted(rewards)} are not the reward functions {names}")
        num_generations = trainer.num_generations if split == "train" else trainer.num_generations_eval
        own = {"reward", "reward_breakdown", "advantage", "prompt_index", "sample_index", "batch_index"}
        renamed = {(f"extra.{k}" if k in own else k): v for k, v in extra.items()}
        samples = to_samples(
            prompt,
            completion,
            rewards={name: rewards[name] for name in names},
            advantages=advantages,
            extra={**renamed, "batch_index": [batch] * n},
            num_generations=num_generations,
            reward_weights=trainer.reward_weights,
        )
        target = session.session if isinstance(session, SyncTraceSession) else session
        if target.max_traces_per_step is None or not target.sampler.needs_score:
            return samples, 0
        # A sampler ranking by reward cannot place an unscorable row: it is left out and counted.
        kept = [s for s in samples if s.metadata.get("reward") is not None]
        return kept, len(samples) - len(kept)


def attach(
    trainer: Any,
    project: str | None = None,
    run: str | None = None,
    *,
    session: TraceSession | SyncTraceSession | None = None,
    **session_kwargs: Any,
) -> GRPOTracer:
    """Log every batch `trainer` (a TRL `GRPOTrainer`) generates and scores; call before `train()`.

    On the main process, opens a session (`TraceSession(project, run, **session_kwargs)`,
    started for synchronous use) on the project `args.project` and run `args.run_name` unless
    given, with the training arguments as the Trackio run's config, and finishes it at the end
    of training and at exit. When TRL reports to Trackio itself (``report_to="trackio"``), the
    session opens as training begins, right after TRL's own run, and joins that run by id.
    Pass `session=` to log to a session of your own instead (it is
    then yours to finish). Unscorable rows are left out and counted when the sampler ranks by
    reward. Raises here on a misconfiguration (not a `GRPOTrainer`, attached twice); a
    `GRPOTrainer` without what the hook wraps and reads (another TRL version) gets one warning
    naming what is missing and an inert tracer, and trains on unchanged. Once training runs,
    nothing raises into it.
    """
    if not any(cls.__name__ == "GRPOTrainer" for cls in type(trainer).__mro__):
        raise TypeError(
            f"attach: expected a trl.GRPOTrainer (tested with {_TESTED}), got {type(trainer).__name__}"
        )
    if getattr(trainer, "_asynctrace_tracer", None) is not None:
        raise ValueError("attach: this trainer is already attached; every batch would be logged twice")
    if session is not None and session_kwargs:
        raise ValueError(f"attach: give session= or session arguments, not both ({sorted(session_kwargs)})")
    problems = gaps(trainer, _NEEDS, type(trainer).__name__)
    if problems:
        # A TRL version that moved what the hook wraps: said once, the trainer left as it is.
        report(_FRAMEWORK, _HOOK, problems, UNCHANGED)
        return GRPOTracer(trainer, None, None)
    try:
        from transformers import TrainerCallback
    except ImportError as exc:  # pragma: no cover - a GRPOTrainer implies transformers
        raise ImportError(
            "asynctrace.adapters.trl_adapter.attach needs transformers (pip install trl)"
        ) from exc

    if not trainer.accelerator.is_main_process:
        # Every process holds the gathered batch; the main one alone logs it, once.
        return GRPOTracer(trainer, None, None)
    args = trainer.args
    open_session: Callable[[], SyncTraceSession] | None = None
    joining = False
    if session is None:
        # TRL's own Trackio run is opened at the start of training (TrackioCallback): the
        # session then opens right after it, to join that run by id (see `_TrlRun`).
        joining = "sinks" not in session_kwargs and _reports_to_trackio(trainer)
        names = _TrlRun(project or args.project, run or args.run_name, explicit_run=run is not None)
        open_session = functools.partial(_open, names, _config(args), dict(session_kwargs))
        if not joining:
            session = open_session()
    tracer = GRPOTracer(trainer, open_session, session)

    generate_and_score = trainer._generate_and_score_completions

    @functools.wraps(generate_and_score)
    def traced(*a: Any, **kw: Any) -> Any:
        try:
            # As TRL decides it: the model's mode is the split, the optimizer steps done the step.
            split = "train" if trainer.model.training else "eval"
            step = int(trainer.state.global_step)
            # TRL gathers equal local batches from every process.
            rows = len(a[0]) * int(trainer.accelerator.num_processes) if a else 0
            problem = tracer._before()
        except Exception as exc:  # telemetry must never stop training
            split, step, rows, problem = "train", 0, 0, exc
        output = generate_and_score(*a, **kw)
        tracer._after(split, step, problem, rows)
        return output

    class AsyncTraceCallback(TrainerCallback):  # type: ignore[misc]
        """Opens the session once TRL's Trackio run is open; finishes it when training ends."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # Added after TRL's callbacks, so TrackioCallback.on_train_begin has run.
            if joining:
                try:
                    tracer._current()
                except Exception as exc:  # telemetry must never stop training
                    warn_once(_HOOK, f"could not open the session ({type(exc).__name__}: {exc})")

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            tracer.finish()

    trainer._generate_and_score_completions = traced
    trainer._asynctrace_tracer = tracer
    trainer.add_callback(AsyncTraceCallback())
    return tracer


def _raise(error: Exception) -> tuple[list[Sample], int]:
    raise error


class _TrlRun:
    """The project and run a tracer logs to, and the id of TRL's own Trackio run once known.

    Trackio resumes a run by name only once the run has logged something, so TRL's process
    and the sink's writer opening one name at the same moment made two runs. Instead, the
    session opens after TRL's `trackio.init` (on this thread, whose context holds TRL's run)
    and its sink joins that run by id; the id is kept for sessions reopened after training.
    """

    def __init__(self, project: str, run: str | None, *, explicit_run: bool) -> None:
        self.project = project
        self.run = run
        self.run_id: str | None = None
        self._explicit_run = explicit_run

    def find_trackio_run(self) -> None:
        """Take the id (and, without a run name, the name) of TRL's current Trackio run."""
        if self.run_id is not None:
            return
        trackio = sys.modules.get("trackio")
        context = getattr(trackio, "context_vars", None)
        current = getattr(context, "current_run", None)
        found = current.get() if current is not None else None
        if found is None or getattr(found, "project", None) != self.project:
            return
        name, run_id = getattr(found, "name", None), getattr(found, "id", None)
        if not isinstance(name, str) or not isinstance(run_id, str):
            return
        if self.run is None and not self._explicit_run:
            self.run = name
        if name == self.run:
            self.run_id = run_id


def _reports_to_trackio(trainer: Any) -> bool:
    """Whether `trainer` logs its metrics to Trackio itself (``report_to`` names "trackio")."""
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if type(callback).__name__ == "TrackioCallback":
            return True
    return False


def _open(names: _TrlRun, config: dict[str, Any], kwargs: dict[str, Any]) -> SyncTraceSession:
    from ..sinks import TrackioSink

    kwargs = dict(kwargs)
    if "sinks" not in kwargs:
        names.find_trackio_run()
        kwargs["sinks"] = [TrackioSink(init_kwargs={"config": config}, run_id=names.run_id)]
    # One bad row is counted and skipped, not the batch around it.
    kwargs.setdefault("on_invalid", "skip")
    return TraceSession(names.project, names.run, **kwargs).start()


def _config(args: Any) -> dict[str, Any]:
    """The training arguments as plain JSON (TrainingArguments.to_dict masks tokens)."""
    try:
        config = jsonable(args.to_dict())
    except Exception:  # arguments that cannot be listed: the run goes without a config
        return {}
    return config if isinstance(config, dict) else {}
