# Copied verbatim from allenai/open-instruct at commit e6c3044aa6201c8bfa4573c1b03142af599e730d
# (https://github.com/allenai/open-instruct), file(s): open_instruct/data_loader.py, open_instruct/utils.py (combine_reward_metrics),
# open_instruct/dataset_transformation.py (the column names).
# open-instruct is licensed under the Apache License, Version 2.0 (the "License"); you may not
# use this file except in compliance with the License. You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software distributed under the
# License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND,
# either express or implied. See the License for the specific language governing permissions
# and limitations under the License.
#
# open-instruct cannot be installed from a package index, so the tests run these definitions
# from its source. Only the definitions the tests run are copied; each keeps upstream's text
# (line numbers given).
# The imports are this package's copies instead of open_instruct's modules, and annotations
# are postponed (so the vllm, ray and datasets types they name need not be installed). Names
# that only paths the tests never take reach (ray with an actor_manager,
# add_prompt_to_generator with replenish_prompts) are not defined here.

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tests.adapters._upstream import open_instruct_data_types as data_types
from tests.adapters._upstream.open_instruct_model_utils import Batch

logger = logging.getLogger(__name__)

# open_instruct/dataset_transformation.py lines 869-871, 941, 1080
GROUND_TRUTHS_KEY = "ground_truth"
VERIFIER_SOURCE_KEY = "dataset"
RAW_PROMPT_KEY = "prompt"
TOOLS_COLUMN_KEY = "tools"
INPUT_IDS_PROMPT_KEY = "input_ids_prompt"


# open_instruct/utils.py lines 2653-2676
def combine_reward_metrics(reward_metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Assumes same number of metric_records in each dict in the list"""
    buckets = defaultdict(list)
    for metrics in reward_metrics:
        for key, value in metrics.items():
            buckets[key].append(value)

    combined: dict[str, Any] = {}
    for key, records in buckets.items():
        sample_value = records[0]
        if isinstance(sample_value, np.ndarray):
            combined[key] = [x for value in records for x in value]
        elif isinstance(sample_value, (list | tuple)):
            concatenated: list[Any] = []
            for value in records:
                concatenated.extend(list(value))
            combined[key] = concatenated
        elif isinstance(sample_value, (int | float | bool | np.integer | np.floating)):
            # combine and get average value
            combined[key] = sum(value for value in records) / len(records) if len(records) > 0 else sample_value
        else:
            # Fallback: keep the latest value if aggregation strategy is unclear.
            combined[key] = records[-1]
    return combined


# open_instruct/data_loader.py lines 644-657
@dataclass
class BatchStatistics:
    prompt_lengths: list[int]
    response_lengths: list[int]
    filtered_prompts: int
    filtered_prompts_zero: int
    filtered_prompts_solved: int
    filtered_prompts_nonzero: int
    filtered_prompts_pct: float
    percent_solved_mean: float
    percent_solved_hist: np.ndarray
    no_resampled_prompts: int
    total_prompts: int
    per_group_generation_times: np.ndarray = field(default_factory=lambda: np.array([], dtype=float))


# open_instruct/data_loader.py lines 742-991
@dataclass
class Group:
    """All samples for one GRPO group: a single prompt with n generations."""

    result: data_types.GenerationResult
    query: list[int]
    ground_truth: list[int]
    dataset: str
    raw_query: str
    active_tools: list[str] | None
    index: int
    decoded_responses: list[str]
    reward_scores: list[float]
    reward_metrics: dict[str, Any]
    percent_solved: float


def process_group(
    result: data_types.GenerationResult,
    generation_config: vllm.SamplingParams,
    tokenizer: PreTrainedTokenizer,
    dataset: Dataset,
    max_possible_score: float,
    no_resampling_pass_rate: float | None,
    iter_dataloader: HFDataLoader | None,
    filter_zero_std_samples: bool,
    replenish_prompts: bool,
    param_prompt_Q: ray_queue.Queue | None,
    base_env_config: EnvConfig,
    ground_truth_overrides: dict[int, Any] | None = None,
) -> Group | None:
    assert result.index is not None
    assert result.reward_scores is not None
    assert result.token_statistics is not None
    assert len(result.responses) == generation_config.n, (
        f"Mismatch: individual prompt result has {len(result.responses)} responses "
        f"but expected {generation_config.n} samples per prompt. "
        f"Index: {result.index}, Prompt ID: {result.prompt_id}"
    )

    example = dataset[result.index]
    query = example[INPUT_IDS_PROMPT_KEY]
    ground_truth = example[GROUND_TRUTHS_KEY]
    dataset_name = example[VERIFIER_SOURCE_KEY]
    raw_query = example[RAW_PROMPT_KEY]
    sample_active_tools = example.get(TOOLS_COLUMN_KEY)

    if replenish_prompts:
        assert iter_dataloader is not None and param_prompt_Q is not None
        example = next(iter_dataloader)
        add_prompt_to_generator(
            example,
            iter_dataloader._epoch,
            param_prompt_Q,
            generation_config,
            is_eval=False,
            base_env_config=base_env_config,
            ground_truth_overrides=ground_truth_overrides,
        )

    for i in range(len(result.finish_reasons)):
        if result.finish_reasons[i] == "stop" and len(result.responses[i]) == 0:
            result.responses[i].append(tokenizer.eos_token_id)
            result.masks[i].append(1)
            result.logprobs[i].append(float("nan"))

    decoded_responses = tokenizer.batch_decode(result.responses, skip_special_tokens=False)

    percent_solved = np.mean(result.reward_scores).item() / max_possible_score
    if no_resampling_pass_rate is not None and percent_solved >= no_resampling_pass_rate:
        assert iter_dataloader is not None
        iter_dataloader.exclude_index(result.index)

    if filter_zero_std_samples and np.std(result.reward_scores) == 0:
        return None

    return Group(
        result=result,
        query=query,
        ground_truth=ground_truth,
        dataset=dataset_name,
        raw_query=raw_query,
        active_tools=sample_active_tools,
        index=result.index,
        decoded_responses=decoded_responses,
        reward_scores=result.reward_scores,
        reward_metrics=result.reward_metrics or {},
        percent_solved=percent_solved,
    )


def make_batch_from_groups(
    groups: list[Group],
    generation_config: vllm.SamplingParams,
    training_step: int,
    actor_manager=None,
    filtered_prompts: int = 0,
    filtered_prompts_zero: int = 0,
    filtered_prompts_solved: int = 0,
    filtered_prompts_nonzero: int = 0,
    no_resampled_prompts: int = 0,
    stale_results_dropped: int = 0,
) -> tuple[data_types.GenerationResult, Batch, dict, BatchStatistics]:
    assert len(groups) > 0, "make_batch_from_groups requires at least one group"

    all_queries = []
    all_ground_truths = []
    all_datasets = []
    all_raw_queries = []
    all_decoded_responses = []
    all_reward_metrics = []
    all_active_tools = []
    all_scores = []
    all_indices = []
    all_percent_solved = []
    all_model_steps = []

    combined_responses = []
    combined_finish_reasons = []
    combined_masks = []
    combined_num_calls = []
    combined_timeouts = []
    combined_tool_errors = []
    combined_tool_outputs = []
    combined_tool_runtimes = []
    combined_tool_calleds = []
    combined_tool_call_stats = []
    combined_rollout_states = []
    combined_logprobs = []

    earliest_start_time = float("inf")
    prompt_lengths = []
    response_lengths = []

    total_prompt_tokens = 0
    total_response_tokens = 0
    max_generation_time = 0
    per_group_generation_times: list[float] = []

    for group in groups:
        result = group.result
        all_queries.extend([group.query] * generation_config.n)
        all_ground_truths.extend([group.ground_truth] * generation_config.n)
        all_datasets.extend([group.dataset] * generation_config.n)
        all_raw_queries.extend([group.raw_query] * generation_config.n)
        all_active_tools.extend([group.active_tools] * generation_config.n)
        all_indices.extend([group.index] * generation_config.n)
        all_decoded_responses.extend(group.decoded_responses)
        all_scores.extend(group.reward_scores)
        all_reward_metrics.append(group.reward_metrics)
        all_percent_solved.append(group.percent_solved)
        all_model_steps.extend([result.model_step] * len(result.responses))

        combined_responses.extend(result.responses)
        combined_finish_reasons.extend(result.finish_reasons)
        combined_masks.extend(result.masks)
        combined_num_calls.extend(result.request_info.num_calls)
        combined_timeouts.extend(result.request_info.timeouts)
        combined_tool_errors.extend(result.request_info.tool_errors)
        combined_tool_outputs.extend(result.request_info.tool_outputs)
        combined_tool_runtimes.extend(result.request_info.tool_runtimes)
        combined_tool_calleds.extend(result.request_info.tool_calleds)
        combined_tool_call_stats.extend(result.request_info.tool_call_stats)
        combined_rollout_states.extend(result.request_info.rollout_states)

        combined_logprobs.extend(result.logprobs)

        earliest_start_time = min(earliest_start_time, result.start_time)

        prompt_lengths.append(len(group.query))

        for response in result.responses:
            response_lengths.append(len(response))

        total_prompt_tokens += result.token_statistics.num_prompt_tokens
        total_response_tokens += result.token_statistics.num_response_tokens
        max_generation_time = max(max_generation_time, result.token_statistics.generation_time)
        per_group_generation_times.append(result.token_statistics.generation_time)

    accumulated_stats = data_types.TokenStatistics(
        num_prompt_tokens=total_prompt_tokens,
        num_response_tokens=total_response_tokens,
        generation_time=max_generation_time,
        earliest_start_time=earliest_start_time,
    )

    combined_request_info = data_types.RequestInfo(
        num_calls=combined_num_calls,
        timeouts=combined_timeouts,
        tool_errors=combined_tool_errors,
        tool_outputs=combined_tool_outputs,
        tool_runtimes=combined_tool_runtimes,
        tool_calleds=combined_tool_calleds,
        tool_call_stats=combined_tool_call_stats,
        rollout_states=combined_rollout_states,
    )

    combined_result = data_types.GenerationResult(
        responses=combined_responses,
        finish_reasons=combined_finish_reasons,
        masks=combined_masks,
        request_info=combined_request_info,
        index=None,
        prompt_id=groups[0].result.prompt_id,
        token_statistics=accumulated_stats,
        logprobs=combined_logprobs,
    )

    if actor_manager is not None:
        ray.get(actor_manager.report_token_statistics.remote(accumulated_stats))

    batch = Batch(
        queries=all_queries,
        ground_truths=all_ground_truths,
        datasets=all_datasets,
        raw_queries=all_raw_queries,
        decoded_responses=all_decoded_responses,
        indices=all_indices,
        scores=all_scores,
        active_tools=all_active_tools if any(all_active_tools) else None,
        model_steps=all_model_steps,
    )

    combined_reward_metrics = combine_reward_metrics(all_reward_metrics)
    model_steps_array = np.array(all_model_steps, dtype=float)
    combined_reward_metrics["model_step_min"] = float(model_steps_array.min())
    combined_reward_metrics["model_step_max"] = float(model_steps_array.max())
    combined_reward_metrics["model_step_mean"] = float(model_steps_array.mean())
    combined_reward_metrics["num_steps_off_policy"] = float(training_step - model_steps_array.mean())
    combined_reward_metrics["stale_results_dropped"] = float(stale_results_dropped)
    percent_solved_mean = np.mean(all_percent_solved) if all_percent_solved else 0.0

    total_prompts = len(groups)
    total_seen = filtered_prompts + total_prompts
    filtered_prompts_pct = filtered_prompts / total_seen if total_seen > 0 else 0.0
    batch_stats = BatchStatistics(
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        filtered_prompts=filtered_prompts,
        filtered_prompts_zero=filtered_prompts_zero,
        filtered_prompts_solved=filtered_prompts_solved,
        filtered_prompts_nonzero=filtered_prompts_nonzero,
        filtered_prompts_pct=filtered_prompts_pct,
        percent_solved_mean=percent_solved_mean,
        percent_solved_hist=np.array(all_percent_solved),
        no_resampled_prompts=no_resampled_prompts,
        total_prompts=total_prompts,
        per_group_generation_times=np.array(per_group_generation_times, dtype=float),
    )
    return combined_result, batch, combined_reward_metrics, batch_stats


# open_instruct/data_loader.py lines 1187-1202
def maybe_mask_truncated_completions(result: data_types.GenerationResult, batch: Batch, enabled: bool) -> Batch:
    """If enabled, drop rollouts that didn't finish with 'stop' from result (in place) and batch."""
    if not enabled:
        return batch
    stop_idxes = [i for i, fr in enumerate(result.finish_reasons) if fr == "stop"]
    num_truncated = len(result.finish_reasons) - len(stop_idxes)
    if num_truncated > 0:
        logger.info(
            f"[DataPreparationActor] Filtered {num_truncated} responses that didn't finish with 'stop'. "
            f"Retention rate: {len(stop_idxes) / len(result.finish_reasons):.2%}"
        )
    result.responses = [result.responses[i] for i in stop_idxes]
    result.masks = [result.masks[i] for i in stop_idxes]
    result.finish_reasons = [result.finish_reasons[i] for i in stop_idxes]
    result.logprobs = [result.logprobs[i] for i in stop_idxes]
    return batch[stop_idxes]


def data_preparation_step(self: Any, result: data_types.GenerationResult, batch: Batch) -> tuple[Batch, Any]:
    """What DataPreparationActor._data_preparation_loop does to a batch before its logging point.

    The body is that method's lines 1453 and 1472-1484 of open_instruct/data_loader.py, unchanged
    (one indentation level less), between accumulate_inference_batches and save_rollouts_to_disk.
    `self` needs only `config` (mask_truncated_completions, num_samples_per_prompt_rollout,
    advantage_normalization_type).
    """
    batch = maybe_mask_truncated_completions(result, batch, self.config.mask_truncated_completions)

    scores = np.array(batch.scores)
    scores_per_prompt = scores.reshape(-1, self.config.num_samples_per_prompt_rollout)
    mean_grouped_rewards = scores_per_prompt.mean(axis=-1)
    mean_grouped_rewards = np.repeat(mean_grouped_rewards, self.config.num_samples_per_prompt_rollout, axis=0)
    std_grouped_rewards = scores_per_prompt.std(axis=-1)
    std_grouped_rewards = np.repeat(std_grouped_rewards, self.config.num_samples_per_prompt_rollout, axis=0)

    if self.config.advantage_normalization_type == "standard":
        advantages = (scores - mean_grouped_rewards) / (std_grouped_rewards + 1e-8)
    elif self.config.advantage_normalization_type == "centered":
        advantages = scores - mean_grouped_rewards
    else:
        raise ValueError(f"Invalid advantage normalization type: {self.config.advantage_normalization_type}")
    return batch, advantages
