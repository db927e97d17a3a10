"""SkyRL: `GeneratorInput` + `GeneratorOutput` to samples, step-wise rows merged per trajectory.

``attach(trainer)`` logs what each training step of a SkyRL trainer trains on; `to_samples` and
`to_step_samples` are the converters under it. Turns come from the loss mask, corrected for what
SkyRL masks that no environment wrote (see `_turn_mask`). The field mapping: docs/frameworks/skyrl.md.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._records.types import Sample
from ..rollouts._align import MISSING, Shortfall
from ..rollouts._mapping import instance_key, prompt_indices, trajectory_label
from ..rollouts._stepwise import merge_step_wise, trajectory_groups
from ..rollouts._turns import mask_runs, split_turns
from ._common import Message, SampleBuilder, as_sequence, chat_messages, field, jsonable
from ._hooks import count_rows, deliver, every_row
from ._requires import UNCHANGED, Framework, Need, gaps, report
from ._sessions import finish_after

if TYPE_CHECKING:
    from .._session import TraceSession
    from .._sync import SyncTraceSession

__all__ = ["attach", "step_and_split", "to_samples", "to_step_samples"]

_WHERE = "skyrl_adapter.to_samples"


def step_and_split(generator_input: Any, *, default_step: int | None = None) -> tuple[int | None, str]:
    """`(global_step, split)` from `batch_metadata`; the split is "eval" for the eval phase."""
    metadata = field(generator_input, "batch_metadata")
    step = field(metadata, "global_step", default_step)
    phase = field(metadata, "training_phase", "train")
    return (default_step if step is None else int(step)), ("eval" if phase == "eval" else "train")


class _Origin(NamedTuple):
    """What one prompt instance (a SkyRL uid) was generated from."""

    prompt: Any
    env_class: Any
    step: Any
    trajectory_ids: list[Any]
    """The uid's trajectory ids in input order: its k-th row is its k-th repetition."""


def _origins(generator_inputs: Iterable[Any]) -> dict[str, _Origin]:
    """Each uid's prompt, env class, generation step and trajectory ids, from the inputs'
    `trajectory_ids`.

    SkyRL's uid is the `instance_id` of a row's trajectory id; every repetition of a uid has the
    same prompt, so the first input naming it is enough.
    """
    out: dict[str, _Origin] = {}
    for generator_input in generator_inputs:
        tids = field(generator_input, "trajectory_ids")
        prompts = field(generator_input, "prompts")
        if tids is None or prompts is None:
            continue
        env_classes = field(generator_input, "env_classes")
        step = field(field(generator_input, "batch_metadata"), "global_step")
        here: set[str] = set()
        for i, tid in enumerate(tids):
            uid = field(tid, "instance_id")
            if uid is None or i >= len(prompts):
                continue
            key = str(uid)
            if key not in out:
                env = env_classes[i] if env_classes is not None and i < len(env_classes) else None
                out[key] = _Origin(prompts[i], env, step, [])
                here.add(key)
            if key in here:
                out[key].trajectory_ids.append(tid)
    return out


def _tids_by_uid(
    uids: Sequence[Any], in_place: Sequence[Any] | None, origins: Mapping[str, _Origin] | None
) -> list[Any]:
    """Each row's trajectory id: the input's where the row is still in place, else the k-th
    trajectory of its uid for the uid's k-th row.

    Dynamic sampling keeps a uid's rows in order ("filter" drops whole groups and concatenates
    batches; a fully async step concatenates whole groups), so a uid's k-th row is its k-th
    repetition. A uid with more rows than repetitions holds copies ("replace"): those rows get
    no id, as nothing tells which repetition a copy came from.
    """
    n = len(uids)
    placed = list(in_place) if in_place is not None else [None] * n
    rows_of: dict[str, int] = {}
    for u in uids:
        rows_of[str(u)] = rows_of.get(str(u), 0) + 1
    seen: dict[str, int] = {}
    out: list[Any] = []
    for i, u in enumerate(uids):
        key = str(u)
        k = seen.get(key, 0)
        seen[key] = k + 1
        tid = placed[i]
        origin = (origins or {}).get(key)
        if tid is None and origin is not None and rows_of[key] <= len(origin.trajectory_ids):
            tid = origin.trajectory_ids[k]
        out.append(tid)
    return out


def to_samples(
    generator_input: Any,
    generator_output: Any,
    *,
    tokenizer: Any,
    uids: Sequence[Any] | None = None,
    env_role: str = "tool",
    step_wise: bool | None = None,
) -> list[Sample]:
    """One sample per trajectory: the chat prompt, then the response split into turns by its loss mask.

    `uids` are the per-row uids the trainer carries with the output; pass them whenever the
    output went through dynamic sampling, after which row `i` no longer answers input row `i`.
    Each row then takes its uid's prompt from `generator_input` (one `GeneratorInput`, or every
    batch "filter" collected from); a uid in no input gets its decoded `prompt_token_ids`.

    Step-wise outputs (`is_last_step` set; `step_wise=None` decides from it) are merged per
    trajectory with `merge_step_wise` first, and a trajectory's reward is its last step's.
    Optional per-row lists shorter than the batch are left out where they do not reach, with
    one warning. The field mapping: docs/frameworks/skyrl.md.
    """
    inputs = _inputs(generator_input)
    options: dict[str, Any]
    if uids is not None:
        options = {"uids": as_sequence(uids, "uids"), "origins": _origins(inputs)}
    elif len(inputs) != 1:
        raise ValueError("generator_input: several inputs need the output's uids to map rows to prompts")
    else:
        options = {"prompts": as_sequence(field(inputs[0], "prompts"), "generator_input.prompts")}
    single = inputs[0] if len(inputs) == 1 else None
    return _samples(
        _WHERE, tokenizer, single, generator_output, env_role=env_role, step_wise=step_wise, **options
    )


def _samples(
    where: str, tokenizer: Any, generator_input: Any, generator_output: Any, **options: Any
) -> list[Sample]:
    """The samples of one generation batch: `_collect` with `options`, decoded in one call."""
    builder = SampleBuilder()
    short = Shortfall(where, 0)
    _collect(options.pop("prompts", None), generator_input, generator_output, builder, short, **options)
    short.warn(stacklevel=4)  # the warning points at the code that called the converter
    return builder.build(tokenizer, where)


def _inputs(generator_input: Any) -> list[Any]:
    """One `GeneratorInput` (a dict) or several, as a list."""
    if generator_input is None:
        return []
    if isinstance(generator_input, Mapping) or field(generator_input, "prompts") is not None:
        return [generator_input]
    return list(generator_input)


def to_step_samples(
    groups: Iterable[Any],
    *,
    tokenizer: Any,
    env_role: str = "tool",
    step_wise: bool | None = None,
) -> list[Sample]:
    """The samples of one training step assembled from generation groups, decoded in one call.

    Each group is a `(generator_input, generator_output)` pair or a SkyRL `GeneratedOutputGroup`:
    its `generator_output` with its `prompts` (one chat prompt per trajectory; skyrl-train
    before 0.4 kept none, and then the prompt is the decoded `prompt_token_ids`). Its `uid`
    and `global_step_when_scheduled` become `group_uid` and `policy_version`, and the group is
    one prompt; a non-step-wise output without trajectory ids gets `uid:k` for its k-th
    trajectory, as SkyRL numbers a group's repetitions. `sample_index` and `prompt_index` run
    across the whole step, so log the result once per training step and the cap holds per step.
    In a SkyRL trainer, `attach` does this at the step's `postprocess_generator_output`.
    """
    builder = SampleBuilder()
    short = Shortfall("skyrl_adapter.to_step_samples", 0)
    offsets = (0, 0)
    for number, group in enumerate(groups):
        uid: Any = None
        extra: dict[str, Any] = {}
        if isinstance(group, (tuple, list)):
            if len(group) != 2:
                raise ValueError(f"groups: group {number} is not a (generator_input, generator_output) pair")
            generator_input, generator_output = group
            prompts = field(generator_input, "prompts")
        else:
            generator_output = field(group, "generator_output")
            if generator_output is None:
                raise ValueError(f"groups: group {number} has no generator_output")
            # SkyRL's GeneratedOutputGroup keeps the input's prompts, not the input itself.
            generator_input = field(group, "generator_input")
            prompts = field(group, "prompts")
            if prompts is None:
                prompts = field(generator_input, "prompts")
            uid = field(group, "uid")
            extra = {
                key: jsonable(value)
                for key, value in (
                    ("group_uid", uid),
                    ("policy_version", field(group, "global_step_when_scheduled")),
                )
                if value is not None
            }
        rows, n_prompts = _collect(
            None if prompts is None else as_sequence(prompts, f"groups: group {number} prompts"),
            generator_input,
            generator_output,
            builder,
            short,
            env_role=env_role,
            step_wise=step_wise,
            offsets=offsets,
            extra={"group_index": number, **extra},
            uid=uid,
        )
        offsets = (offsets[0] + rows, offsets[1] + n_prompts)
    short.warn()
    return builder.build(tokenizer, "skyrl_adapter.to_step_samples")


def _row_reward(value: Any) -> Any:
    """A row's reward: a number, or the sum of per-token rewards."""
    if value is MISSING or value is None:
        return MISSING
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return float(sum(value))
    return float(value)


def _prompt_of_rows(
    n_rows: int,
    n_prompts: int,
    in_tids: Sequence[Any] | None,
    out_tids: Sequence[Any] | None,
    is_last: Sequence[Any] | None,
    step_wise: bool,
) -> list[int]:
    """The prompt of every output row: matched by trajectory id, else the blocked layout.

    The blocked layout counts trajectories, not rows: a step-wise trajectory spans many rows.
    """
    if out_tids is not None and in_tids is not None and len(in_tids) == n_prompts:
        return prompt_indices(
            n_prompts=n_prompts, n_samples=n_rows, trajectory_ids=out_tids, prompt_trajectory_ids=in_tids
        )
    if not step_wise:
        return prompt_indices(n_prompts=n_prompts, n_samples=n_rows)
    groups = trajectory_groups(n_rows, out_tids, is_last)
    blocked = prompt_indices(n_prompts=n_prompts, n_samples=len(groups))
    prompt_of_row = [0] * n_rows
    for ordinal, rows in enumerate(groups):
        for row in rows:
            prompt_of_row[row] = blocked[ordinal]
    return prompt_of_row


def _turn_mask(mask: list[int], *, trailing: bool) -> list[int]:
    """The mask that cuts a response into turns: the loss mask, with framing moved to assistant turns.

    SkyRL's generators open every response with the policy's turn, so a leading 0-run is that
    turn's header (`<|im_start|>assistant\\n`, which message-based generators and re-tokenized
    chat templates mask out). In a non-step-wise response, SkyRL ends the response at the last
    generated turn, so a trailing 0-run is framing too: the EOS appended after a stop string,
    or the newline after EOS. A step-wise trajectory may end with a real observation, so there
    only the leading run moves. 0-runs between generated runs stay environment turns.
    """
    generated = [i for i, m in enumerate(mask) if m]
    if not generated:
        return mask
    out = list(mask)
    out[: generated[0]] = [1] * generated[0]
    if trailing:
        out[generated[-1] + 1 :] = [1] * (len(out) - generated[-1] - 1)
    return out


def _collect(
    prompts: Sequence[Any] | None,
    generator_input: Any,
    generator_output: Any,
    builder: SampleBuilder,
    short: Shortfall,
    *,
    env_role: str,
    step_wise: bool | None,
    offsets: tuple[int, int] = (0, 0),
    extra: dict[str, Any] | None = None,
    uid: Any = None,
    uids: Sequence[Any] | None = None,
    origins: Mapping[str, _Origin] | None = None,
) -> tuple[int, int]:
    """Queue the samples of one generation batch; returns its numbers of rows and prompts.

    Without `prompts` a trajectory's prompt is its decoded `prompt_token_ids`; `uid` names a fully
    async group's instance (rows `uid:k` unless named); with `uids` a row's prompt is in `origins`.
    """
    env_classes = field(generator_input, "env_classes")
    prompt_ids = as_sequence(field(generator_output, "prompt_token_ids"), "generator_output.prompt_token_ids")
    response_ids = as_sequence(field(generator_output, "response_ids"), "generator_output.response_ids")
    n = len(response_ids)
    if len(prompt_ids) != n:
        raise ValueError(
            f"generator_output.prompt_token_ids: has {len(prompt_ids)} rows but response_ids has {n}"
        )
    if uids is not None and len(uids) != n:
        raise ValueError(f"uids: has {len(uids)} values but generator_output has {n} rows")
    short.n_samples = n
    loss_masks = field(generator_output, "loss_masks")
    rewards = field(generator_output, "rewards")
    stop_reasons = field(generator_output, "stop_reasons")
    env_metrics = field(generator_output, "env_metrics")
    out_tids = field(generator_output, "trajectory_ids")
    is_last = field(generator_output, "is_last_step")
    if step_wise is None:
        step_wise = is_last is not None
    if out_tids is not None and len(out_tids) != n:
        short.note("trajectory_ids", len(out_tids))
        out_tids = None
    if is_last is not None and len(is_last) < n:
        # A trajectory whose last step is unknown stays open: its rows still merge.
        short.note("is_last_step", len(is_last))
        is_last = [*is_last, *([False] * (n - len(is_last)))]
    in_tids = field(generator_input, "trajectory_ids")
    # Non-step-wise outputs carry no ids (SkyRL sets them to None); the input has one per row.
    # A fully async group keeps no input: prepare_generator_input named its k-th row (uid, k).
    row_tids: Sequence[Any] | None = out_tids
    if row_tids is None and not step_wise:
        if uids is not None:
            # After dynamic sampling an input row's id still names an output row where both
            # carry the same uid: "replace" leaves every row it does not overwrite in place.
            in_place = None
            if in_tids is not None and len(in_tids) == n:
                in_place = [
                    tid if str(field(tid, "instance_id")) == str(u) else None
                    for tid, u in zip(in_tids, uids, strict=True)
                ]
            row_tids = _tids_by_uid(uids, in_place, origins)
        elif in_tids is not None and len(in_tids) == n:
            row_tids = in_tids
        elif in_tids is None and uid is not None:
            row_tids = [{"instance_id": uid, "repetition_id": k} for k in range(n)]

    row_prompt: list[Any]
    row_env: list[Any]
    row_step: list[Any] = [None] * n
    if uids is not None:
        seen: dict[str, int] = {}
        prompt_of_row = [seen.setdefault(str(u), len(seen)) for u in uids]
        n_prompts = len(seen)
        found = [(origins or {}).get(str(u)) for u in uids]
        row_prompt = [None if o is None else o.prompt for o in found]
        row_env = [None if o is None else o.env_class for o in found]
        row_step = [None if o is None else o.step for o in found]
    else:
        n_prompts = len(prompts) if prompts is not None else len(trajectory_groups(n, out_tids, is_last))
        input_row = _prompt_of_rows(n, n_prompts, in_tids, out_tids, is_last, step_wise)
        row_prompt = [None if prompts is None else prompts[p] for p in input_row]
        row_env = [short.pick(env_classes, p, "env_classes") for p in input_row]
        prompt_of_row = input_row
        if uid is not None:
            # A fully async group is one prompt, whatever number of copies of it it keeps.
            prompt_of_row, n_prompts = [0] * n, 1
        elif in_tids is not None and len(in_tids) == n_prompts:
            # SkyRL's input repeats the prompt once per sample (prepare_generator_input): the
            # prompt a sample answers is its instance, numbered in order of first appearance.
            order: dict[Hashable, int] = {}
            instance_of = [order.setdefault(instance_key(tid), len(order)) for tid in in_tids]
            prompt_of_row, n_prompts = [instance_of[p] for p in input_row], len(order)

    responses = [list(r) for r in response_ids]
    masks: list[list[int]] = []
    masked_out: list[bool] = []
    for i, response in enumerate(responses):
        mask = short.pick(loss_masks, i, "loss_masks")
        mask = [1] * len(response) if mask is MISSING else [int(bool(m)) for m in mask]
        if len(mask) != len(response):
            raise ValueError(
                f"generator_output.loss_masks: row {i} has {len(mask)} values for {len(response)} tokens"
            )
        # Overlong filtering zeroes the whole mask of a truncated row: the policy still wrote it,
        # but the mask no longer tells its turns apart, so the row is one assistant turn.
        masked_out.append(bool(mask) and not any(mask))
        masks.append([1] * len(mask) if masked_out[-1] else mask)
    row_rewards = [_row_reward(short.pick(rewards, i, "rewards")) for i in range(n)]

    if step_wise:
        merged = merge_step_wise(
            [list(p) for p in prompt_ids],
            responses,
            loss_masks=masks,
            trajectory_ids=out_tids,
            is_last_step=is_last,
        )
        pieces = list(
            zip(
                merged.rows,
                merged.prompt_token_ids,
                merged.response_ids,
                merged.loss_masks,
                merged.starts_trajectory,
                strict=True,
            )
        )
    else:
        pieces = [([i], list(prompt_ids[i]), responses[i], masks[i], True) for i in range(n)]

    for rows, prompt_tokens, response, mask, starts in pieces:
        first, last = rows[0], rows[-1]
        p = prompt_of_row[first]
        chat_prompt = row_prompt[first]
        mask = _turn_mask(mask, trailing=not step_wise)
        messages: list[Message]
        if starts and chat_prompt is not None:
            messages = list(chat_messages(chat_prompt, "user", f"prompt of row {first}"))
            turns = split_turns(response, mask_runs(mask), 0, env_role, builder.texts)
        else:
            # Without a chat prompt (none kept, or a prefix mismatch restarted the sequence),
            # the prompt is the decoded observation.
            messages = []
            turns = split_turns(
                prompt_tokens + response,
                mask_runs([0] * len(prompt_tokens) + mask),
                len(prompt_tokens),
                env_role,
                builder.texts,
            )
        messages += turns.turns
        metadata: dict[str, Any] = {"sample_index": offsets[0] + first, "prompt_index": offsets[1] + p}
        tid = None if row_tids is None else row_tids[first]
        if tid is not None:
            metadata["trajectory_id"] = trajectory_label(tid)
        group = uids[first] if uids is not None else field(tid, "instance_id")
        if group is not None:
            metadata["group_uid"] = jsonable(group)
        # SkyRL trains a step-wise trajectory on its last step's reward (the advantage of the
        # row with is_last_step, broadcast to the other steps); the other steps' are not used.
        # A sample cut off before the last step by a prefix mismatch carries no reward.
        if not step_wise or is_last is None or bool(is_last[last]):
            reward = row_rewards[last]
            if reward is not MISSING:
                metadata["reward"] = reward
        for key, name, column, row, convert in (
            ("stop_reason", "stop_reasons", stop_reasons, last, str),
            ("env_metrics", "env_metrics", env_metrics, last, jsonable),
        ):
            value = short.pick(column, row, name)
            if value is not MISSING and value is not None:
                metadata[key] = convert(value)
        env = row_env[first]
        if env is not MISSING and env is not None:
            metadata["env_class"] = str(env)
        if row_step[first] is not None:
            metadata["generated_at_step"] = jsonable(row_step[first])
        metadata["prompt_len"] = len(prompt_tokens)
        metadata["response_len"] = len(response)
        metadata["num_turns"] = turns.num_turns
        if any(masked_out[r] for r in rows):
            metadata["loss_masked"] = True
        if step_wise:
            metadata["num_steps"] = len(rows)
        if extra:
            metadata.update(extra)
        builder.add(messages, metadata)
    return n, n_prompts


_HOOK = "skyrl_adapter.attach"
_MAX_ORIGINS = 1 << 16


class _Tracer:
    """The state `attach` adds to a trainer: the prompt of every uid generated, by uid."""

    def __init__(self, session: TraceSession | SyncTraceSession, tokenizer: Any, env_role: str) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.env_role = env_role
        self._lock = threading.Lock()
        # A uid is a dataset row, so its prompt never changes: what an older step kept stays
        # right, and the bound only drops the oldest uids of a run whose data never repeats.
        self._origins: OrderedDict[str, _Origin] = OrderedDict()
        self._last_input: Any = None

    def remember(self, generator_input: Any) -> bool:
        """Keep a training batch's prompts; True for an evaluation batch."""
        try:
            if step_and_split(generator_input)[1] == "eval":
                return True
            found = _origins([generator_input])
        except Exception:  # an input this version cannot read: its rows fall back to prompt tokens
            return False
        with self._lock:
            # The sync trainer trains on the last input it generated (rows in place unless
            # dynamic sampling moved them); a row takes an id from it only where the uids agree.
            self._last_input = generator_input
            for uid, origin in found.items():
                self._origins[uid] = origin
                self._origins.move_to_end(uid)
            while len(self._origins) > _MAX_ORIGINS:
                self._origins.popitem(last=False)
        return False

    def log_eval(self, generator_input: Any, generator_output: Any, default_step: int) -> None:
        """Deliver one evaluation batch, rows in input order as SkyRL's generators return them;
        never raises."""
        rows = _row_count(generator_output, lambda: field(generator_input, "prompts"))
        try:
            step = step_and_split(generator_input, default_step=default_step)[0]
        except Exception:  # metadata this version lays out differently: the trainer's step
            step = default_step
        convert = every_row(
            to_samples, generator_input, generator_output, tokenizer=self.tokenizer, env_role=self.env_role
        )
        # Step-wise rows merge into fewer samples: the count of samples is not that of rows.
        deliver(
            self.session, convert, rows=rows, step=step or 0, split="eval", where=_HOOK, one_per_row=False
        )

    def log(self, generator_output: Any, uids: Any, step: int) -> None:
        """Deliver one training step's rows and their uids; never raises."""
        rows = _row_count(generator_output, lambda: uids)

        def convert() -> list[Sample]:
            with self._lock:
                origins = {str(u): self._origins[str(u)] for u in set(uids) if str(u) in self._origins}
                last_input = self._last_input
            return _samples(
                _HOOK,
                self.tokenizer,
                last_input,
                generator_output,
                env_role=self.env_role,
                step_wise=None,
                uids=as_sequence(uids, "uids"),
                origins=origins,
            )

        deliver(
            self.session,
            every_row(convert),
            rows=rows,
            step=step,
            split="train",
            where=_HOOK,
            one_per_row=False,
        )


def _row_count(generator_output: Any, *more: Callable[[], Any]) -> int | None:
    """The rows of a generator output, from any per-row column it has."""
    return count_rows(
        *more,
        lambda: field(generator_output, "response_ids"),
        lambda: field(generator_output, "prompt_token_ids"),
        lambda: field(generator_output, "loss_masks"),
        lambda: field(generator_output, "rewards"),
    )


def _step(trainer: Any) -> int:
    try:
        return int(trainer.global_step)
    except Exception:  # a trainer without a step counter: logged at step 0
        return 0


_FRAMEWORK = Framework("SkyRL", "0.4.0", "skyrl")
# What `attach` wraps and reads on a trainer (`RayPPOTrainer`, `FullyAsyncRayPPOTrainer`).
_TRAINER_NEEDS = (
    Need("generator.generate", args=1, coroutine=True),
    Need("postprocess_generator_output", args=2),
    Need("tokenizer"),
)
# And, when it opens the session itself, what names it and what ends it.
_OWN_SESSION_NEEDS = (Need("cfg.trainer.project_name"), Need("cfg.trainer.run_name"), Need("train"))


def _is_experiment(target: Any) -> bool:
    """An experiment (`BasePPOExp` and its subclasses) builds the trainer; a trainer has the hook point."""
    return hasattr(target, "get_trainer") and not hasattr(target, "postprocess_generator_output")


def attach(
    target: Any,
    session: TraceSession | SyncTraceSession | None = None,
    *,
    env_role: str = "tool",
    **session_options: Any,
) -> Any:
    """Log every training step of a SkyRL trainer (`RayPPOTrainer` or `FullyAsyncRayPPOTrainer`).

    `target` is the trainer, or the experiment that builds it (`BasePPOExp` or a subclass, as
    the `skyrl_entrypoint` Ray task holds it): its `get_trainer` then attaches the trainer it
    returns, as below.

    Wraps `trainer.generator.generate`, to keep the chat prompt of every uid it generates, and
    `trainer.postprocess_generator_output`, which both trainers call once per training step on
    what they train (after dynamic sampling and the filters): its rows are logged at
    `trainer.global_step`, split "train"; evaluation batches at their
    `batch_metadata.global_step`, split "eval". Nothing raises into training: unconvertible
    batches are counted as dropped ("invalid") with one warning. A trainer without what the
    hook wraps (another SkyRL version) gets one warning naming what is missing and is left as it
    is.

    Without `session`, one is opened here, named after the trainer's config, with
    `on_full="drop_oldest"` and shutdown hooks (`session_options` go to `TraceSession`), and
    finished when `trainer.train()` returns or raises; a session passed in is the caller's to
    finish. Returns `target`, to fit `return attach(super().get_trainer(...))`.
    """
    if session is not None and session_options:
        raise ValueError(f"session_options: {sorted(session_options)} only apply when no session is given")
    if _is_experiment(target):
        get_trainer = target.get_trainer

        @functools.wraps(get_trainer)
        def traced_get_trainer(*args: Any, **kwargs: Any) -> Any:
            return attach(get_trainer(*args, **kwargs), session, env_role=env_role, **session_options)

        target.get_trainer = traced_get_trainer
        return target
    trainer = target
    needs = _TRAINER_NEEDS if session is not None else (*_TRAINER_NEEDS, *_OWN_SESSION_NEEDS)
    problems = gaps(trainer, needs, type(trainer).__name__)
    if problems:
        report(_FRAMEWORK, _HOOK, problems, UNCHANGED)
        return trainer
    owned: SyncTraceSession | None = None
    if session is None:
        from .._session import TraceSession

        cfg = trainer.cfg.trainer
        options = {"on_full": "drop_oldest", "shutdown_hooks": True, **session_options}
        owned = session = TraceSession(cfg.project_name, cfg.run_name, **options).start()
    tracer = _Tracer(session, trainer.tokenizer, env_role)
    generator = trainer.generator
    generate = generator.generate
    postprocess = trainer.postprocess_generator_output

    # The fully async trainer inspects `generate`'s signature (for `disable_tqdm`).
    @functools.wraps(generate)
    async def traced_generate(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        evaluation = tracer.remember(input_batch)
        output = await generate(input_batch, *args, **kwargs)
        if evaluation:
            tracer.log_eval(input_batch, output, _step(trainer))
        return output

    @functools.wraps(postprocess)
    def traced_postprocess(generator_output: Any, uids: Any, *args: Any, **kwargs: Any) -> Any:
        result = postprocess(generator_output, uids, *args, **kwargs)
        step = _step(trainer)
        # skyrl 0.4 returns (output, uids), uids shortened where step-wise rows merge;
        # skyrl-train 0.3 returns the output alone, its rows still those of `uids`.
        if isinstance(result, tuple) and len(result) == 2:
            tracer.log(result[0], result[1], step)
        else:
            tracer.log(result, uids, step)
        return result

    generator.generate = traced_generate
    trainer.postprocess_generator_output = traced_postprocess
    if owned is not None:
        # skyrl 0.4's train() is a coroutine function, skyrl-train 0.3's a plain one.
        finish_after(trainer, "train", owned, _HOOK)
    return trainer
