"""SkyRL: `GeneratorInput` + `GeneratorOutput` to samples, step-wise rows merged per trajectory.

    samples = skyrl_adapter.to_samples(generator_input, generator_output, tokenizer=tokenizer)
    step, split = skyrl_adapter.step_and_split(generator_input, default_step=global_step)
    await session.log_samples(samples, step=step, split=split)

The fully asynchronous trainer assembles one training step from several generation groups;
`to_step_samples(groups, ...)` turns all of them into one list, so the session's cap applies to
the training step and not to each group.

Turns come from the loss mask, with two corrections for what SkyRL masks that no environment
wrote (see `_turn_mask`): a row masked out entirely (overlong filtering) is one assistant turn,
and chat-template framing masked 0 at the edges of a response belongs to the assistant turn
it frames.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._record import Sample
from ..rollouts._align import MISSING, Shortfall
from ..rollouts._mapping import prompt_indices, trajectory_label
from ..rollouts._stepwise import merge_step_wise, trajectory_groups
from ..rollouts._turns import mask_runs, split_turns
from ._common import Message, SampleBuilder, as_sequence, field, jsonable, role_name

__all__ = ["step_and_split", "to_samples", "to_step_samples"]

_WHERE = "skyrl_adapter.to_samples"


def step_and_split(generator_input: Any, *, default_step: int | None = None) -> tuple[int | None, str]:
    """`(global_step, split)` from `batch_metadata`; the split is "eval" for the eval phase."""
    metadata = field(generator_input, "batch_metadata")
    step = field(metadata, "global_step", default_step)
    phase = field(metadata, "training_phase", "train")
    return (default_step if step is None else int(step)), ("eval" if phase == "eval" else "train")


def to_samples(
    generator_input: Any,
    generator_output: Any,
    *,
    tokenizer: Any,
    env_role: str = "tool",
    step_wise: bool | None = None,
) -> list[Sample]:
    """One sample per trajectory: the chat prompt, then the response split into turns by its loss mask.

    Step-wise outputs (one row per turn, `is_last_step` set) are merged per trajectory with
    `merge_step_wise` first; `step_wise=None` decides from `is_last_step`. Rewards may be one
    per row or per token (summed). Optional per-row lists shorter than the batch are left out
    of the samples they do not reach, with one warning.
    """
    builder = SampleBuilder()
    short = Shortfall(_WHERE, 0)
    prompts = as_sequence(field(generator_input, "prompts"), "generator_input.prompts")
    _collect(
        prompts, generator_input, generator_output, builder, short, env_role=env_role, step_wise=step_wise
    )
    short.warn()
    return builder.build(tokenizer, _WHERE)


def to_step_samples(
    groups: Iterable[Any],
    *,
    tokenizer: Any,
    env_role: str = "tool",
    step_wise: bool | None = None,
) -> list[Sample]:
    """The samples of one training step assembled from generation groups, decoded in one call.

    Each group is a `(generator_input, generator_output)` pair or a SkyRL `GeneratedOutputGroup`:
    its `generator_output` with its `prompts` (one chat prompt per trajectory), or with a
    `generator_input` as look-alikes have it; without either, the prompt is the decoded
    `prompt_token_ids`. Its `uid` and `global_step_when_scheduled` become `group_uid` and
    `policy_version`; a non-step-wise output without trajectory ids gets `uid:k` for its k-th
    trajectory, as SkyRL numbers a group's repetitions. `sample_index` and `prompt_index` run
    across the whole step, so log the result once per training step and the cap holds per step.
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


def _chat(prompt: Any) -> list[Message]:
    """A SkyRL prompt (a conversation, or a plain string) as fresh message dicts."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages: list[Message] = []
    for message in prompt:
        out = {key: jsonable(value) for key, value in dict(message).items()}
        out["role"] = role_name(out.get("role", "user"))
        messages.append(out)
    return messages


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


def _turn_mask(mask: list[int], *, leading: bool, trailing: bool) -> list[int]:
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
    if leading:
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
) -> tuple[int, int]:
    """Queue the samples of one generation batch; returns its numbers of rows and prompts.

    Without `prompts`, each trajectory's prompt is its decoded `prompt_token_ids`. `uid` names
    the instance of a fully async group, whose rows are then trajectories `uid:k` unless named.
    """
    env_classes = field(generator_input, "env_classes")
    prompt_ids = as_sequence(field(generator_output, "prompt_token_ids"), "generator_output.prompt_token_ids")
    response_ids = as_sequence(field(generator_output, "response_ids"), "generator_output.response_ids")
    n = len(response_ids)
    if len(prompt_ids) != n:
        raise ValueError(
            f"generator_output.prompt_token_ids: has {len(prompt_ids)} rows but response_ids has {n}"
        )
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
    n_prompts = len(prompts) if prompts is not None else len(trajectory_groups(n, out_tids, is_last))
    in_tids = field(generator_input, "trajectory_ids")
    # Non-step-wise outputs carry no ids (SkyRL sets them to None); the input has one per row.
    # A fully async group keeps no input: prepare_generator_input named its k-th row (uid, k).
    row_tids = out_tids
    if row_tids is None and not step_wise:
        if in_tids is not None and len(in_tids) == n:
            row_tids = in_tids
        elif in_tids is None and uid is not None:
            row_tids = [{"instance_id": uid, "repetition_id": k} for k in range(n)]

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
    prompt_of_row = _prompt_of_rows(n, n_prompts, in_tids, out_tids, is_last, step_wise)

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
        mask = _turn_mask(mask, leading=True, trailing=not step_wise)
        messages: list[Message]
        if starts and prompts is not None:
            messages = _chat(prompts[p])
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
        if row_tids is not None:
            metadata["trajectory_id"] = trajectory_label(row_tids[first])
            instance = field(row_tids[first], "instance_id")
            if instance is not None:
                metadata["group_uid"] = jsonable(instance)
        picked_rewards = [row_rewards[r] for r in rows if row_rewards[r] is not MISSING]
        if picked_rewards:
            metadata["reward"] = float(sum(picked_rewards))
        for key, name, column, row, convert in (
            ("stop_reason", "stop_reasons", stop_reasons, last, str),
            ("env_class", "env_classes", env_classes, p, str),
            ("env_metrics", "env_metrics", env_metrics, last, jsonable),
        ):
            value = short.pick(column, row, name)
            if value is not MISSING and value is not None:
                metadata[key] = convert(value)
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
