# ruff: noqa
"""SkyRL's own code for what its trainers do to a batch before their logging point, unchanged.

Source: skyrl==0.4.0, the PyPI wheel skyrl-0.4.0-py3-none-any.whl
(sha256 7f95dad660ddc388ca135a1faf61bcbd8010a39e3d4fef92c62959c0353c6ee9), Apache-2.0,
Copyright the SkyRL authors (NovaSky-AI/SkyRL). That release holds the trainers SkyRL ships
today (`skyrl/train/trainer.py`, `skyrl/train/fully_async_trainer.py`); the older
`skyrl-train` package (last release 0.3.1) is its predecessor.

Why a copy and not the package: every skyrl and skyrl-train release requires Python >= 3.12
(`Requires-Python`), and this project's test run installs into Python 3.11, where pip refuses
them even with --no-deps. Installing skyrl on 3.12 and importing the same names from
`skyrl.train.*` runs the same code.

Each definition below is copied byte for byte (by name, with `ast`) from the file and lines
named in the comment above it; the trainer methods keep their bodies and are re-indented into
classes of the same names. The only changes: the imports at the top stand in for the modules
these files import (loguru's logger by `logging`'s, which these calls use the same way; the
vision / routing / sample-support types by `Any`), and `concatenate_generator_outputs` loses
its function-local `from skyrl.train.utils.trainer_utils import validate_generator_output`,
which is defined in this module. The trainer classes hold only the methods copied here: a
test gives them the attributes those methods read (`cfg`, `tokenizer`, `all_metrics`, ...).
"""

import copy
import logging
import types
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Tuple, TypedDict, Union

import numpy as np
import torch

logger = logging.getLogger("skyrl")

# skyrl.backends.skyrl_train.inference_servers.base.ConversationType and the per-token side
# channels: only carried through here, never inspected.
ConversationType = List[Dict[str, Any]]
RoutedExpertIndices = Any
SampleSupport = Any
SAMPLE_SUPPORT_FIELD = "rollout_sample_support"
# skyrl.backends.skyrl_train.training_batch.TrainingInputBatch: a return annotation here.
TrainingInputBatch = Any


def aggregate_for_environment(env_name: str, metrics: Any) -> Dict[str, Any]:
    """skyrl_gym.metrics.aggregate_for_environment; not reached: no caller here passes env_metrics."""
    raise NotImplementedError


def Timer(name: str, timings: Optional[Dict[str, float]] = None) -> Any:
    """skyrl's Timer context manager; timings are not what these tests look at."""
    return nullcontext()


# skyrl/train/generators/base.py:11-11
TrainingPhase = Literal["train", "eval"]


# skyrl/train/generators/base.py:12-12
TRAINING_PHASE_TRAIN: TrainingPhase = "train"


# skyrl/train/generators/base.py:13-13
TRAINING_PHASE_EVAL: TrainingPhase = "eval"


# skyrl/train/generators/base.py:16-22
@dataclass
class TrajectoryID:
    instance_id: str  # Unique identifier for the instance in the dataset
    repetition_id: int  # Which sample/repetition for this UID (0, 1, 2... for GRPO)

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


# skyrl/train/generators/base.py:25-28
@dataclass
class BatchMetadata:
    global_step: int
    training_phase: TrainingPhase


# skyrl/train/generators/base.py:31-37
class GeneratorInput(TypedDict):
    prompts: List[ConversationType]
    env_classes: List[str]
    env_extras: Optional[List[Dict[str, Any]]]
    sampling_params: Optional[Dict[str, Any]]
    trajectory_ids: Optional[List[TrajectoryID]]
    batch_metadata: Optional[BatchMetadata]


# skyrl/train/generators/base.py:40-69
class GeneratorOutput(TypedDict):
    prompt_token_ids: List[List[int]]
    response_ids: List[List[int]]
    rewards: Union[List[float], List[List[float]]]
    loss_masks: List[List[int]]
    stop_reasons: Optional[List[str]]
    rollout_metrics: Optional[Dict[str, Any]]
    rollout_logprobs: Optional[List[List[float]]]
    trajectory_ids: Optional[List[TrajectoryID]]
    # Wall-clock generation time (seconds) for each trajectory, with one entry per
    # trajectory in the input batch (i.e. per ``agent_loop`` call). Used by the fully
    # async trainer to compute per-group / intra-group completion-time metrics.
    trajectory_generation_times: Optional[List[float]]
    # Engine and env time splits of ``trajectory_generation_times``, one list entry per trajectory,
    # e.g. {"llm": [...], "env": [...]}. trajectory_time_splits is None if any trajectory did not
    # record its split.
    trajectory_time_splits: Optional[Dict[str, List[float]]]
    # Per trajectory, routes for a prefix of its prompt and response tokens.
    rollout_expert_indices: Optional[List[RoutedExpertIndices]]
    # Per trajectory, sampler support for each response token; uncaptured rows are padding.
    rollout_sample_support: Optional[List[SampleSupport]]
    # Applicable only for step-wise training
    is_last_step: Optional[List[bool]]
    # Per-row env metrics (one dict per row in the flattened batch). Used by
    # ``dump_per_dataset_eval_results`` to surface env-specific info (e.g. RLM's
    # ``rlm_metadata``) in eval JSONL dumps.
    env_metrics: Optional[List[Dict[str, Any]]]
    # Applicable only for vision-language models
    pixel_values: Optional[List[torch.Tensor]]
    image_grid_thw: Optional[List[torch.Tensor]]


# skyrl/train/generators/base.py:72-75
class MetricsOutput(TypedDict):
    avg_score: Optional[float]
    pass_at_n: Optional[float]
    mean_positive_reward: Optional[float]


# skyrl/train/generators/utils.py:219-268
@torch.no_grad()
def get_metrics_from_generator_output(generator_output: GeneratorOutput, uids: List[str]) -> MetricsOutput:
    """
    Get `mean_raw_reward` (or avg_score), `pass_at_n`, and `mean_positive_reward` from generator output.

    The `n` in `pass_at_n` is the number of trajectories we generate for each example. It is
    calculated as `len(generator_output["rewards"]) / len(uids)`, where `len(uids)` is the number of
    unique examples.

    Rewards can be either per-trajectory or per-token, and metrics are computed correspondingly.
    """
    rewards: Union[List[float], List[List[float]]] = generator_output["rewards"]
    if not len(rewards):
        raise ValueError(f"`rewards` must be a non-empty list, got {rewards}")

    # TODO: We should make metrics customizable by the environment.
    # Map from the example's uid to each trajectory's reward on that same example
    uid_to_trajectory_rewards = defaultdict(list)
    if isinstance(rewards[0], list):
        # Token-level rewards: rewards is List[List[float]]
        # For each trajectory, we sum over the token rewards for `mean_raw_reward` computation
        mean_raw_reward = float(np.mean([sum(trajectory_rewards) for trajectory_rewards in rewards]))

        # For each trajectory, we sum over the positive token rewards for mean_positive_reward computation
        mean_positive_reward = float(
            np.mean([sum(max(r, 0) for r in trajectory_rewards) for trajectory_rewards in rewards])
        )

        # Assume the last token's reward signifies the trajectory's reward for `pass_at_n` computation
        for i, cur_trajectory_rewards in enumerate(rewards):
            if len(cur_trajectory_rewards) == 0:
                raise ValueError("Token-level rewards must be a non-empty list.")
            uid_to_trajectory_rewards[uids[i]].append(cur_trajectory_rewards[-1])
    else:
        mean_raw_reward = float(np.mean(rewards))
        mean_positive_reward = float(np.mean(np.maximum(rewards, 0.0)))
        for i, reward in enumerate(rewards):
            uid_to_trajectory_rewards[uids[i]].append(reward)

    # For each trajectory, if the reward is positive, then it's a "pass". So for a single example, if
    # any of its trajectories' reward is positive, pass@n for that uid is 1.
    pass_at_n = sum(1 for v in uid_to_trajectory_rewards.values() if any(r > 0 for r in v)) / len(
        uid_to_trajectory_rewards
    )

    return MetricsOutput(
        avg_score=mean_raw_reward,
        pass_at_n=pass_at_n,
        mean_positive_reward=mean_positive_reward,
    )


# skyrl/train/generators/utils.py:271-276
def _flatten_field(generator_outputs: List[GeneratorOutput], key: str) -> list:
    """Concatenate a per-sample list-valued field across generator outputs in O(N_total)."""
    flat = []
    for go in generator_outputs:
        flat.extend(go[key])
    return flat


# skyrl/train/generators/utils.py:279-289
def _concat_optional_field(
    generator_outputs: List[GeneratorOutput], key: str
) -> Optional[Union[list, Dict[str, list]]]:
    """Concatenate an optional per-trajectory field across outputs. None if any output lacks it.
    Handles a flat list or a dict-of-lists, concatenating each component."""
    values = [go.get(key) for go in generator_outputs]
    if any(v is None for v in values):
        return None
    if isinstance(values[0], dict):
        return {name: [t for v in values for t in v[name]] for name in values[0]}
    return _flatten_field(generator_outputs, key)


# skyrl/train/generators/utils.py:292-301
def _last_step_only(
    values: Optional[Union[list, Dict[str, list]]], is_last_step: Optional[List[bool]]
) -> Optional[Union[list, Dict[str, list]]]:
    """Keep only last-step entries when step-wise, so one trajectory contributes one value.
    Handles a flat list or a dict-of-lists. No-op when not step-wise."""
    if values is None or not is_last_step:
        return values
    if isinstance(values, dict):
        return {name: _last_step_only(v, is_last_step) for name, v in values.items()}
    return [v for v, last in zip(values, is_last_step) if last]


# skyrl/train/generators/utils.py:304-390
def concatenate_generator_outputs(
    generator_outputs: List[GeneratorOutput], step_wise: bool = False, routes_expected: bool = False
) -> GeneratorOutput:
    """
    Concatenate the generator outputs of multiple batches. Then validate the concatenated result.

    We only aggregate rollout metrics the can deduced by responses and rewards, but not
    those that use `env_metrics` or `env_classes`.

    Args:
        generator_outputs: Per-batch generator outputs to concatenate.
        step_wise: If True, validate step-wise specific fields on the concatenated result
            (e.g. `is_last_step`, `trajectory_ids`, contiguous trajectory ordering).
        routes_expected: If True, a result with trainable tokens must carry routed experts (R3).
    """
    assert len(generator_outputs) > 0
    # Per-token side channels must be populated consistently across batches.
    for all_or_nothing_field in ("rollout_logprobs", "rollout_expert_indices", "rollout_sample_support"):
        present = [output.get(all_or_nothing_field) is not None for output in generator_outputs]
        if any(present) and not all(present):
            raise ValueError(
                f"generator outputs are expected to all have null {all_or_nothing_field} or all non-null, "
                "but received a mix"
            )
    first = generator_outputs[0]
    result: GeneratorOutput = {
        "prompt_token_ids": _flatten_field(generator_outputs, "prompt_token_ids"),
        "response_ids": _flatten_field(generator_outputs, "response_ids"),
        "rewards": _flatten_field(generator_outputs, "rewards"),
        "loss_masks": _flatten_field(generator_outputs, "loss_masks"),
        "stop_reasons": _concat_optional_field(generator_outputs, "stop_reasons"),
        "rollout_logprobs": _concat_optional_field(generator_outputs, "rollout_logprobs"),
        "rollout_expert_indices": _concat_optional_field(generator_outputs, "rollout_expert_indices"),
        "rollout_sample_support": _concat_optional_field(generator_outputs, "rollout_sample_support"),
        "trajectory_generation_times": _concat_optional_field(generator_outputs, "trajectory_generation_times"),
        "trajectory_time_splits": _concat_optional_field(generator_outputs, "trajectory_time_splits"),
    }

    # propagate additional keys with list values as-is
    additional_keys = [key for key in first if key not in result and isinstance(first[key], list)]
    if len(additional_keys):
        logger.info(f"Attempting to concatenate values for additional keys {additional_keys}")
    for key in additional_keys:
        result[key] = _flatten_field(generator_outputs, key)

    # With step-wise training each trajectory spans multiple rows; keep only its last-step timing.
    is_last_step = result.get("is_last_step") if step_wise else None
    trajectory_generation_times = _last_step_only(result.get("trajectory_generation_times"), is_last_step)
    trajectory_time_splits = _last_step_only(result.get("trajectory_time_splits"), is_last_step)

    # Re-aggregate rollout metrics; the extra_keys fallback below cannot aggregate a p90 or a ratio.
    rollout_metrics = get_rollout_metrics(
        result["response_ids"],
        result["rewards"],
        loss_masks=result.get("loss_masks"),
        trajectory_completion_times=trajectory_generation_times,
        trajectory_time_splits=trajectory_time_splits,
    )

    # Preserve generator-specific metrics from per-group rollout_metrics. get_rollout_metrics only
    # computes basic stats (response length, reward); generators may add custom keys, which we
    # aggregate by inferring from the key name. TODO(Charlie): hacky, to be removed soon.
    extra_keys: dict = {}
    for go in generator_outputs:
        per_group = go.get("rollout_metrics") or {}
        for k, v in per_group.items():
            if k not in rollout_metrics and isinstance(v, (int, float)):
                extra_keys.setdefault(k, []).append(v)
    for k, values in extra_keys.items():
        if "avg" in k or "mean" in k:
            rollout_metrics[k] = sum(values) / len(values)
        elif "min" in k:
            rollout_metrics[k] = min(values)
        elif "max" in k:
            rollout_metrics[k] = max(values)
        else:
            rollout_metrics[k] = sum(values)
    result["rollout_metrics"] = rollout_metrics

    # Validate the generator output using the number of prompts
    # Import here to avoid circular dependency.

    num_prompts = len(result["prompt_token_ids"])
    validate_generator_output(num_prompts, result, step_wise=step_wise, routes_expected=routes_expected)

    return result


# skyrl/train/generators/utils.py:393-415
def apply_overlong_filtering(
    loss_masks: List[List[int]],
    stop_reasons: List[str],
) -> List[List[int]]:
    """
    Implements DAPO Overlong Filtering: zero-out every token's mask whenever
    the response was truncated (i.e. did not end with a stop token).

    Uses stop_reasons from the inference engine rather than checking for a
    specific eos token id, making this model/tokenizer agnostic.

    Args:
        loss_masks: Per-trajectory token loss masks.
        stop_reasons: Per-trajectory stop reasons from the inference engine
            (e.g. "stop" for normal completion, "length" for truncation).

    Returns:
        The loss masks with tokens zeroed out for truncated responses.
    """
    assert len(loss_masks) == len(stop_reasons), "loss_masks and stop_reasons must have the same length"
    return [
        [0] * len(mask) if stop_reason != "stop" else mask[:] for mask, stop_reason in zip(loss_masks, stop_reasons)
    ]


# skyrl/train/generators/utils.py:418-438
def compute_turn_token_counts(loss_masks: List[List[int]]) -> List[int]:
    """Compute per-turn assistant token counts across a batch of trajectories.

    Each turn's generated tokens are the maximal runs of consecutive non-zero entries in the
    loss mask; observation/non-assistant tokens are masked to 0 and thus separate turns. Returns
    a flat list with one entry per turn (across all trajectories). Trajectories whose loss mask is
    entirely zero (e.g. dropped by overlong filtering) contribute no turns.
    """
    turn_token_counts: List[int] = []
    for mask in loss_masks:
        if not mask:
            continue
        nz = (np.asarray(mask) != 0).astype(np.int8)
        if nz.sum() == 0:
            continue
        # Pad with zeros on both ends so run starts/ends are detected via the first difference.
        diffs = np.diff(np.concatenate(([0], nz, [0])))
        starts = np.where(diffs == 1)[0]
        ends = np.where(diffs == -1)[0]
        turn_token_counts.extend((ends - starts).tolist())
    return turn_token_counts


# skyrl/train/generators/utils.py:441-452
def _add_time_stats(rollout_metrics: Dict[str, Any], name: str, times: Optional[List[float]]) -> None:
    """Add mean/p90/max stats for a per-trajectory time list under generate/trajectory_time_<name>_*."""
    if not times:
        return
    arr = np.array(times, dtype=np.float64)
    rollout_metrics.update(
        {
            f"generate/trajectory_time_{name}_mean": np.mean(arr).item(),
            f"generate/trajectory_time_{name}_p90": np.percentile(arr, 90).item(),
            f"generate/trajectory_time_{name}_max": np.max(arr).item(),
        }
    )


# skyrl/train/generators/utils.py:455-552
def get_rollout_metrics(
    responses: List[List[int]],
    rewards: Union[List[float], List[List[float]]],
    env_metrics: Optional[List[Dict[str, Any]]] = None,
    env_classes: Optional[List[str]] = None,
    loss_masks: Optional[List[List[int]]] = None,
    trajectory_completion_times: Optional[List[float]] = None,
    trajectory_time_splits: Optional[Dict[str, List[float]]] = None,
):
    """
    Computes rollout metrics including token statistics and optional environment-specific metrics.

    Args:
        responses: List of token ID sequences for each response
        rewards: List of rewards (either per-trajectory or per-token)
        env_metrics: Optional list of environment-specific metrics for each trajectory
        env_classes: Optional list of environment class names for each trajectory
        loss_masks: Optional list of per-token loss masks; used to compute assistant-only token counts
        trajectory_completion_times: Optional per-trajectory end-to-end generation times (seconds);
            used to compute aggregate trajectory completion-time stats (mean / p90 / max)
        trajectory_time_splits: Optional per-component split of the completion times, e.g.
            {"llm": [...], "env": [...]}, one entry per trajectory

    Returns:
        Dictionary of aggregated metrics
    """
    num_tokens_arr = np.array([len(response) for response in responses])
    # Support both response-level and token-level rewards
    flat_rewards = []
    for r in rewards:
        if isinstance(r, list):
            flat_rewards.append(float(np.sum(r)))
        else:
            flat_rewards.append(float(r))
    flat_rewards_arr = np.array(flat_rewards)
    non_zero_rewards_arr = flat_rewards_arr > 0.0
    zero_rewards_arr = flat_rewards_arr == 0.0
    # average tokens for non zero rewards
    avg_tokens_non_zero_rewards = (
        np.mean(num_tokens_arr[non_zero_rewards_arr]) if non_zero_rewards_arr.sum() > 0 else np.zeros(1)
    )
    # average tokens for zero rewards
    avg_tokens_zero_rewards = np.mean(num_tokens_arr[zero_rewards_arr]) if zero_rewards_arr.sum() > 0 else np.zeros(1)

    rollout_metrics = {
        "generate/min_num_tokens": np.min(num_tokens_arr).item(),
        "generate/max_num_tokens": np.max(num_tokens_arr).item(),
        "generate/avg_num_tokens": np.mean(num_tokens_arr).item(),
        "generate/std_num_tokens": np.std(num_tokens_arr).item(),
        "generate/avg_tokens_non_zero_rewards": avg_tokens_non_zero_rewards.item(),
        "generate/avg_tokens_zero_rewards": avg_tokens_zero_rewards.item(),
    }

    if loss_masks is not None:
        assistant_tokens_arr = np.array([sum(mask) for mask in loss_masks])
        rollout_metrics.update(
            {
                "generate/avg_assistant_tokens": np.mean(assistant_tokens_arr).item(),
                "generate/min_assistant_tokens": np.min(assistant_tokens_arr).item(),
                "generate/max_assistant_tokens": np.max(assistant_tokens_arr).item(),
                "generate/std_assistant_tokens": np.std(assistant_tokens_arr).item(),
            }
        )

        # Per-turn token stats: run lengths of consecutive non-zero loss-mask entries (one run per turn).
        turn_token_counts = compute_turn_token_counts(loss_masks)
        if turn_token_counts:
            turn_token_counts_arr = np.array(turn_token_counts)
            rollout_metrics.update(
                {
                    "generate/tokens_per_turn_mean": np.mean(turn_token_counts_arr).item(),
                    "generate/tokens_per_turn_std": np.std(turn_token_counts_arr).item(),
                    "generate/tokens_per_turn_max": np.max(turn_token_counts_arr).item(),
                }
            )

    _add_time_stats(rollout_metrics, "completion", trajectory_completion_times)
    for name, times in (trajectory_time_splits or {}).items():
        _add_time_stats(rollout_metrics, name, times)

    if trajectory_completion_times and trajectory_time_splits:
        # Completion time not attributed to a named split, e.g. tokenization and chat templating.
        other = np.array(trajectory_completion_times, dtype=np.float64)
        for times in trajectory_time_splits.values():
            other = other - np.array(times, dtype=np.float64)
        _add_time_stats(rollout_metrics, "other", other.tolist())

    if env_metrics is not None and env_classes is not None:
        env_to_metrics = defaultdict(list)
        for i, metrics in enumerate(env_metrics):
            env_to_metrics[env_classes[i]].append(metrics)
        for env_name, metrics in env_to_metrics.items():
            # Aggregate metrics across all trajectories for the same environment
            agg = aggregate_for_environment(env_name, metrics)
            for key, value in agg.items():
                rollout_metrics[f"environment/{key}"] = value

    return rollout_metrics


# skyrl/train/generators/utils.py:555-608
def prepare_generator_input(
    prompts: List[Any],
    n_samples_per_prompt: int,
    sampling_params: Dict[str, Any],
    default_env_class: str,
    training_phase: TrainingPhase,
    global_step: int,
) -> Tuple[GeneratorInput, List[str]]:
    """Prepares the generator input for training and eval

    Args:
        prompts (List[Any]): list of prompts
        n_samples_per_prompt (int): how many samples to create per prompt
        sampling_params (Dict[str, Any]): sampling parameters
        default_env_class (str): env class to use if env class missing from prompts
        training_phase (TrainingPhase): training or eval
        global_step (int): current global step

    Returns:
        Tuple[GeneratorInput, List[str]]: generator input and list of uuids
    """

    all_prompts = [prompt["prompt"] for prompt in prompts for _ in range(n_samples_per_prompt)]

    all_envs = [
        prompt["env_class"] if prompt["env_class"] is not None else default_env_class
        for prompt in prompts
        for _ in range(n_samples_per_prompt)
    ]

    # all the other columns are env_extras
    env_extras = [copy.deepcopy(prompt["env_extras"]) for prompt in prompts for _ in range(n_samples_per_prompt)]

    # Create TrajectoryID objects - one UID per row, repetition_id for multiple samples
    trajectory_ids = []
    uids = []
    for _, prompt in enumerate(prompts):
        uid: str = prompt["uid"]

        # Create TrajectoryID for each repetition
        for repetition_id in range(n_samples_per_prompt):
            trajectory_ids.append(TrajectoryID(instance_id=uid, repetition_id=repetition_id))
            uids.append(uid)

    generator_input: GeneratorInput = {
        "prompts": all_prompts,
        "env_classes": all_envs,
        "env_extras": env_extras,
        "sampling_params": sampling_params,
        "trajectory_ids": trajectory_ids,
        "batch_metadata": BatchMetadata(global_step=global_step, training_phase=training_phase),
    }

    return generator_input, uids


# skyrl/train/generators/utils.py:820-824
def _is_prefix(maybe_prefix: List[int], candidate: List[int]) -> bool:
    """Check if maybe_prefix is a prefix of candidate (or equal)."""
    if len(maybe_prefix) > len(candidate):
        return False
    return maybe_prefix == candidate[: len(maybe_prefix)]


# skyrl/train/generators/utils.py:827-844
def slice_generator_output(
    generator_output: GeneratorOutput, indices: List[int], *, preserve_metrics: bool = True
) -> GeneratorOutput:
    """Slice list and dict-of-list fields at the given indices."""
    assert len(indices) > 0, "indices must be non-empty"
    # Every key except `rollout_metrics` is None, a dict of per-entry lists, or a per-entry list.
    sliced: GeneratorOutput = {}
    for key, value in generator_output.items():
        if key == "rollout_metrics":
            if preserve_metrics:
                sliced[key] = value
        elif value is None:
            sliced[key] = None
        elif isinstance(value, dict):
            sliced[key] = {name: [component[i] for i in indices] for name, component in value.items()}
        else:
            sliced[key] = [value[i] for i in indices]
    return sliced


# skyrl/train/generators/utils.py:847-849
def _concat_sample_support(blocks: List[SampleSupport]) -> SampleSupport:
    """Join one trajectory's per-turn support blocks, without copying an unmerged turn."""
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=0)


# skyrl/train/generators/utils.py:852-975
def _merge_single_trajectory(gen_out: GeneratorOutput) -> GeneratorOutput:
    """Greedily merge turns of a single trajectory using prefix matching.

    Takes a GeneratorOutput whose entries all belong to the same trajectory_id
    and returns a merged GeneratorOutput (potentially fewer entries).
    """
    # Make sure all entries in the trajectory have the same trajectory_id
    trajectory_ids = gen_out.get("trajectory_ids")
    assert trajectory_ids is not None, "trajectory_ids is required for prefix-aware merging"
    for i in range(0, len(trajectory_ids)):
        assert (
            trajectory_ids[i] == trajectory_ids[0]
        ), "all entries in a single trajectory must have the same trajectory_id"

    n = len(gen_out["response_ids"])
    assert n > 0, "Expect non-empty GeneratorOutput."
    is_token_level_rewards = isinstance(gen_out["rewards"][0], list)
    has_logprobs = gen_out.get("rollout_logprobs") is not None
    has_stop_reasons = gen_out.get("stop_reasons") is not None
    has_sample_support = gen_out.get("rollout_sample_support") is not None
    # Support rows are dense, so an observation delta contributes full-width padding rows.
    sample_support_width = gen_out["rollout_sample_support"][0].shape[1] if has_sample_support else 0

    # Per-field output accumulators.
    # Fields that we take from all the entries in the merge group
    out_prompt_ids: List[List[int]] = []
    out_response_ids: List[List[int]] = []
    out_loss_masks: List[List[int]] = []
    out_logprobs: Optional[List[List[float]]] = [] if has_logprobs else None
    # Keep one block per turn until the merged trajectory is flushed.
    out_sample_support: Optional[List[SampleSupport]] = [] if has_sample_support else None
    # If per-token rewards, we keep appending. If per-turn rewards, we only take from the last turn.
    out_rewards: list = []

    # Fields that we only take from the last turn in the merge group
    out_stop_reasons: Optional[List[str]] = [] if has_stop_reasons else None
    out_trajectory_ids: list = []
    out_is_last_step: List[bool] = []

    # Accumulator for the current merge group
    acc_prompt: List[int] = list(gen_out["prompt_token_ids"][0])
    acc_response: List[int] = list(gen_out["response_ids"][0])
    acc_loss_mask: List[int] = list(gen_out["loss_masks"][0])
    acc_logprobs: Optional[List[float]] = list(gen_out["rollout_logprobs"][0]) if has_logprobs else None
    acc_sample_support: Optional[List[SampleSupport]] = (
        [gen_out["rollout_sample_support"][0]] if has_sample_support else None
    )
    acc_rewards_tokens: Optional[List[float]] = list(gen_out["rewards"][0]) if is_token_level_rewards else None
    last = 0

    def flush():
        nonlocal acc_prompt, acc_response, acc_loss_mask, acc_logprobs, acc_sample_support, acc_rewards_tokens, last
        out_prompt_ids.append(acc_prompt)
        out_response_ids.append(acc_response)
        out_loss_masks.append(acc_loss_mask)
        if has_logprobs:
            out_logprobs.append(acc_logprobs)
        if has_sample_support:
            out_sample_support.append(_concat_sample_support(acc_sample_support))
        out_rewards.append(acc_rewards_tokens if is_token_level_rewards else gen_out["rewards"][last])
        if has_stop_reasons:
            out_stop_reasons.append(gen_out["stop_reasons"][last])
        out_trajectory_ids.append(gen_out["trajectory_ids"][last])
        out_is_last_step.append(gen_out["is_last_step"][last])

    for i in range(1, n):
        full_merged = acc_prompt + acc_response

        # If prompt[i-1] + response[i-1] is not a prefix of prompt[i], flush the current merge group
        # and start a new group to merge.
        if not _is_prefix(full_merged, gen_out["prompt_token_ids"][i]):
            flush()
            acc_prompt = list(gen_out["prompt_token_ids"][i])
            acc_response = list(gen_out["response_ids"][i])
            acc_loss_mask = list(gen_out["loss_masks"][i])
            acc_logprobs = list(gen_out["rollout_logprobs"][i]) if has_logprobs else None
            acc_sample_support = [gen_out["rollout_sample_support"][i]] if has_sample_support else None
            acc_rewards_tokens = list(gen_out["rewards"][i]) if is_token_level_rewards else None
            last = i
            continue

        # prompt[i-1] + response[i-1] is a prefix of prompt[i], so we can merge the two turns.
        # obs_delta is the newly prefilled tokens not generated by the assistant, so we need to
        # properly loss mask them.
        obs_delta = gen_out["prompt_token_ids"][i][len(full_merged) :]

        # Merge obs_delta to the fields, assigning zeros since it is not generated by the assistant.
        acc_response.extend(obs_delta)
        acc_loss_mask.extend([0] * len(obs_delta))
        if acc_logprobs is not None:
            acc_logprobs.extend([0.0] * len(obs_delta))
        if acc_sample_support is not None:
            acc_sample_support.append(
                np.full((len(obs_delta), sample_support_width), SAMPLE_SUPPORT_PADDING, dtype=SAMPLE_SUPPORT_DTYPE)
            )
        if acc_rewards_tokens is not None:
            acc_rewards_tokens.extend([0.0] * len(obs_delta))

        # Extend the current merge group with the next turn's fields, exactly the same preserved.
        acc_response.extend(gen_out["response_ids"][i])
        acc_loss_mask.extend(gen_out["loss_masks"][i])
        if acc_logprobs is not None:
            acc_logprobs.extend(gen_out["rollout_logprobs"][i])
        if acc_sample_support is not None:
            acc_sample_support.append(gen_out["rollout_sample_support"][i])
        if acc_rewards_tokens is not None:
            acc_rewards_tokens.extend(gen_out["rewards"][i])

        last = i

    flush()

    return {
        "prompt_token_ids": out_prompt_ids,
        "response_ids": out_response_ids,
        "rewards": out_rewards,
        "loss_masks": out_loss_masks,
        "stop_reasons": out_stop_reasons,
        "rollout_logprobs": out_logprobs,
        "rollout_sample_support": out_sample_support,
        "trajectory_ids": out_trajectory_ids,
        "rollout_expert_indices": None,
        "is_last_step": out_is_last_step,
    }


# skyrl/train/generators/utils.py:978-1025
def merge_stepwise_output(generator_output: GeneratorOutput) -> GeneratorOutput:
    """Merge step-wise GeneratorOutput entries using prefix-aware merging.

    For consecutive turns within the same trajectory where
    prompt[i] + response[i] is a prefix of prompt[i+1],
    merges them into a single entry with:
    - prompt from the first turn in the merge group
    - response tokens concatenated with observation deltas (obs_delta) in between
    - Per-token fields (loss_masks, rewards, logprobs) concatenated, with default
      values (0) for obs_delta positions
    - Per-turn fields (stop_reason, is_last_step, trajectory_id) taken from the
      last turn in the merge group

    When the prefix condition fails between two consecutive turns, the current
    merge group is flushed and a new group starts (greedy merging).

    The returned GeneratorOutput's rollout_metrics should be ignored. We already recorded it before
    calling this function.

    Args:
        generator_output: Step-wise GeneratorOutput with trajectory_ids and is_last_step.

    Returns:
        Merged GeneratorOutput with one entry per merged group.
    """
    num_samples = len(generator_output["response_ids"])
    assert (
        generator_output.get("rollout_expert_indices") is None
    ), "rollout_expert_indices not supported for prefix-aware merging"
    assert (
        generator_output.get("pixel_values") is None and generator_output.get("image_grid_thw") is None
    ), "pixel_values and image_grid_thw not supported for step-wise training merging"

    # Split into per-trajectory GeneratorOutputs using is_last_step boundaries
    # (contiguity is guaranteed by validate_generator_output with step_wise=True)
    is_last_step = generator_output["is_last_step"]
    trajectory_slices: List[GeneratorOutput] = []
    start = 0
    for i in range(num_samples):
        if is_last_step[i]:
            trajectory_slices.append(
                slice_generator_output(generator_output, list(range(start, i + 1)), preserve_metrics=False)
            )
            start = i + 1

    merged_slices = [_merge_single_trajectory(s) for s in trajectory_slices]

    return concatenate_generator_outputs(merged_slices, step_wise=True)


# skyrl/train/utils/trainer_utils.py:268-293
def get_intra_group_completion_time_std_cv(
    generator_output: GeneratorOutput,
) -> Tuple[Optional[float], Optional[float]]:
    """Intra-group spread of per-trajectory completion times for a single group.

    Returns ``(std, cv)`` where ``std`` is the population standard deviation (seconds) and ``cv``
    is the coefficient of variation (``std / mean``). Both are ``None`` when the group recorded no
    completion times or has fewer than two trajectories.
    """
    traj_times = generator_output.get("trajectory_generation_times")
    group_std = None
    group_cv = None
    if traj_times and len(traj_times) > 1:
        # For step wise training, each turn /step contributes one entry.
        # Only take the metrics from the last step
        is_last_step = generator_output.get("is_last_step")
        if is_last_step:
            traj_times = [t for t, last in zip(traj_times, is_last_step) if last]
        traj_times_arr = np.array(traj_times, dtype=np.float64)
        # Population std of per-trajectory completion times within this group (seconds).
        group_std = float(traj_times_arr.std())
        # Coefficient of variation = std / mean. Guard against div-by-zero.
        mean_traj_time = float(traj_times_arr.mean())
        if mean_traj_time > 0:
            group_cv = group_std / mean_traj_time
    return group_std, group_cv


# skyrl/train/utils/trainer_utils.py:296-322
def get_group_completion_metrics(
    group_completion_times: Optional[List[float]],
    intra_group_stds: Optional[List[float]],
    intra_group_cvs: Optional[List[float]],
) -> Dict[str, float]:
    """Per-group completion-time statistics for the groups consumed in a step.

    These surface generation load-balancing behavior (e.g. across vllm-router routing policies):
    tail group latency (p90/max) and how unevenly trajectories within a group finish (intra-group
    coefficient of variation). Each input may be empty/None, in which case the corresponding metrics
    are omitted.
    """
    metrics = {}
    if group_completion_times:
        group_times_arr = np.array(group_completion_times, dtype=np.float64)
        metrics.update(
            {
                "generate/group_completion_time_mean": float(group_times_arr.mean()),
                "generate/group_completion_time_p90": float(np.percentile(group_times_arr, 90)),
                "generate/group_completion_time_max": float(group_times_arr.max()),
            }
        )
    if intra_group_stds:
        metrics.update({"generate/intra_group_completion_time_std_mean": float(np.mean(intra_group_stds))})
    if intra_group_cvs:
        metrics.update({"generate/intra_group_completion_time_cv_mean": float(np.mean(intra_group_cvs))})
    return metrics


# skyrl/train/utils/trainer_utils.py:377-390
class DynamicSamplingState(TypedDict, total=False):
    """Schema for dynamic sampling state dictionary.

    Fields:
        sample_batch_count: Counter for the number of sample batches processed
        collected_generator_output: Accumulated generator output (filter strategy only)
        collected_uids: Accumulated UIDs (filter strategy only)
        num_prompts_in_batch: Number of prompts collected so far (filter strategy only)
    """

    sample_batch_count: int
    collected_generator_output: Optional[GeneratorOutput]
    collected_uids: Optional[List[str]]
    num_prompts_in_batch: Optional[int]


# skyrl/train/utils/trainer_utils.py:393-430
def handle_dynamic_sampling(
    generator_output: GeneratorOutput,
    uids: List[str],
    sampling_config: Dict[str, Any],
    collected_state: Optional[DynamicSamplingState] = None,
) -> Tuple[GeneratorOutput, List[str], bool, Optional[DynamicSamplingState]]:
    """
    Handle dynamic sampling with different strategies (filter, replace).

    filter (used in DAPO) - filter out groups with std == 0 and group size > 1 and resample until we have enough prompts
    replace (used in POLARIS, WebSailor) - replace bad (std == 0) samples with good (std > 0) samples

    Args:
        generator_output: Current batch generator output
        uids: Current batch UIDs
        sampling_config: Configuration dict with sampling parameters
        collected_state: State for accumulating data across batches (for filter strategy)

    Returns:
        Tuple of (processed_generator_output, processed_uids, keep_sampling, updated_state)
    """
    sampling_type = sampling_config.get("type", None)

    if sampling_type is None:
        return generator_output, uids, False, None

    if sampling_type == "replace":
        # For "replace" strategy, the collected state is not used.
        processed_output, processed_uids, keep_sampling = handle_replace_sampling(
            generator_output, uids, sampling_config
        )
        return processed_output, processed_uids, keep_sampling, collected_state
    elif sampling_type == "filter":
        # For filter strategies, accumulate the generator output and UIDs
        # across batches in collected_state if we are sampling repeatedly.
        return handle_filter_sampling(generator_output, uids, sampling_config, collected_state)
    else:
        raise ValueError(f"Invalid dynamic sampling type: {sampling_type}")


# skyrl/train/utils/trainer_utils.py:433-515
def handle_replace_sampling(
    generator_output: GeneratorOutput, uids: List[str], sampling_config: Dict[str, Any]
) -> Tuple[GeneratorOutput, List[str], bool]:
    """
    Handle replace sampling strategy based on POLARIS implementation

    Reference: https://github.com/ChenxinAn-fdu/POLARIS/blob/8c82adb16b8e45c1a34f6d0e23e35deb66dd1ae7/verl/verl/trainer/ppo/ray_trainer.py#L995-L1022.

    Args:
        generator_output: Current batch generator output
        uids: Current batch UIDs
        sampling_config: Configuration dict with sampling parameters
    Returns:
        Tuple of (processed_generator_output, processed_uids, keep_sampling)
    """
    n_samples_per_prompt = sampling_config["n_samples_per_prompt"]
    min_replace_ratio = sampling_config["min_replace_ratio"]

    # Extract rewards and convert to sequence-level if needed
    rewards_list = generator_output["rewards"]
    if rewards_list and isinstance(rewards_list[0], list):
        # Token-level rewards: sum to get sequence rewards
        rewards = np.array([sum(r) for r in rewards_list])
    else:
        rewards = np.array(rewards_list)

    # get mapping of uids to list of indices and metrics
    uid2indices = defaultdict(list)
    uid2metric_vals = defaultdict(list)
    for idx, uid in enumerate(uids):
        uid2indices[uid].append(idx)
        uid2metric_vals[uid].append(rewards[idx])

    # Group by UID and calculate metrics
    uid2metric_std = {}
    for uid, metric_vals in uid2metric_vals.items():
        uid2metric_std[uid] = np.std(metric_vals)

    # Determine good UIDs: those with std > 0 (or group size == 1)
    good_uids = set([uid for uid, std in uid2metric_std.items() if std > 0 or n_samples_per_prompt == 1])
    bad_uids = set([uid for uid, std in uid2metric_std.items() if std == 0 and n_samples_per_prompt > 1])

    logger.info(f"Replace sampling: {len(good_uids)} good UIDs out of {len(uid2metric_vals)} total prompts")

    # Check if we have enough good UIDs (more than min_replace_ratio of the batch)
    if len(good_uids) > len(uid2metric_vals) * min_replace_ratio:
        logger.info("============= Dynamic sampling replace ===========")
        logger.info(f"Number of good prompts: {len(good_uids)}")
        logger.info(f"Number of bad prompts: {len(bad_uids)}")

        # Get good uids to replace the bad uids (length of bad uids)
        replacement_uids = get_bad_sample_replacements(good_uids, bad_uids)  # uids to replace the bad uids
        # get replacement indices
        replacement_indices = []
        for uid in replacement_uids:
            replacement_indices.extend(uid2indices[uid])
        # get bad indices
        bad_indices = []
        for uid in bad_uids:
            bad_indices.extend(uid2indices[uid])

        source_indices = list(range(len(uids)))
        for bad_idx, replacement_idx in zip(bad_indices, replacement_indices):
            source_indices[bad_idx] = replacement_idx
        if bad_indices:
            generator_output = slice_generator_output(generator_output, source_indices)

        # Update UIDs accordingly
        replaced_uids = uids.copy()
        for bad_idx, replacement_idx in zip(bad_indices, replacement_indices):
            replaced_uids[bad_idx] = uids[replacement_idx]

        logger.info(f"After replacement - Replaced {len(bad_indices) // n_samples_per_prompt} bad prompts")
        logger.info("==================================================")

        return generator_output, replaced_uids, False
    else:
        logger.warning("===================== Warning (Dynamic sampling replace) ====================")
        logger.warning("In this mini-batch, most training samples receive low variance rewards.")
        logger.warning("If you continue to see this warning, please check your data difficulty distribution.")
        logger.warning("==================================================")

        return generator_output, uids, True


# skyrl/train/utils/trainer_utils.py:518-608
def handle_filter_sampling(
    generator_output: GeneratorOutput,
    uids: List[str],
    sampling_config: Dict[str, Any],
    collected_state: DynamicSamplingState,
) -> Tuple[GeneratorOutput, List[str], bool, DynamicSamplingState]:
    """
    Handle filter-based sampling strategy (like DAPO).

    Args:
        generator_output: Current batch generator output
        uids: Current batch UIDs
        sampling_config: Configuration dict with sampling parameters
        collected_state: State for accumulating data across batches

    Returns:
        Tuple of (processed_generator_output, processed_uids, keep_sampling, updated_state)
    """
    target_batch_size = sampling_config["train_batch_size"]
    n_samples_per_prompt = sampling_config["n_samples_per_prompt"]

    # Extract rewards from collected output
    rewards_list = generator_output["rewards"]
    if rewards_list and isinstance(rewards_list[0], list):
        # Token-level rewards: sum to get sequence rewards
        rewards = np.array([sum(r) for r in rewards_list])
    else:
        rewards = np.array(rewards_list)

    # Group by UID and calculate standard deviation
    uid2metric_vals = defaultdict(list)
    for uid, reward in zip(uids, rewards):
        uid2metric_vals[uid].append(reward)

    uid2metric_std = {}
    for uid, metric_vals in uid2metric_vals.items():
        uid2metric_std[uid] = np.std(metric_vals)

    # Filter out groups with std == 0 and group size > 1
    kept_uids = [uid for uid, std in uid2metric_std.items() if std > 0 or n_samples_per_prompt == 1]
    kept_uids_set = set(kept_uids)

    # Filter trajectories based on kept UIDs
    kept_traj_idxs = []
    for idx, traj_uid in enumerate(uids):
        if traj_uid in kept_uids_set:
            kept_traj_idxs.append(idx)

    # Apply filtering to generator output
    filtered_output = filter_generator_output(generator_output, kept_traj_idxs)
    filtered_uids = [uids[idx] for idx in kept_traj_idxs]

    if "collected_generator_output" not in collected_state:
        collected_state.update(
            {
                "collected_generator_output": filtered_output,
                "collected_uids": filtered_uids.copy(),
                "num_prompts_in_batch": len(kept_uids),
            }
        )
    else:
        collected_state["collected_generator_output"] = concatenate_generator_outputs(
            [collected_state["collected_generator_output"], filtered_output]
        )
        collected_state["collected_uids"].extend(filtered_uids)
        collected_state["num_prompts_in_batch"] += len(kept_uids)

    # Check if we have enough prompts
    if collected_state["num_prompts_in_batch"] < target_batch_size:
        logger.info("============= Dynamic sampling filter =============")
        logger.info(f"Dynamic sampling: {collected_state['num_prompts_in_batch']} < {target_batch_size} prompts")
        logger.info(f"Resample batch {collected_state['sample_batch_count']}, continue sampling...")
        logger.info("==================================================")
        return generator_output, uids, True, collected_state
    else:
        logger.info("============= Dynamic sampling filter =============")
        logger.info(
            f"Dynamic sampling: collected {collected_state['num_prompts_in_batch']} >= {target_batch_size} prompts"
        )
        logger.info("==================================================")
        # Truncate to exact batch size if needed
        n_samples_per_prompt = sampling_config.get("n_samples_per_prompt", 1)
        max_trajectories = target_batch_size * n_samples_per_prompt
        final_output = collected_state["collected_generator_output"]
        final_uids = collected_state["collected_uids"]

        if len(final_uids) > max_trajectories:
            final_output = filter_generator_output(final_output, list(range(max_trajectories)))
            final_uids = final_uids[:max_trajectories]

        return final_output, final_uids, False, None


# skyrl/train/utils/trainer_utils.py:611-622
def get_bad_sample_replacements(good_uids: List[str], bad_uids: List[str]) -> List[str]:
    num_replacements = len(bad_uids)
    num_candidates = len(good_uids)

    if num_candidates >= num_replacements:
        perm = np.random.permutation(num_candidates)
        chosen_replacement_uids = np.array(list(good_uids))[perm[:num_replacements]]
    else:
        indices = np.random.randint(low=0, high=num_candidates, size=(num_replacements,))
        chosen_replacement_uids = np.array(list(good_uids))[indices]

    return chosen_replacement_uids


# skyrl/train/utils/trainer_utils.py:625-627
def filter_generator_output(output: GeneratorOutput, kept_indices: List[int]) -> GeneratorOutput:
    """Filter GeneratorOutput based on kept indices."""
    return slice_generator_output(output, kept_indices)


# skyrl/train/utils/trainer_utils.py:630-670
def zero_variance_filter(
    rewards: List[float],
    uids: List[str],
    loss_masks: Optional[List[List[int]]] = None,
    tol: float = 0.0,
) -> List[int]:
    """
    Given trajectory-level rewards and uids, return the indices of the trajectories to keep.

    A group (trajectories sharing a uid) is dropped only when it has >1 *live* trajectory and their
    reward spread is within ``tol`` (no GRPO signal); groups with <=1 live trajectory are always kept.
    A trajectory is "live" if ``sum(loss_mask) > 0`` (or all live when ``loss_masks`` is None) -- so
    trajectories masked upstream don't make a genuine zero-variance group look varied.

    Args:
        rewards: List[float]
        uids: List[str]
        loss_masks: Optional per-trajectory loss masks, used to determine which trajectories are live.
        tol: Two rewards within this absolute tolerance count as equal. 0.0 reproduces exact
            (``np.std > 0``) behavior; set a small value (e.g. 1e-6) for float (LLM-judge) rewards.

    Returns:
        List[int]
    """
    is_live = [True] * len(rewards) if loss_masks is None else [sum(mask) > 0 for mask in loss_masks]

    # Group live rewards by UID.
    uid2live_rewards = defaultdict(list)
    for uid, reward, live in zip(uids, rewards, is_live):
        if live:
            uid2live_rewards[uid].append(reward)

    def _is_zero_variance(uid: str) -> bool:
        vals = uid2live_rewards.get(uid, [])
        return len(vals) > 1 and (max(vals) - min(vals)) <= tol

    # Keep everything except groups with >1 live trajectory and no reward spread.
    kept_uids_set = {uid for uid in set(uids) if not _is_zero_variance(uid)}

    # Return indices of trajectories with kept UIDs
    return [i for i, uid in enumerate(uids) if uid in kept_uids_set]


# skyrl/train/utils/trainer_utils.py:673-767
def validate_generator_output(
    num_prompts: int, generator_output: GeneratorOutput, step_wise: bool = False, routes_expected: bool = False
):
    """Validate the generator output.

    Args:
        num_prompts: Number of input prompts used to produce this output.
        generator_output: The generated output batch to validate.
        step_wise: If True, validate step-wise specific fields (is_last_step, trajectory_ids,
            contiguous ordering). In step-wise mode, num_responses may exceed num_prompts
            because each trajectory is expanded into multiple per-turn samples.
        routes_expected: R3 is on for this batch, so a batch that trains anything must carry
            routed experts. Without them the trainer would silently skip replay.
    """
    if len(generator_output["response_ids"]) <= 0:
        raise RuntimeError("No outputs generated")

    num_responses = len(generator_output["response_ids"])
    num_prompt_tokens = len(generator_output["prompt_token_ids"])

    if not step_wise:
        assert num_prompts == num_responses, f"Mismatch between prompts ({num_prompts}) and responses ({num_responses})"

    assert (
        num_responses == num_prompt_tokens
    ), f"Mismatch between responses ({num_responses}) and prompt_token_ids ({num_prompt_tokens})"

    # make sure all batch elements have the same length as response_ids (which should be non-zero)
    for key in generator_output:
        if isinstance(generator_output[key], list) and key in [
            "response_ids",
            "loss_masks",
            "rewards",
            "rollout_logprobs",
            "stop_reasons",
            "trajectory_ids",
            "rollout_expert_indices",
            "rollout_sample_support",
            "is_last_step",
            "pixel_values",
            "image_grid_thw",
        ]:
            assert len(generator_output[key]) == len(generator_output["response_ids"]), (
                f"Generator output {key} length must be equal to response_ids length, "
                f"got {len(generator_output[key])} and {len(generator_output['response_ids'])}"
            )

    # make sure that each element of response ids and loss masks are all the same length
    # (and token level rewards if used)
    for i, (response_ids, loss_masks, rewards) in enumerate(
        zip(generator_output["response_ids"], generator_output["loss_masks"], generator_output["rewards"])
    ):
        assert len(response_ids) == len(loss_masks), (
            f"Response ids and loss masks must have the same length, "
            f"for sample {i} got {len(response_ids)} and {len(loss_masks)}"
        )
        if isinstance(rewards, list):
            assert len(rewards) == len(response_ids), (
                f"Token rewards and response ids must have the same length, "
                f"for sample {i} got {len(rewards)} and {len(response_ids)}"
            )

        if generator_output["rollout_logprobs"]:
            assert len(response_ids) == len(generator_output["rollout_logprobs"][i]), (
                f"Response ids and rollout logprobs must have the same length, "
                f"for sample {i} got {len(response_ids)} and {len(generator_output['rollout_logprobs'][i])}"
            )

    # loss masks should be non-zero for at least one element for trainer
    if np.concatenate(generator_output["loss_masks"]).sum() == 0:
        logger.warning("All outputs are loss masked, which may lead to NaN loss, please check your generation logic!!")

    # check that the rewards are either List[float-like] or List[List[float-like]]
    rewards = generator_output["rewards"]
    if isinstance(rewards[0], list):
        assert all(
            isinstance(reward, list) for reward in rewards
        ), "rewards must be `List[float]` or `List[List[float]]`"
    else:
        assert all(
            not isinstance(reward, list) for reward in rewards
        ), "rewards must be `List[float]` or `List[List[float]]`"

    _validate_per_token_side_channels(generator_output, step_wise)

    if routes_expected and generator_output.get("rollout_expert_indices") is None:
        # A batch with nothing to train (every rollout failed) has nothing to replay either.
        assert not any(any(mask) for mask in generator_output["loss_masks"]), (
            "generator.inference_engine.enable_return_routed_experts=True, but the generator returned no "
            "rollout_expert_indices for a batch with trainable tokens, so routing replay would silently be "
            "skipped. Use a generator that returns routed experts, or disable R3."
        )

    if step_wise:
        _validate_step_wise_fields(generator_output, num_responses)


# skyrl/train/utils/trainer_utils.py:770-813
def _validate_per_token_side_channels(generator_output: GeneratorOutput, step_wise: bool):
    """Validate side-channel row counts against their token domains."""
    rollout_expert_indices = generator_output.get("rollout_expert_indices")
    rollout_sample_support = generator_output.get(SAMPLE_SUPPORT_FIELD)
    prompt_token_ids = generator_output["prompt_token_ids"]
    response_ids = generator_output["response_ids"]

    if rollout_expert_indices is not None:
        loss_masks = generator_output["loss_masks"]
        for i, sample_indices in enumerate(rollout_expert_indices):
            assert sample_indices is not None, f"rollout_expert_indices[{i}] is None, expected captured routes"
            prompt_length = len(prompt_token_ids[i])
            sequence_length = prompt_length + len(response_ids[i])
            captured_rows = len(sample_indices)
            assert 0 < captured_rows <= sequence_length, (
                f"rollout_expert_indices[{i}] has {captured_rows} route rows for a "
                f"{sequence_length}-token trajectory, expected a non-empty prefix of it"
            )
            # Row t covers target t + 1, so every trained target needs a captured row.
            trained_positions = np.flatnonzero(np.asarray(loss_masks[i]))
            # A step-wise row's prompt is the history so far, so its routes must be the row's own:
            # one per token, less at most the last, which the engine never forwards. Routes for the
            # step's generated tokens alone, or for the whole trajectory on an earlier step, would
            # replay onto the wrong tokens. A row that trains nothing (masked, or overlong-filtered)
            # may carry a short dummy route: the trainer pads the rest, and no loss depends on it.
            assert not (step_wise and trained_positions.size) or captured_rows >= sequence_length - 1, (
                f"rollout_expert_indices[{i}] has {captured_rows} route rows for a {sequence_length}-token "
                "step-wise row: step-wise routes must cover the row's whole prompt and response"
            )
            if trained_positions.size:
                last_trained_token = prompt_length + int(trained_positions[-1])
                assert captured_rows >= last_trained_token, (
                    f"rollout_expert_indices[{i}] captured {captured_rows} route rows, which stops "
                    f"short of loss-active token {last_trained_token}: replaying that token on a "
                    "dummy route trains it on a route the rollout never took"
                )

    if rollout_sample_support is not None:
        for i, sample_support in enumerate(rollout_sample_support):
            assert sample_support is not None, f"{SAMPLE_SUPPORT_FIELD}[{i}] is None, expected captured support"
            assert len(sample_support) == len(response_ids[i]), (
                f"{SAMPLE_SUPPORT_FIELD}[{i}] has {len(sample_support)} support rows for "
                f"{len(response_ids[i])} response tokens, expected one row per response token"
            )


# skyrl/train/utils/trainer_utils.py:816-888
def _validate_step_wise_fields(generator_output: GeneratorOutput, num_responses: int):
    """Validate step-wise specific fields in the generator output.

    Checks that is_last_step and trajectory_ids are present, correctly sized,
    contiguously ordered, and that is_last_step boundaries align with trajectory_id changes.

    The contiguity check is critical: the trainer's advantage broadcast uses
    ``cumsum(shifted_is_last_step)`` to map each step to its trajectory, which
    silently produces wrong results if steps from the same trajectory are interleaved
    with steps from other trajectories.

    For more, see https://docs.skyrl.ai/docs/tutorials/step-wise-training#generatoroutput-format
    """
    assert (
        generator_output.get("is_last_step") is not None
    ), "step_wise=True but `is_last_step` is missing from generator output"
    assert (
        generator_output.get("trajectory_ids") is not None
    ), "step_wise=True but `trajectory_ids` is missing from generator output"

    is_last_step = generator_output["is_last_step"]
    trajectory_ids = generator_output["trajectory_ids"]

    assert (
        len(is_last_step) == num_responses
    ), f"is_last_step length ({len(is_last_step)}) must equal response_ids length ({num_responses})"
    assert (
        len(trajectory_ids) == num_responses
    ), f"trajectory_ids length ({len(trajectory_ids)}) must equal response_ids length ({num_responses})"

    assert (
        is_last_step[-1] is True
    ), "is_last_step[-1] must be True (the last sample must be the final step of a trajectory)"

    num_trajectories = sum(1 for x in is_last_step if x)
    assert num_trajectories >= 1, "is_last_step must contain at least one True value"

    # Validate contiguous ordering: all steps of the same trajectory must be adjacent.
    seen_trajectory_ids = set()
    prev_tid = None
    for i, tid in enumerate(trajectory_ids):
        tid_key = tid.to_string() if hasattr(tid, "to_string") else str(tid)
        if tid_key != prev_tid:
            assert tid_key not in seen_trajectory_ids, (
                f"Non-contiguous trajectory at index {i}: trajectory '{tid_key}' appeared before "
                f"(at earlier indices), then a different trajectory, then again here. "
                f"Step-wise training requires all steps of the same trajectory to be adjacent."
            )
            if prev_tid is not None:
                seen_trajectory_ids.add(prev_tid)
            prev_tid = tid_key
    if prev_tid is not None:
        seen_trajectory_ids.add(prev_tid)

    # Validate is_last_step aligns with trajectory boundaries (both directions)
    for i in range(num_responses - 1):
        tid_cur = trajectory_ids[i].to_string() if hasattr(trajectory_ids[i], "to_string") else str(trajectory_ids[i])
        tid_next = (
            trajectory_ids[i + 1].to_string()
            if hasattr(trajectory_ids[i + 1], "to_string")
            else str(trajectory_ids[i + 1])
        )
        if tid_cur != tid_next:
            assert is_last_step[i] is True, (
                f"Trajectory boundary at index {i} ('{tid_cur}' → '{tid_next}') "
                f"but is_last_step[{i}] is False. Must be True at trajectory boundaries."
            )
        else:
            assert is_last_step[i] is not True, (
                f"is_last_step[{i}] is True but trajectory continues "
                f"(trajectory '{tid_cur}' at index {i} and {i+1}). "
                f"is_last_step must only be True at the final step of a trajectory."
            )


# skyrl/train/fully_async_trainer.py:55-83
@dataclass
class GeneratedOutputGroup:
    """
    The GeneratorOutput for a single group of rollouts, along with the metadata.

    Attributes:
        generator_output (GeneratorOutput): The GeneratorOutput for a single group of rollouts.
            That is, the output to the same prompt, but `n_samples_per_prompt` of it.

        uid (str): The uid of the group. Underlyingly, it is the index of the data in train_dataloader.dataset.

        global_step_when_scheduled (int): The global step when the group was scheduled for generation,
            used for validating the staleness control.

        group_completion_time_s (Optional[float]): Wall-clock time (seconds) for the whole group to
            finish generation, i.e. the time for the slowest trajectory in the group to complete.
            None if generation timing was not captured.

        prompts (Optional[List[Any]]): The generator input prompts (in OpenAI message format) for this
            group, one per trajectory (parallel to ``generator_output["response_ids"]``). Retained so
            the trajectory logger can render prompt + response, mirroring the synchronous trainer which
            logs ``generator_input["prompts"]``. None if not captured.
    """

    generator_output: GeneratorOutput
    uid: str
    global_step_when_scheduled: int
    group_completion_time_s: Optional[float] = None
    prompts: Optional[List[Any]] = None


# RayPPOTrainer.handle_dynamic_sampling calls the module function through `trainer_utils`.
trainer_utils = types.SimpleNamespace(handle_dynamic_sampling=handle_dynamic_sampling)


class RayPPOTrainer:
    """skyrl.train.trainer.RayPPOTrainer: the methods a batch passes through before logging."""

    # skyrl/train/trainer.py:1009-1037 (RayPPOTrainer.generate)
    @torch.no_grad()
    async def generate(
        self,
        input_batch: GeneratorInput,
    ) -> GeneratorOutput:
        """
        Generate rollouts.

        If colocate_all is enabled:
        - before calling this method, the policy model should be on CPU and inference engine should
            be awake (i.e. on GPU).
        - after calling this method, the same model placement still holds.
        """
        # NOTE: we assume that .generate returns samples in the same order as passed in
        generator_output: GeneratorOutput = await self.generator.generate(input_batch)

        # add rollout metrics to self.all_metrics
        if generator_output["rollout_metrics"] is not None:
            self.all_metrics.update(generator_output["rollout_metrics"])
        generator_output.pop("rollout_metrics", None)

        validate_generator_output(
            len(input_batch["prompts"]),
            generator_output,
            step_wise=self.cfg.generator.step_wise_trajectories,
            routes_expected=self.cfg.generator.inference_engine.enable_return_routed_experts,
        )

        return generator_output

    # skyrl/train/trainer.py:1039-1148 (RayPPOTrainer.postprocess_generator_output)
    @torch.no_grad()
    def postprocess_generator_output(
        self,
        generator_output: GeneratorOutput,
        uids: List[str],
        metrics_generator_output: Optional[GeneratorOutput] = None,
        metrics_uids: Optional[List[str]] = None,
    ) -> Tuple[GeneratorOutput, List[str]]:
        """
        Converts to per token rewards and computes pass@N.

        For step-wise training with ``merge_stepwise_output=true``, also collapses
        consecutive turns sharing a common prefix into a single sequence; ``uids``
        is shortened to match.

        In the future algorithm specific reward or loss mask post processing should be done here.

        Reward metrics are computed over ``metrics_generator_output`` / ``metrics_uids`` when provided
        (a superset of the trained output -- e.g. sample_full_batch passes the dropped groups so metrics
        stay comparable), otherwise over ``generator_output`` / ``uids``. The per-token / loss-mask
        conversion always applies to ``generator_output`` only.

        Returns:
            (generator_output, uids) — uids may be shorter than the input when merging.
        """
        metrics_output = metrics_generator_output if metrics_generator_output is not None else generator_output
        metrics_output_uids = metrics_uids if metrics_uids is not None else uids
        generator_output_for_metrics = metrics_output
        uids_for_metrics = metrics_output_uids
        if self.cfg.generator.step_wise_trajectories:
            generator_output_for_metrics = defaultdict(list)
            for key in metrics_output:
                if isinstance(metrics_output[key], list):
                    generator_output_for_metrics[key] = [
                        metrics_output[key][i]
                        for i in range(len(metrics_output[key]))
                        if metrics_output["is_last_step"][i]
                    ]
            uids_for_metrics = [
                uid for uid, is_last_step in zip(metrics_output_uids, metrics_output["is_last_step"]) if is_last_step
            ]

        # only use `generator_output_for_metrics` for metrics calculation
        # For step-wise training, we only calculate metrics for the last step of each trajectory
        overall_metrics = get_metrics_from_generator_output(
            generator_output_for_metrics,
            uids_for_metrics,
        )

        # Prefix-aware merging of step-wise turns.
        if self.cfg.generator.merge_stepwise_output:
            assert self.cfg.generator.step_wise_trajectories, "merge_stepwise_output requires step-wise training"
            num_seq_before_merge = len(generator_output["response_ids"])
            generator_output = merge_stepwise_output(generator_output)
            num_seq_after_merge = len(generator_output["response_ids"])
            logger.info(f"Merged step wise: {num_seq_before_merge} sequences -> {num_seq_after_merge} sequences")
            self.all_metrics.update(
                {
                    "generate/num_seq_before_merge": num_seq_before_merge,
                    "generate/num_seq_after_merge": num_seq_after_merge,
                }
            )
            uids = [tid.instance_id for tid in generator_output["trajectory_ids"]]

        # these use the full generator output
        rewards: Union[List[float], List[List[float]]] = generator_output["rewards"]
        responses: List[List[int]] = generator_output["response_ids"]
        per_token_rewards: List[List[float]] = []

        # Check if rewards are already token-level (List[List[float]]) or response-level (List[float])
        if rewards and isinstance(rewards[0], list):
            # Token-level rewards: rewards is List[List[float]]
            per_token_rewards = rewards
        else:
            if self.cfg.trainer.algorithm.zero_variance_filter:
                kept_indices_set = set(
                    zero_variance_filter(
                        rewards,
                        uids,
                        loss_masks=generator_output["loss_masks"],
                        tol=self.cfg.trainer.algorithm.zero_variance_filter_tol,
                    )
                )
                num_groups = len(set(uids))
                num_kept_groups = len({uids[i] for i in kept_indices_set})
                self.all_metrics["reward/num_zero_variance_filtered"] = num_groups - num_kept_groups
                generator_output["loss_masks"] = [
                    [0] * len(mask) if i not in kept_indices_set else mask
                    for i, mask in enumerate(generator_output["loss_masks"])
                ]
            # Response-level rewards: rewards is List[float], convert to per-token rewards
            for reward, response in zip(rewards, responses):
                per_token_reward = [0.0] * len(response)
                per_token_reward[-1] = float(reward)
                per_token_rewards.append(per_token_reward)

        n_samples_per_prompt = self.cfg.generator.n_samples_per_prompt

        reward_metrics = {
            f"reward/avg_pass_at_{n_samples_per_prompt}": overall_metrics["pass_at_n"],
            "reward/avg_raw_reward": overall_metrics["avg_score"],
            "reward/mean_positive_reward": overall_metrics["mean_positive_reward"],
        }
        self.all_metrics.update(reward_metrics)
        logger.info(
            f"reward/avg_pass_at_{n_samples_per_prompt}: {overall_metrics['pass_at_n']}, reward/avg_raw_reward: {overall_metrics['avg_score']}, reward/mean_positive_reward: {overall_metrics['mean_positive_reward']}"
        )
        # re-assign reward but now it's per token rewards
        generator_output["rewards"] = per_token_rewards
        return generator_output, uids

    # skyrl/train/trainer.py:1614-1674 (RayPPOTrainer.handle_dynamic_sampling)
    def handle_dynamic_sampling(
        self, generator_output: GeneratorOutput, uids: List[str]
    ) -> Tuple[GeneratorOutput, List[str], bool]:
        """
        Handle dynamic sampling for the current batch.

        Accumulates the generator output and UIDs across batches if we are sampling repeatedly
        and applies the dynamic sampling strategy (i.e. filter, replace) to the current batch.
        If we hit the limit of max sample batches, we raise an error.

        Args:
            generator_output: Current batch generator output
            uids: Current batch UIDs

        Returns:
            processed_output: Filtered generator output
            processed_uids: Filtered UIDs
            keep_sampling: Whether to keep sampling
        """
        # Prepare sampling configuration
        max_sample_batches = self.cfg.trainer.algorithm.dynamic_sampling.max_sample_batches
        dynamic_sampling_config = {
            "type": self.cfg.trainer.algorithm.dynamic_sampling.type,
            "max_sample_batches": max_sample_batches,
            "min_replace_ratio": self.cfg.trainer.algorithm.dynamic_sampling.min_replace_ratio,
            "train_batch_size": self.cfg.trainer.train_batch_size,
            "n_samples_per_prompt": self.cfg.generator.n_samples_per_prompt,
        }

        if self.dynamic_sampling_state is None:
            self.dynamic_sampling_state: DynamicSamplingState = {
                "sample_batch_count": 1,
            }
        else:
            self.dynamic_sampling_state["sample_batch_count"] += 1

        # Handle dynamic sampling using utilities
        processed_output, processed_uids, keep_sampling, updated_state = trainer_utils.handle_dynamic_sampling(
            generator_output, uids, dynamic_sampling_config, self.dynamic_sampling_state
        )

        # Check max resample limit, and if we hit it, raise an error
        if (
            keep_sampling
            and max_sample_batches > 0
            and self.dynamic_sampling_state["sample_batch_count"] >= max_sample_batches
        ):
            raise RuntimeError(
                f"Exiting training loop due to hitting dynamic sampling limit for "
                f"{self.cfg.trainer.algorithm.dynamic_sampling.type} strategy with "
                f"{self.cfg.trainer.algorithm.dynamic_sampling.max_sample_batches} max sample batches. "
                f"Please check your data difficulty distribution."
            )
        # Update state
        self.dynamic_sampling_state = updated_state

        if not keep_sampling:
            # Reset state when sampling is complete
            self.dynamic_sampling_state = None

        return processed_output, processed_uids, keep_sampling


class FullyAsyncRayPPOTrainer(RayPPOTrainer):
    """skyrl.train.fully_async_trainer.FullyAsyncRayPPOTrainer: its per-step batch assembly."""

    # skyrl/train/fully_async_trainer.py:964-975 (FullyAsyncRayPPOTrainer._reprefix_metrics)
    @staticmethod
    def _reprefix_metrics(metrics: dict, suffix: str) -> dict:
        """Re-prefix metric keys into a separate view (``generate/X`` -> ``generate_<suffix>/X``),
        keeping the leading namespace so views group together in trackers."""
        out = {}
        for k, v in metrics.items():
            if "/" in k:
                prefix, rest = k.split("/", 1)
                out[f"{prefix}_{suffix}/{rest}"] = v
            else:
                out[f"{suffix}/{k}"] = v
        return out

    # skyrl/train/fully_async_trainer.py:977-1156 (FullyAsyncRayPPOTrainer.convert_generation_group_mini_batch_to_training_input)
    def convert_generation_group_mini_batch_to_training_input(
        self,
        cur_generation_group_mini_batch: List[GeneratedOutputGroup],
        dropped_groups: Optional[List[GeneratedOutputGroup]] = None,
    ) -> TrainingInputBatch:
        """Concatenate the mini-batch of generated groups and convert to a TrainingInputBatch.

        ``dropped_groups`` (zero-variance groups dropped this step under ``sample_full_batch``) are not
        trained on, but are folded into the reward/generation metrics to keep them comparable across runs.
        """
        dropped_groups = dropped_groups or []
        generator_outputs = []
        # Prompts for the kept groups, kept parallel to the concatenated `generator_output` so the
        # trajectory logger can render prompt + response (mirrors the sync trainer's use of
        # `generator_input["prompts"]`).
        prompts: List[Any] = []
        uids = []
        stalenesses = []
        staleness_violation_count = 0
        # Per-group completion times (seconds) and the intra-group spread (std and coefficient of
        # variation) of per-trajectory completion times. Helpful to understand tail latency
        group_completion_times: List[float] = []
        intra_group_stds: List[float] = []
        intra_group_cvs: List[float] = []
        for cur_generated_output_group in cur_generation_group_mini_batch:
            cur_staleness = self.global_step - cur_generated_output_group.global_step_when_scheduled
            stalenesses.append(cur_staleness)
            generator_outputs.append(cur_generated_output_group.generator_output)
            if cur_generated_output_group.prompts is not None:
                prompts.extend(cur_generated_output_group.prompts)

            # Collect per-group / per-trajectory completion-time stats for this group.
            if cur_generated_output_group.group_completion_time_s is not None:
                group_completion_times.append(cur_generated_output_group.group_completion_time_s)
            intra_group_std, intra_group_cv = get_intra_group_completion_time_std_cv(
                cur_generated_output_group.generator_output
            )
            if intra_group_std is not None:
                intra_group_stds.append(intra_group_std)
            if intra_group_cv is not None:
                intra_group_cvs.append(intra_group_cv)

            # NOTE(Charlie): for step-wise training each group can contain a variable number of entries
            # (n_samples_per_prompt * variable turns_per_trajectory), so the uid fanout is per-group.
            group_size = len(cur_generated_output_group.generator_output["response_ids"])
            uids.extend([cur_generated_output_group.uid] * group_size)

            # Check staleness violation.
            if cur_staleness > self.max_staleness_steps:
                # TODO(Charlie): should we drop, drop and resample, or just log?
                logger.warning(
                    "Staleness control violated despite using AsyncStalenessManager: "
                    f"cur_staleness={cur_staleness}, max_staleness_steps={self.max_staleness_steps}.\n"
                    "If this happens too often, consider increasing max_staleness_steps, adjusting "
                    "trainer.fully_async.num_parallel_generation_workers, or adjusting generation-training GPU allocation.\n"
                    "See https://docs.skyrl.ai/docs/tutorials/fully_async#async-staleness-manager for more details."
                )
                staleness_violation_count += 1

        generator_output = concatenate_generator_outputs(
            generator_outputs,
            step_wise=self.cfg.generator.step_wise_trajectories,
            routes_expected=self.cfg.generator.inference_engine.enable_return_routed_experts,
        )
        kept_rollout_metrics = generator_output["rollout_metrics"]
        assert kept_rollout_metrics is not None, "Rollout metrics should be non-null."

        # Kept + dropped view for the headline reward/generation metrics, so they stay comparable
        # across runs regardless of filtering. Dropped groups are used for metrics only, never trained.
        metrics_generator_output = None
        metrics_uids = None
        if dropped_groups:
            metrics_generator_output = concatenate_generator_outputs(
                generator_outputs + [g.generator_output for g in dropped_groups],
                step_wise=self.cfg.generator.step_wise_trajectories,
            )
            metrics_uids = []
            for g in list(cur_generation_group_mini_batch) + dropped_groups:
                metrics_uids.extend([g.uid] * len(g.generator_output["response_ids"]))

        # Headline generation (rollout) metrics: over kept + dropped when sample_full_batch dropped groups.
        rollout_metrics_source = metrics_generator_output if metrics_generator_output is not None else generator_output
        self.all_metrics.update(rollout_metrics_source["rollout_metrics"])

        group_completion_metrics = get_group_completion_metrics(
            group_completion_times, intra_group_stds, intra_group_cvs
        )

        if dropped_groups:
            # Also split generation metrics by kept vs dropped, plus reward metrics for the dropped
            # groups. (Kept reward metrics are uninformative -- pass@n ~1 -- and loss/avg_final_rewards
            # already covers the trained set.)
            dropped_generator_output = concatenate_generator_outputs(
                [g.generator_output for g in dropped_groups], step_wise=self.cfg.generator.step_wise_trajectories
            )
            self.all_metrics.update(self._reprefix_metrics(kept_rollout_metrics, "kept"))
            self.all_metrics.update(self._reprefix_metrics(dropped_generator_output["rollout_metrics"], "dropped"))
            dropped_uids = [g.uid for g in dropped_groups for _ in range(len(g.generator_output["response_ids"]))]
            dropped_reward = get_metrics_from_generator_output(dropped_generator_output, dropped_uids)

            n_samples_per_prompt = self.cfg.generator.n_samples_per_prompt
            self.all_metrics.update(
                {
                    f"reward_dropped/avg_pass_at_{n_samples_per_prompt}": dropped_reward["pass_at_n"],
                    "reward_dropped/avg_raw_reward": dropped_reward["avg_score"],
                    "reward_dropped/mean_positive_reward": dropped_reward["mean_positive_reward"],
                }
            )
            dropped_generator_output.pop("rollout_metrics", None)

            # Per-group completion times and intra-group spread for dropped groups
            dropped_group_completion_times = []
            dropped_group_intra_group_stds = []
            dropped_group_intra_group_cvs = []
            for dropped_group in dropped_groups:
                if dropped_group.group_completion_time_s is not None:
                    dropped_group_completion_times.append(dropped_group.group_completion_time_s)
                intra_group_std, intra_group_cv = get_intra_group_completion_time_std_cv(dropped_group.generator_output)
                if intra_group_std is not None:
                    dropped_group_intra_group_stds.append(intra_group_std)
                if intra_group_cv is not None:
                    dropped_group_intra_group_cvs.append(intra_group_cv)

            dropped_metrics = get_group_completion_metrics(
                dropped_group_completion_times, dropped_group_intra_group_stds, dropped_group_intra_group_cvs
            )

            self.all_metrics.update(self._reprefix_metrics(group_completion_metrics, "kept"))
            self.all_metrics.update(self._reprefix_metrics(dropped_metrics, "dropped"))

            merged_group_completion_times = group_completion_times + dropped_group_completion_times
            merged_intra_group_stds = intra_group_stds + dropped_group_intra_group_stds
            merged_intra_group_cvs = intra_group_cvs + dropped_group_intra_group_cvs
            # get merged metrics with kept + dropped groups
            group_completion_metrics = get_group_completion_metrics(
                merged_group_completion_times, merged_intra_group_stds, merged_intra_group_cvs
            )

        self.all_metrics.update(group_completion_metrics)

        generator_output.pop("rollout_metrics", None)
        if metrics_generator_output is not None:
            metrics_generator_output.pop("rollout_metrics", None)

        # Log staleness statistics for this step
        self.all_metrics.update(
            {
                "async/staleness_mean": sum(stalenesses) / len(stalenesses),
                "async/staleness_max": max(stalenesses),
                "async/staleness_min": min(stalenesses),
                "async/staleness_ratio": sum(1 for s in stalenesses if s > 0) / len(stalenesses),
                "async/staleness_violation_count": staleness_violation_count,
            }
        )

        # Per-token reward conversion (kept groups only) + reward metrics over the kept+dropped view.
        generator_output, uids = self.postprocess_generator_output(
            generator_output, uids, metrics_generator_output=metrics_generator_output, metrics_uids=metrics_uids
        )

        # print example just for debugging
        vis = self.tokenizer.decode(generator_output["response_ids"][0])
        logger.info(f"Example generated: {vis}")

        # Optionally upload up to `num_logger_train_samples` samples to tracker (mirrors the
        # synchronous trainer's train trajectory logging).
        if self.trajectory_logger is not None:
            with Timer("log_train_results"):
                self.trajectory_logger.log(
                    tracker=self.tracker,
                    num_samples=self.cfg.trainer.num_logger_train_samples,
                    prompts=prompts,
                    generator_output=generator_output,
                    tokenizer=self.tokenizer,
                    global_step=self.global_step,
                    wandb_key="trajectories/train",
                    include_idx=False,
                )

        return self.convert_to_training_input(generator_output, uids)
