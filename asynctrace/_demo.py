"""`asynctrace demo`: a simulated asynchronous GRPO run, logged the way docs/choosing.md recommends.

Rollout workers (anyio tasks) sample a prompt from a small built-in corpus, "generate" a group
of completions with the policy version they last synced, score them and send the group into a
bounded memory stream. The trainer consumes groups with some staleness (policy version lag),
drops groups that are too stale, trains on one group of the watched prompt and
``prompts_per_step - 1`` others a step, logs every sample it trains on through one
`TraceSession` plus per-step metrics, and bumps the policy version.

The session writes every sample to a Parquet archive (what `asynctrace view` reads) and, to
Trackio, the group sampler's pick (``GroupSampler("top", stat="spread", group_size=n)``: the
groups with the most reward spread) plus the watched prompt at every step. Without pyarrow the
archive is skipped, and the demo says so. Token counts come from a byte-level BPE tokenizer
trained on the corpus at start-up with the `tokenizers` library; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import os
import random
import re
import shlex
import statistics
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from ._demo_config import DemoConfig
from ._records.types import Sample
from ._security import generated_run_name
from ._select.groups import GroupSampler
from ._select.watch import Watch
from ._session import TraceSession
from ._stats import SessionStats, SinkStats
from .rollouts import decode_rollouts
from .sinks import ParquetSink, Selected, Sink, TrackioSink

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["DemoConfig", "DemoResult", "DemoRun", "Problem", "build_tokenizer", "format_summary"]

DATASET = "asynctrace-demo-math"
# The prompt the watch list follows at every step (Tom's pencils: solved more often as training goes on).
WATCHED = 5
SPECIAL_TOKENS = ("<|user|>", "<|assistant|>", "<|end|>")
MAX_NEW_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt of the built-in corpus: a question, its integer answer, a worked solution."""

    question: str
    answer: int
    work: str
    difficulty: float  # 0 (easy) .. 2 (hard): lowers the simulated policy's chance of solving it
    # An expression the policy hands a calculator tool first (a multi-turn rollout), or "".
    tool: str = ""


CORPUS: tuple[Problem, ...] = (
    Problem("What is 17 + 25?", 42, "17 + 25 = 42", 0.0),
    Problem("What is 9 * 8?", 72, "9 * 8 = 72", 0.1),
    Problem("What is 144 / 12?", 12, "144 / 12 = 12", 0.3),
    Problem("What is 83 - 47?", 36, "83 - 47 = 36", 0.2),
    Problem("What is 15% of 240?", 36, "240 * 0.15 = 36", 0.8),
    Problem(
        "Tom has 3 boxes with 12 pencils each. He gives away 7 pencils. How many pencils does he have left?",
        29,
        "3 * 12 = 36, then 36 - 7 = 29",
        0.9,
        "3 * 12 - 7",
    ),
    Problem(
        "A train travels 60 km per hour for 3 hours. How many km does it travel?", 180, "60 * 3 = 180", 0.4
    ),
    Problem(
        "Sara reads 14 pages a day. How many pages does she read in 2 weeks?",
        196,
        "2 weeks is 14 days, and 14 * 14 = 196",
        1.0,
    ),
    Problem("What is the sum of the first 10 positive integers?", 55, "10 * 11 / 2 = 55", 0.9),
    Problem("A rectangle is 7 cm wide and 9 cm long. What is its area in square cm?", 63, "7 * 9 = 63", 0.3),
    Problem("What is 2 to the power of 10?", 1024, "2^10 = 1024", 0.7),
    Problem(
        "A shirt costs 40 dollars and is on sale for 25% off. What is the sale price in dollars?",
        30,
        "40 * 0.25 = 10 off, and 40 - 10 = 30",
        1.0,
        "40 - 40 * 0.25",
    ),
    Problem("What is the remainder when 100 is divided by 7?", 2, "7 * 14 = 98, and 100 - 98 = 2", 1.1),
    Problem(
        "If 5 apples cost 3 dollars, how many dollars do 20 apples cost?", 12, "20 / 5 = 4, 4 * 3 = 12", 0.9
    ),
    Problem("What is 13 squared?", 169, "13 * 13 = 169", 0.6),
    Problem(
        "A class has 28 students and 4 of every 7 students are girls. How many girls are in the class?",
        16,
        "28 / 7 = 4 groups, 4 * 4 = 16",
        1.3,
    ),
    Problem(
        "What is the greatest common divisor of 48 and 36?", 12, "48 = 4 * 12 and 36 = 3 * 12, so 12", 1.2
    ),
    Problem(
        "What is the least common multiple of 4 and 6?", 12, "multiples of 6: 6, 12; 12 / 4 = 3, so 12", 0.8
    ),
    Problem("Maria is 3 times as old as her son, who is 11. How old is Maria?", 33, "3 * 11 = 33", 0.5),
    Problem(
        "A bakery bakes 6 trays of 24 muffins and sells all but 10. How many muffins were sold?",
        134,
        "6 * 24 = 144, and 144 - 10 = 134",
        1.2,
        "6 * 24 - 10",
    ),
    Problem("What is 1000 - 357?", 643, "1000 - 357 = 643", 0.6),
    Problem("How many minutes are in 3.5 hours?", 210, "3.5 * 60 = 210", 0.7),
    Problem("What is the perimeter of a square with sides of length 13?", 52, "4 * 13 = 52", 0.5),
    Problem(
        "A car uses 8 liters of fuel per 100 km. How many liters does it need for 350 km?",
        28,
        "350 / 100 = 3.5, and 3.5 * 8 = 28",
        1.4,
        "350 / 100 * 8",
    ),
    Problem("What is 6 factorial?", 720, "6 * 5 * 4 * 3 * 2 * 1 = 720", 1.0),
    Problem("Solve for x: 3x + 7 = 40.", 11, "3x = 40 - 7 = 33, so x = 33 / 3 = 11", 1.3),
    Problem("What is the average of 12, 18 and 30?", 20, "12 + 18 + 30 = 60, and 60 / 3 = 20", 0.9),
    Problem(
        "A pool fills at 15 liters per minute. How many minutes does it take to fill 450 liters?",
        30,
        "450 / 15 = 30",
        0.8,
    ),
    Problem(
        "How many edges does a cube have?", 12, "4 on top, 4 on the bottom and 4 upright: 4 + 4 + 4 = 12", 1.5
    ),
    Problem(
        "Ben saves 35 dollars a week. How many weeks until he has at least 300 dollars?",
        9,
        "300 / 35 = 8.57, so he needs 9 whole weeks",
        2.0,
    ),
)

_OPENERS = ("", "Let me think step by step. ", "First, read the question carefully. ", "Okay. ")
_DETOUR = "Hmm, wait, let me re-read the question and check each number again. "
_ANSWER = re.compile(r"The answer is (-?\d+)\.")


# -- tokenizer ----------------------------------------------------------------------------------


def _tool_call(expression: str) -> str:
    """The text of a call to the calculator tool, as the policy writes it."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{orjson.dumps(call).decode()}</tool_call>"


def _training_text() -> Iterator[str]:
    for p in CORPUS:
        yield p.question
        yield f"{p.work}. The answer is {p.answer}."
        if p.tool:
            yield _tool_call(p.tool)
    yield from _OPENERS
    yield _DETOUR
    yield "I believe it is about"


def build_tokenizer(vocab_size: int = 600) -> Tokenizer:
    """Train a small byte-level BPE tokenizer on the built-in corpus (in-process, nothing downloaded)."""
    from .rollouts import toy_tokenizer

    tokenizer: Tokenizer = toy_tokenizer(
        vocab_size, corpus=list(_training_text()), special_tokens=SPECIAL_TOKENS
    )
    return tokenizer


# -- the simulated policy -----------------------------------------------------------------------


@dataclass(slots=True)
class Turn:
    """A stretch of a completion's tokens: what the policy generated, or a tool's output (not
    generated: no log-probs), with the log-probs of the rollout engine that sampled each token
    and of the trainer that recomputed them (NaN where there are none)."""

    generated: bool
    ids: list[int]
    logprobs: list[float]
    ref_logprobs: list[float]


@dataclass(slots=True)
class Completion:
    turns: list[Turn]
    response: str  # the last turn's text, which the reward reads
    reward: float
    breakdown: dict[str, float]
    stop_reason: str
    response_len: int  # tokens the policy generated
    tool: str = ""  # the calculator expression it called, if any


@dataclass(slots=True)
class Group:
    """A prompt and `group_size` scored completions, generated with one policy version."""

    worker: int
    seq: int
    prompt_index: int
    prompt_ids: list[int]
    policy_version: int
    completions: list[Completion]
    seconds: float  # how long generating the group took


@dataclass(slots=True)
class _Policy:
    version: int = 0


@dataclass(slots=True)
class _Counters:
    groups_generated: int = 0
    groups_used: int = 0
    groups_stale: int = 0
    groups_zero_signal: int = 0


def _solve_probability(problem: Problem, version: int) -> float:
    """The simulated policy gets better as training goes on, more slowly on harder problems."""
    skill = 0.15 * version - 0.2
    return 1.0 / (1.0 + math.exp(-(1.6 * (skill - problem.difficulty) + 1.2)))


def _generate(
    pieces: list[tuple[str, float]], rng: random.Random, tokenizer: Tokenizer, room: int
) -> tuple[Turn, bool]:
    """The policy's turn writing `pieces` (text, how unsure it is: the mean of -log-prob over its
    tokens), ended by `<|end|>`, cut at `room` tokens; and whether it was cut."""
    ids: list[int] = []
    logprobs: list[float] = []
    for text, unsure in [*pieces, ("<|end|>", 0.01)]:
        piece = tokenizer.encode(text).ids
        ids += piece
        logprobs += [-min(12.0, rng.expovariate(1 / unsure)) for _ in piece]
    # The trainer recomputes each log-prob: close to the engine's, now and then far off (the
    # training-inference mismatch), more on the tokens the policy was unsure of.
    ref = [
        lp + (rng.uniform(-1.2, 1.2) if rng.random() < 0.015 else rng.gauss(0.0, 0.005 + 0.02 * -lp))
        for lp in logprobs
    ]
    cut = len(ids) > room
    return Turn(True, ids[:room], logprobs[:room], ref[:room]), cut


def _complete(problem: Problem, version: int, rng: random.Random, tokenizer: Tokenizer) -> Completion:
    """One completion as the policy's tokens, scored by a rule-based reward: 1 when correct, 0.1
    for the answer's format, -0.2 when cut at the token budget. With no noise in it, a group whose
    completions all get the same reward (all right, or all wrong) gives no learning signal."""
    solved = rng.random() < _solve_probability(problem, version)
    answer = problem.answer if solved else problem.answer + rng.choice((-10, -2, -1, 1, 2, 10))
    work = problem.work if solved else problem.work.replace(str(problem.answer), str(answer))
    unsure = 0.05 if solved else 0.5
    pieces: list[tuple[str, float]] = [(rng.choice(_OPENERS), 0.3)]
    style = rng.random()
    if style < 0.04:  # forgets the answer format
        pieces += [(f"{work}. I believe it is about ", unsure), (str(answer), 0.1 if solved else 2.5)]
    elif style < 0.04 + max(0.02, 0.12 - 0.006 * version):  # rambles past the token budget
        pieces += [(_DETOUR * rng.randint(3, 6), 0.8), (f"{work}. The answer is {answer}.", unsure)]
    else:
        pieces += [(f"{work}. The answer is ", unsure), (f"{answer}.", 0.05 if solved else 2.5)]
    turns: list[Turn] = []
    if problem.tool:
        turn, _ = _generate([(_tool_call(problem.tool), 0.05)], rng, tokenizer, MAX_NEW_TOKENS)
        result = tokenizer.encode(str(problem.answer)).ids
        nan = [math.nan] * len(result)
        turns += [turn, Turn(False, result, nan, nan)]
    room = MAX_NEW_TOKENS - sum(len(t.ids) for t in turns if t.generated)
    last, cut = _generate(pieces, rng, tokenizer, room)
    turns.append(last)
    text = tokenizer.decode(last.ids)
    stop_reason = "length" if cut else "stop"
    match = _ANSWER.search(text)
    correct = 1.0 if match is not None and int(match.group(1)) == problem.answer else 0.0
    fmt = 0.1 if match is not None else 0.0
    length = -0.2 if cut else 0.0
    return Completion(
        turns=turns,
        response=text,
        reward=round(correct + fmt + length, 4),
        breakdown={"correct": correct, "format": fmt, "length": length},
        stop_reason=stop_reason,
        response_len=sum(len(t.ids) for t in turns if t.generated),
        tool=problem.tool,
    )


async def _rollout_worker(
    worker: int,
    cfg: DemoConfig,
    tokenizer: Tokenizer,
    policy: _Policy,
    counters: _Counters,
    send: ObjectSendStream[Group],
) -> None:
    """Generate groups forever with the latest synced policy; the bounded stream applies backpressure."""
    rng = random.Random(cfg.seed * 1_000_003 + worker)
    async with send:
        for seq in itertools.count():
            version = policy.version  # the weights this worker synced before generating
            # The data loader puts the watched prompt in about one group in `prompts_per_step`,
            # as many as the trainer takes of it.
            index = WATCHED if rng.random() < 1 / cfg.prompts_per_step else rng.randrange(len(CORPUS))
            problem = CORPUS[index]
            completions = [_complete(problem, version, rng, tokenizer) for _ in range(cfg.group_size)]
            # Generation time grows with the longest completion, as with batched decoding.
            longest = max(c.response_len for c in completions)
            seconds = rng.uniform(0.02, 0.05) + 0.0012 * longest
            await anyio.sleep(seconds)
            prompt_ids = tokenizer.encode(problem.question).ids
            counters.groups_generated += 1
            await send.send(Group(worker, seq, index, prompt_ids, version, completions, seconds))


def _advantages(rewards: list[float]) -> list[float]:
    """GRPO: rewards normalised within the group (zero when every completion scored the same)."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [round((r - mean) / (std + 1e-4), 4) for r in rewards]


def prompt_id(index: int) -> str:
    """The stable id of a corpus prompt: what the watch list and `asynctrace view` follow across steps."""
    return f"math-{index:02d}"


def _samples(group: Group, step: int, staleness: int, tokenizer: Tokenizer) -> list[Sample]:
    """The group's completions as a trainer logs them: token ids decoded into chat turns by
    `decode_rollouts`, with their token fields (ids, loss mask, both log-prob series; the token
    page's text_ends come with them), and a tool call also as `tool_calls`, as a chat API gives it."""
    problem = CORPUS[group.prompt_index]
    prompt = group.prompt_ids
    rows: list[list[int]] = []
    masks: list[list[int]] = []
    logprobs: list[list[float]] = []
    refs: list[list[float]] = []
    for c in group.completions:
        rows.append(prompt + [i for t in c.turns for i in t.ids])
        masks.append([0] * len(prompt) + [int(t.generated) for t in c.turns for _ in t.ids])
        logprobs.append([math.nan] * len(prompt) + [v for t in c.turns for v in t.logprobs])
        refs.append([math.nan] * len(prompt) + [v for t in c.turns for v in t.ref_logprobs])
    uid = f"w{group.worker}-g{group.seq}"
    samples = decode_rollouts(
        rows,
        tokenizer=tokenizer,
        loss_mask=masks,
        rewards=[c.reward for c in group.completions],
        metadata={
            "advantage": _advantages([c.reward for c in group.completions]),
            "reward_breakdown": [c.breakdown for c in group.completions],
            "stop_reason": [c.stop_reason for c in group.completions],
            "generation_time": round(group.seconds, 4),
            "dataset": DATASET,
            "prompt_id": prompt_id(group.prompt_index),
            "group_uid": uid,
            "prompt_index": group.prompt_index,
            "trajectory_id": [f"{uid}-s{i}" for i in range(len(rows))],
            "model_step": step,
            "policy_version": group.policy_version,
            "staleness": staleness,
            "generated_len": [c.response_len for c in group.completions],
            "ground_truth": problem.answer,
            "worker": group.worker,
        },
        token_fields={"token_ids": rows, "loss_mask": masks, "logprobs": logprobs, "ref_logprobs": refs},
    )
    for i, (sample, c) in enumerate(zip(samples, group.completions, strict=True)):
        if c.tool:
            call_id = f"call-{uid}-{i}"
            arguments = orjson.dumps({"expression": c.tool}).decode()
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": "calculator", "arguments": arguments},
            }
            sample.messages[1]["tool_calls"] = [call]
            sample.messages[2].update(tool_call_id=call_id, name="calculator")
    return samples


def _step_metrics(
    groups: list[Group], staleness: list[int], version: int, stale_total: int
) -> dict[str, float]:
    comps = [c for g in groups for c in g.completions]
    rewards = [c.reward for c in comps]
    flat = sum(1 for g in groups if len({c.reward for c in g.completions}) == 1)
    advantages = [a for g in groups for a in _advantages([c.reward for c in g.completions])]
    return {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "accuracy": statistics.fmean(c.breakdown["correct"] for c in comps),
        "format_rate": statistics.fmean(1.0 if c.breakdown["format"] else 0.0 for c in comps),
        "truncated_rate": statistics.fmean(1.0 if c.stop_reason == "length" else 0.0 for c in comps),
        "advantage/abs_mean": statistics.fmean(abs(a) for a in advantages),
        "groups/zero_advantage_frac": flat / len(groups),
        "response_len/mean": statistics.fmean(c.response_len for c in comps),
        "staleness/mean": statistics.fmean(staleness),
        "staleness/max": float(max(staleness)),
        "groups/stale_dropped_total": float(stale_total),
        "policy_version": float(version),
    }


async def _trainer(
    cfg: DemoConfig,
    session: TraceSession,
    tokenizer: Tokenizer,
    policy: _Policy,
    counters: _Counters,
    receive: ObjectReceiveStream[Group],
    progress: Any,
) -> None:
    """Consume groups (one of the watched prompt and `prompts_per_step - 1` others a step), log
    each one as it is trained on, then take an optimizer step. A group the step has no room for
    waits in a buffer for the next one, as in a replay buffer."""
    buffer: deque[Group] = deque()
    for step in range(cfg.steps):
        groups: list[Group] = []
        staleness: list[int] = []
        wanted = {True: 1, False: cfg.prompts_per_step - 1}  # watched, others
        spare: deque[Group] = deque()
        while wanted[True] or wanted[False]:
            group = buffer.popleft() if buffer else await receive.receive()
            lag = policy.version - group.policy_version
            if lag > cfg.max_staleness:  # too off-policy to train on
                counters.groups_stale += 1
                continue
            watched = group.prompt_index == WATCHED
            if not wanted[watched]:
                spare.append(group)
                continue
            wanted[watched] -= 1
            groups.append(group)
            staleness.append(lag)
            await session.log_samples(_samples(group, step, lag, tokenizer), step=step)
        buffer = spare + buffer
        counters.groups_used += len(groups)
        counters.groups_zero_signal += sum(1 for g in groups if len({c.reward for c in g.completions}) == 1)
        metrics = _step_metrics(groups, staleness, policy.version, counters.groups_stale)
        await session.log_metrics(metrics, step=step)
        await anyio.sleep(0.06)  # the optimizer step
        policy.version += 1  # new weights: workers pick them up for their next group
        if progress is not None:
            progress.set_postfix(
                reward=f"{metrics['reward/mean']:.2f}",
                acc=f"{metrics['accuracy']:.2f}",
                stale=f"{metrics['staleness/mean']:.1f}",
                refresh=False,
            )
            progress.update(1)


# -- running it ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What a demo run did: the session's final accounting plus the simulated trainer's counts."""

    project: str
    run: str
    steps: int
    steps_done: int
    stats: SessionStats
    trackio_finished: bool
    groups_generated: int
    groups_used: int
    groups_stale: int
    samples_per_step: int
    elapsed: float
    groups_zero_signal: int = 0
    trackio_dir: str | None = None
    problems: tuple[str, ...] = ()
    # The Parquet archive of every sample (absolute), or None when it was skipped (`archive_skipped`).
    archive: str | None = None
    archive_skipped: str | None = None
    max_traces: int = 0
    group_size: int = 0
    watched: str = ""

    @property
    def ok(self) -> bool:
        """True when the accounting invariant holds, nothing was lost, and the Trackio run was finished."""
        return not self.problems


def trackio_dir() -> str | None:
    """Where Trackio keeps local projects: ``$TRACKIO_DIR``, else its default under the HF cache."""
    env = os.environ.get("TRACKIO_DIR")
    if env:
        return env
    try:
        from huggingface_hub.constants import HF_HOME
    except ImportError:  # pragma: no cover - trackio depends on huggingface_hub
        return None
    return os.path.join(HF_HOME, "trackio")


def archive_sink(directory: Path) -> tuple[ParquetSink | None, str | None]:
    """The Parquet archive's sink, or None and why it was skipped (pyarrow is not installed)."""
    try:
        return ParquetSink(directory), None
    except ImportError as exc:
        return None, str(exc)


class DemoRun:
    """One demo run: its session and the simulated trainer's counters, readable even after an interrupt."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        run = cfg.run or generated_run_name()
        self.archive_dir = Path(cfg.archive, run).absolute()
        self.archive, self.archive_skipped = archive_sink(self.archive_dir)
        self.trackio = TrackioSink()
        # The tracker tier docs/choosing.md recommends: the groups with the most reward spread.
        tier = Selected(
            self.trackio,
            max_traces_per_step=cfg.max_traces,
            sampler=GroupSampler("top", stat="spread", group_size=cfg.group_size),
        )
        sinks: list[Sink] = [tier] if self.archive is None else [self.archive, tier]
        self.session = TraceSession(
            cfg.project,
            run=run,
            sinks=sinks,
            # The watch list passes every selection by: the watched prompt's whole group, every step.
            watch=Watch(ids=[prompt_id(WATCHED)], max_per_step=max(16, cfg.group_size)),
        )
        self.policy = _Policy()
        self.counters = _Counters()
        self.started = time.perf_counter()

    async def run(self) -> DemoResult:
        """Run the simulated asynchronous GRPO loop and return its accounting."""
        cfg = self.cfg
        self.started = time.perf_counter()
        tokenizer = build_tokenizer()
        send, receive = anyio.create_memory_object_stream[Group](max_buffer_size=cfg.workers)
        # The session outlives the workers and the trainer: `__aexit__` drains and finishes the
        # Trackio run even when the body fails or is interrupted.
        async with self.session as session:
            # Not needed for correctness: an empty flush returns once every sink is open, so
            # Trackio's start-up banner prints before the progress bar instead of through it.
            await session.flush(timeout=30.0)
            progress: Any = None
            if cfg.progress:
                from tqdm import tqdm

                progress = tqdm(total=cfg.steps, desc="training", unit="step", dynamic_ncols=True)
            try:
                async with anyio.create_task_group() as tg, receive:
                    for w in range(cfg.workers):
                        tg.start_soon(
                            _rollout_worker, w, cfg, tokenizer, self.policy, self.counters, send.clone()
                        )
                    send.close()
                    await _trainer(cfg, session, tokenizer, self.policy, self.counters, receive, progress)
                    tg.cancel_scope.cancel()  # training is done: stop generating
            finally:
                if progress is not None:
                    progress.close()
        return self.result()

    def result(self) -> DemoResult:
        """The run's accounting so far (final once the session has finished)."""
        cfg = self.cfg
        stats = self.session.stats()
        finished = self.trackio.finished
        problems = _problems(stats, finished)
        if self.archive is not None:
            archived = stats.sinks.get(self.archive.name, SinkStats())
            if archived.written != stats.written:
                problems.append(
                    f"the archive holds {archived.written} of the {stats.written} samples written"
                )
        if self.policy.version < cfg.steps:
            problems.append(f"interrupted after {self.policy.version} of {cfg.steps} steps")
        return DemoResult(
            project=cfg.project,
            run=self.session.run,
            steps=cfg.steps,
            steps_done=self.policy.version,
            stats=stats,
            trackio_finished=finished,
            groups_generated=self.counters.groups_generated,
            groups_used=self.counters.groups_used,
            groups_stale=self.counters.groups_stale,
            groups_zero_signal=self.counters.groups_zero_signal,
            samples_per_step=cfg.prompts_per_step * cfg.group_size,
            elapsed=time.perf_counter() - self.started,
            trackio_dir=trackio_dir(),
            problems=tuple(problems),
            archive=None if self.archive is None else str(self.archive_dir),
            archive_skipped=self.archive_skipped,
            max_traces=cfg.max_traces,
            group_size=cfg.group_size,
            watched=prompt_id(WATCHED),
        )


def _problems(stats: SessionStats, trackio_finished: bool) -> list[str]:
    """Everything that makes the run a failure: a broken invariant or any sample lost."""
    out = []
    if not stats.check():
        out.append("the accounting invariant does not hold")
    if stats.failed:
        out.append(f"{stats.failed} samples failed to write")
    if stats.pending:
        out.append(f"{stats.pending} samples were still pending at the finish deadline")
    other = {k: v for k, v in stats.dropped.items() if k != "capped" and v}
    if other:
        out.append("samples were dropped: " + ", ".join(f"{k}={v}" for k, v in sorted(other.items())))
    if not trackio_finished:
        out.append("the Trackio run was not finished")
    return out


def _dropped_line(dropped: Mapping[str, int]) -> str:
    parts = [
        f"{reason} {n}" + (" (the per-step cap, by design)" if reason == "capped" else "")
        for reason, n in sorted(dropped.items())
        if n
    ]
    return ", ".join(parts) or "none"


def _skipped_line(skipped: Mapping[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()) if n) or "none"


def dashboard_command(project: str, directory: str | None = None) -> str:
    """The shell command that opens Trackio's dashboard on the demo's project."""
    command = f"trackio show --project {_shell_word(project)}"
    if os.environ.get("TRACKIO_DIR") and directory:
        command = f"TRACKIO_DIR={_shell_word(directory)} {command}"
    return command


def view_command(archive: str, watched: str) -> str:
    """The shell command that browses the demo's archive with `asynctrace view`."""
    return f"asynctrace view {_shell_word(archive)} --watch {_shell_word(watched)}"


def _view_missing() -> list[str]:
    """The packages of the `view` extra that are not installed."""
    return [name for name in ("duckdb", "starlette", "uvicorn") if importlib.util.find_spec(name) is None]


def _shell_word(text: str) -> str:
    """`text` quoted for a POSIX shell: in double quotes when that is safe, else as shlex does."""
    if re.fullmatch(r"[\w./:@+,=-]+", text):
        return f'"{text}"'
    return shlex.quote(text)


def format_summary(result: DemoResult, max_traces: int | None = None) -> str:
    """The end-of-run report: accounting per sink, the invariant check, and how to open both views."""
    s = result.stats
    total = s.written + s.failed + s.pending + s.dropped_total
    holds = "OK" if s.check() else "FAILED"
    cap = result.max_traces if max_traces is None else max_traces
    groups = cap // result.group_size if result.group_size else 0
    tier = s.sinks.get("trackio", SinkStats())
    lines = [
        "",
        f"asynctrace demo: {result.steps_done} of {result.steps} steps in {result.elapsed:.1f}s",
        f"  project     {result.project}",
        f"  run         {result.run}",
        f"  rollouts    {result.groups_generated} groups generated, {result.groups_used} trained on "
        f"({result.groups_zero_signal} with zero reward spread: no learning signal), "
        f"{result.groups_stale} dropped as too stale",
        f"  samples     {s.submitted} submitted ({result.samples_per_step} per step)",
    ]
    if result.archive is not None:
        archived = s.sinks.get("parquet", SinkStats())
        lines.append(
            f"  parquet     {archived.written} written (every sample), {archived.failed} failed, "
            f"to {result.archive}"
        )
    else:
        lines.append(f"  parquet     skipped: {result.archive_skipped}")
    lines += [
        f"  trackio     {tier.written} written: the top {groups} group(s) of {result.group_size} by reward "
        f"spread a step (GroupSampler, max_traces_per_step={cap}) plus the watched prompt "
        f"{result.watched}; left out by its selection: {_skipped_line(tier.skipped)}; "
        f"{tier.failed} failed",
        f"  written     {s.written}",
        f"  dropped     {_dropped_line(s.dropped)}",
        f"  failed      {s.failed}",
        f"  pending     {s.pending}",
        f"  retries     {s.retries}",
        f"  invariant   submitted {s.submitted} == written + failed + pending + dropped {total}: {holds}",
        f"  trackio run {'finished' if result.trackio_finished else 'NOT finished'}",
    ]
    if result.trackio_dir:
        lines.append(f"  stored in   {result.trackio_dir}")
    if result.problems:
        lines.append("")
        lines.extend(f"PROBLEM: {p}" for p in result.problems)
    lines += [
        "",
        "Open the dashboard (the groups with the most signal, and the watched prompt, at every step):",
        f"  {dashboard_command(result.project, result.trackio_dir)}",
    ]
    if result.archive is not None:
        lines += [
            "Browse every sample (steps, GRPO groups and the zero-signal ones, the watched prompt across "
            "steps, tool calls, each completion's tokens and log-probs):",
            f"  {view_command(result.archive, result.watched)}",
        ]
        missing = _view_missing()
        if missing:
            lines.append(f'  (needs {", ".join(missing)}: pip install "asynctrace[view]")')
    else:
        lines.append(
            "To keep every sample in a Parquet archive and browse it with asynctrace view: "
            'pip install "asynctrace[parquet,view]"'
        )
    return "\n".join(lines)


def main(cfg: DemoConfig) -> int:
    """Run the demo, print the summary; returns the process exit code."""
    import click

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "the demo trains a small tokenizer with the `tokenizers` package; install it with "
            "`pip install tokenizers` (or `pip install asynctrace[tokenizers]`)"
        ) from None
    if cfg.max_traces < cfg.group_size:
        raise click.UsageError(
            f"--max-traces {cfg.max_traces} keeps no group of --group-size {cfg.group_size}: "
            "the Trackio tier keeps whole groups, so give at least the group size"
        )
    cfg = dataclasses.replace(cfg, run=cfg.run or generated_run_name())
    folder = Path(cfg.archive, cfg.run or "").absolute()
    if any(folder.glob("*.parquet")):
        raise click.UsageError(f"{folder} already holds a run's archive: choose another --run or --archive")
    demo = DemoRun(cfg)
    if demo.archive_skipped:
        click.echo(f"Parquet archive skipped ({demo.archive_skipped}): logging to Trackio only.", err=True)
    where = f"every sample to {demo.archive_dir}, " if demo.archive is not None else ""
    click.echo(
        f"Simulating asynchronous GRPO: {cfg.workers} rollout workers, groups of {cfg.group_size}, "
        f"{cfg.prompts_per_step} prompts per step; logging {where}and to Trackio project "
        f'"{cfg.project}" the top {cfg.max_traces // cfg.group_size} group(s) by reward spread a step '
        f"plus the watched prompt {prompt_id(WATCHED)}."
    )
    try:
        result = anyio.run(demo.run)
    except KeyboardInterrupt:
        # The session finished (shielded) before the interrupt got here: report what it did.
        click.echo(format_summary(demo.result()))
        return 130
    click.echo(format_summary(result))
    return 0 if result.ok else 1
