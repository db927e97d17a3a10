"""prime-rl: `verifiers.v1.Episode`s to samples, and `TraceMonitor`, a monitor for its orchestrator.

Tested on prime-rl at commit 559b447 with verifiers 0.4.0. Where the monitor is registered,
the episode layout and the field mapping: docs/frameworks/prime_rl.md.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._records.types import Sample
from .._security import logger
from .._sync import SyncTraceSession
from ._common import field, jsonable, role_name
from ._hooks import Converted, count_invalid, deliver, warn_once
from ._requires import Framework, Need, gaps, refuse, report
from ._sessions import session_for

if TYPE_CHECKING:
    from .._session import TraceSession

__all__ = ["TraceMonitor", "register", "to_samples"]

_WHERE = "prime_rl_adapter.TraceMonitor"
_REGISTER = "prime_rl_adapter.register"
_PRIME_RL = Framework("prime-rl", "commit 559b447")
_VERIFIERS = Framework("verifiers", "0.4.0", "verifiers")
# What registering relies on in `prime_rl.monitors`: the registry its fan-out walks, and the
# fan-out's calls (every monitor's `log(data, step, kind, subset)` and `finalize()`).
_MONITORS_NEEDS = (
    Need("MONITORS.append", args=1),
    Need("log", args=4, coroutine=True),
    Need("finalize", coroutine=True),
)
# What the monitor reads of a `verifiers.v1.Episode`.
_EPISODE_NEEDS = (Need("id"), Need("traces"), Need("group"), Need("run"))
_TOKEN_FIELDS = ("token_ids", "loss_mask", "logprobs", "advantages")
# Message fields kept beside role and content: tool calls and the answers to them.
_CHAT_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
DEFAULT_SUBSETS: frozenset[tuple[str, str]] = frozenset({("train", "effective"), ("eval", "effective")})
"""The cohorts logged by default: what each step trains on, and each evaluation's clean rollouts."""


def _message(message: Any) -> dict[str, Any]:
    """A verifiers message (pydantic) as a chat dict: role, content, tool calls."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    out = {"role": role_name(data.get("role", "user")), "content": jsonable(data.get("content", ""))}
    for key in _CHAT_KEYS:
        if data.get(key) not in (None, [], ""):
            out[key] = jsonable(data[key])
    return out


def _branch_tokens(branch: Any) -> dict[str, list[Any]]:
    """Per-token arrays of a branch, as verifiers aligns them to its `token_ids`.

    The sampled mask, and log-probs and advantages spread from each node's sampled tokens (0.0
    elsewhere); NaN advantages where no node of the branch was assigned any.
    """
    for node in branch.nodes:
        sampled = sum(bool(m) for m in node.mask)
        if len(node.mask) != len(node.token_ids):
            raise ValueError(f"node mask: {len(node.mask)} values for {len(node.token_ids)} tokens")
        if node.advantages is not None and len(node.advantages) != sampled:
            raise ValueError(f"node advantages: {len(node.advantages)} values for {sampled} sampled tokens")
    ids = [int(t) for t in branch.token_ids]
    advantages = branch.advantages
    return {
        "token_ids": ids,
        "loss_mask": [int(bool(m)) for m in branch.sampled_mask],
        "logprobs": [float(v) for v in branch.logprobs],
        "advantages": [math.nan] * len(ids) if advantages is None else [float(v) for v in advantages],
    }


def _trace_sample(episode: Any, trace: Any, token_fields: Sequence[str]) -> Sample:
    """One trace (a root-to-leaf conversation of an episode) as a sample."""
    branches = trace.branches
    if not branches:
        raise ValueError(f"trace {trace.id!r}: has no messages")
    branch = branches[-1]
    messages = [_message(node.message) for node in branch.nodes]
    tokens = _branch_tokens(branch)
    assigned = [
        a for a, m in zip(tokens["advantages"], tokens["loss_mask"], strict=True) if m and not math.isnan(a)
    ]
    meta: dict[str, Any] = {"episode_id": str(episode.id), "trace_id": str(trace.id)}
    group = field(episode, "group")
    if group is not None:
        meta["group_uid"] = str(group.id)
    env = field(episode, "env")
    if env is not None and (env.name or env.id):
        meta["env"] = str(env.name or env.id)
    task_data = field(field(trace, "task"), "data")
    if field(task_data, "idx") is not None:
        meta["task_idx"] = int(task_data.idx)
    reward = float(trace.reward)
    if math.isfinite(reward):
        meta["reward"] = reward
    if trace.rewards:
        meta["reward_breakdown"] = {
            name: None if r is None else jsonable(r.model_dump()) for name, r in trace.rewards.items()
        }
    if assigned:
        meta["advantage"] = sum(assigned) / len(assigned)
    work = field(field(episode, "run"), "work")
    if work is not None:
        if field(work, "step") is not None:
            meta["generated_at_step"] = int(work.step)
        policy = field(work, "policy")
        if policy is not None:
            meta["policy_version_min"] = int(policy.start)
            meta["policy_version_max"] = int(policy.end)
    meta["num_turns"] = int(trace.num_turns)
    meta["prompt_len"] = next((i for i, m in enumerate(tokens["loss_mask"]) if m), len(tokens["loss_mask"]))
    meta["response_len"] = len(tokens["token_ids"]) - meta["prompt_len"]
    if trace.has_error:
        meta["error"] = True
    if trace.is_truncated:
        meta["truncated"] = True
    if trace.metrics:
        meta["metrics"] = jsonable(dict(trace.metrics))
    kept = {name: tokens[name] for name in token_fields}
    return Sample(messages=messages, metadata=meta, tokens=kept or None)


def _convert(episodes: Iterable[Any], token_fields: Sequence[str]) -> Converted:
    if isinstance(token_fields, str) or not set(token_fields) <= set(_TOKEN_FIELDS):
        raise ValueError(f"token_fields: expected names from {list(_TOKEN_FIELDS)}, got {token_fields!r}")
    if isinstance(episodes, (str, bytes, Mapping)) or not isinstance(episodes, Iterable):
        raise ValueError(f"episodes: expected a list of verifiers Episodes, got {type(episodes).__name__}")
    samples: list[Sample] = []
    skipped = 0
    groups: dict[str, int] = {}
    for episode in episodes:
        traces = field(episode, "traces")
        if not traces:
            skipped += 1  # an episode that errored before any trace: nothing to show
            continue
        for trace in traces:
            try:
                sample = _trace_sample(episode, trace, token_fields)
            except (ValueError, TypeError, AttributeError, KeyError):
                skipped += 1
                continue
            meta = sample.metadata
            meta["sample_index"] = len(samples)
            meta["prompt_index"] = groups.setdefault(meta.get("group_uid", meta["episode_id"]), len(groups))
            samples.append(sample)
    return samples, skipped


def to_samples(episodes: Iterable[Any], *, token_fields: Sequence[str] = ()) -> list[Sample]:
    """One sample per trace of each `verifiers.v1.Episode`, in order; unreadable traces are left out.

    The messages are the trace's final branch (prompt, then each turn); `token_fields` keeps its
    per-token ``token_ids``, ``loss_mask`` (sampled tokens), ``logprobs`` and ``advantages``.
    The mapping: docs/frameworks/prime_rl.md.
    """
    return list(_convert(episodes, token_fields)[0])


class TraceMonitor:
    """A prime-rl monitor that logs episodes to an asynctrace session.

    Registered beside prime-rl's own monitors (``monitors.MONITORS.append(...)``), it receives
    what the orchestrator hands every monitor: ``log(episodes, step, kind, subset)``, with the
    train cohort at ship time (advantages assigned) and each evaluation. `subsets` names the
    ``(kind, subset)`` cohorts to log. It never raises: unreadable traces are counted in
    ``session.stats().dropped["invalid"]`` with one warning. `session` is an open session, or a
    project name: the first call then opens the process's session for it
    (`TraceSession(project, on_full="drop_newest").start()`), finished by `finalize`.
    """

    def __init__(
        self,
        session: TraceSession | SyncTraceSession | str,
        *,
        subsets: Collection[tuple[str, str]] = DEFAULT_SUBSETS,
        token_fields: Sequence[str] = (),
    ) -> None:
        if isinstance(token_fields, str) or not set(token_fields) <= set(_TOKEN_FIELDS):
            raise ValueError(f"token_fields: expected names from {list(_TOKEN_FIELDS)}, got {token_fields!r}")
        self.session = session
        self.subsets = frozenset((str(kind), str(subset)) for kind, subset in subsets)
        self.token_fields = tuple(token_fields)

    async def init(self, **kwargs: Any) -> None:
        """Nothing to set up: the session opens on the first episodes."""

    async def log(self, data: Any, step: int, kind: str = "train", subset: str = "effective") -> None:
        """prime-rl's fan-out entry: scalar metrics (ignored) or episodes with their cohort."""
        if isinstance(data, dict):
            await self.log_metrics(data, step=step)
            return
        episodes = data if isinstance(data, list) else [data]
        await self.log_episodes(episodes, step=step, kind=kind, subset=subset)

    async def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Scalar metrics stay with prime-rl's own monitors."""

    async def log_episodes(self, episodes: list[Any], step: int, kind: str, subset: str) -> None:
        """Log one cohort of episodes at `step` (split `kind`); never raises."""
        if (kind, subset) not in self.subsets:
            return
        target = session_for(self.session, on_full="drop_newest", where=_WHERE)
        if target is None:
            return
        rows = len(episodes)
        first = episodes[0] if episodes else None
        if first is not None and not isinstance(first, Mapping):
            problems = gaps(first, _EPISODE_NEEDS, type(first).__name__)
            if problems:
                refuse(_VERIFIERS, _WHERE, problems, target, rows)
                return
        try:
            at_step = int(step)
        except (TypeError, ValueError) as exc:  # telemetry must never stop training
            warn_once(_WHERE, f"step {step!r} is not an integer ({exc})")
            count_invalid(target, rows)
            return

        def send() -> int:
            convert = lambda: _convert(episodes, self.token_fields)  # noqa: E731
            return deliver(target, convert, rows=rows, step=at_step, split=kind, where=_WHERE)

        try:
            if isinstance(target, SyncTraceSession):
                # Converting is pure Python over every token, and a blocking session may wait:
                # off the orchestrator's event loop, as prime-rl's FileMonitor writes its records.
                await asyncio.to_thread(send)
            else:
                send()  # an async session on this loop takes the samples without waiting
        except Exception:  # telemetry must never stop training
            logger.warning("asynctrace: %s: a cohort could not be logged", _WHERE, exc_info=True)

    async def finalize(self) -> None:
        """Finish the session this monitor opened (one passed in is the caller's to finish)."""
        if not isinstance(self.session, str):
            return
        session = session_for(self.session, on_full="drop_newest", where=_WHERE)
        if session is None:
            return
        try:
            await asyncio.to_thread(session.finish)
        except Exception:  # the run ends either way; what was not delivered is in stats
            logger.warning("asynctrace: %s: finishing the session failed", _WHERE, exc_info=True)


def register(
    monitors: Any,
    session: TraceSession | SyncTraceSession | str,
    *,
    subsets: Collection[tuple[str, str]] = DEFAULT_SUBSETS,
    token_fields: Sequence[str] = (),
) -> TraceMonitor | None:
    """Register a `TraceMonitor` in prime-rl's monitor registry, after ``monitors.setup(...)``.

    `monitors` is the orchestrator's ``prime_rl.monitors`` module; the other arguments are
    `TraceMonitor`'s. Returns the monitor; None, with one warning naming what is missing, where
    the registry or its fan-out is not as in the prime-rl version tested (nothing would ever call
    the monitor): the orchestrator goes on, without it.
    """
    problems = gaps(monitors, _MONITORS_NEEDS, getattr(monitors, "__name__", "monitors"))
    if problems:
        report(_PRIME_RL, _REGISTER, problems, "nothing is logged, and the orchestrator runs on unchanged")
        return None
    monitor = TraceMonitor(session, subsets=subsets, token_fields=token_fields)
    monitors.MONITORS.append(monitor)
    return monitor
