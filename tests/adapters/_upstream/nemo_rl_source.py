# ruff: noqa
# mypy: ignore-errors
"""NeMo RL's own code for what `grpo_train` does to a rollout batch before its logging point, unchanged.

Source: NVIDIA-NeMo/RL (https://github.com/NVIDIA-NeMo/RL) at commit
7ea279abfbeb698b092856d0dab61e7cf39bc909 (2026-08-22, package_info 0.6.0).
Copyright (c) 2025, NVIDIA CORPORATION. Licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0); distributed on an "AS IS" BASIS, WITHOUT
WARRANTIES OR CONDITIONS OF ANY KIND.

Why a copy and not the package: the `nemo-rl` release on the package index is a 0.0.0
placeholder, and NeMo RL's source requires Python >= 3.13.14, above this project's test run.

Each definition below is copied byte for byte (by name, with `ast`) from the file and lines
named in the comment above it. The only changes are the imports at the top, standing in for the
modules these files import: `BatchedDataDict` (nemo_rl/distributed/batched_data_dict.py, a
`UserDict` of per-sample columns) by a `dict` subclass, which is all these functions use of it;
`PackedTensor` (multimodal_utils.py) by an empty class, as the tests carry no images; and the
`TypedDict`/config types named only in annotations by `Any`.
"""

from typing import Any, Optional, Sequence, cast

import torch
from pydantic import BaseModel

Tensor = torch.Tensor
LLMMessageLogType = Any
VLMMessageLogType = Any
FlatMessagesType = Any
ClippedPGLossConfig = Any


class BatchedDataDict(dict):
    """Stand-in for nemo_rl.distributed.batched_data_dict.BatchedDataDict (a UserDict of columns)."""

    def __class_getitem__(cls, item):
        return cls


class PackedTensor:
    """Stand-in for nemo_rl.data.multimodal_utils.PackedTensor: no multimodal data here."""



# nemo_rl/data/llm_message_utils.py, lines 39-56
def _validated_packed_values(key: str, values: list[Any]) -> list[PackedTensor]:
    """Return packed values while rejecting mixed non-empty representations."""
    if not any(isinstance(value, PackedTensor) for value in values):
        return []

    packed_values: list[PackedTensor] = []
    invalid_types: list[str] = []
    for value in values:
        if isinstance(value, PackedTensor):
            packed_values.append(value)
        elif value is not None:
            invalid_types.append(type(value).__name__)
    if invalid_types:
        raise TypeError(
            f"Packed multimodal key {key!r} also contains non-packed "
            f"values: {invalid_types}"
        )
    return packed_values


# nemo_rl/data/llm_message_utils.py, lines 59-147
def message_log_to_flat_messages(
    message_log: LLMMessageLogType,
) -> FlatMessagesType:
    """Converts a message log (sequence of message turns) into a flattened representation.

    This function takes a message log (list of dict messages with 'role', 'content', 'token_ids', etc.)
    and converts it to a flat dictionary where all tensors of the same key are concatenated and
    all strings of the same key are put into lists.

    Args:
        message_log: List of message dictionaries with 'role', 'content', and potentially 'token_ids'

    Returns:
        FlatMessagesType: Dictionary mapping keys to concatenated tensors and string lists

    Examples:
    ```{doctest}
    >>> import torch
    >>> from nemo_rl.data.llm_message_utils import message_log_to_flat_messages
    >>> # Create a simple message log with two messages
    >>> message_log = [
    ...     {'role': 'user', 'content': 'Hello', 'token_ids': torch.tensor([1, 2, 3])},
    ...     {'role': 'assistant', 'content': 'Hi there', 'token_ids': torch.tensor([4, 5, 6, 7])}
    ... ]
    >>> flat_msgs = message_log_to_flat_messages(message_log)
    >>> flat_msgs['role']
    ['user', 'assistant']
    >>> flat_msgs['content']
    ['Hello', 'Hi there']
    >>> flat_msgs['token_ids']
    tensor([1, 2, 3, 4, 5, 6, 7])
    >>>
    >>> # Multimodal example:
    >>> from nemo_rl.data.multimodal_utils import PackedTensor
    >>> img1 = torch.randn(2, 3, 4, 4)
    >>> img2 = torch.randn(3, 3, 4, 4)
    >>> mm_log = [
    ...     {'role': 'user', 'content': 'see', 'token_ids': torch.tensor([1]), 'images': PackedTensor(img1, dim_to_pack=0)},
    ...     {'role': 'assistant', 'content': 'ok', 'token_ids': torch.tensor([2, 3]), 'images': PackedTensor(img2, dim_to_pack=0)},
    ... ]
    >>> flat_mm = message_log_to_flat_messages(mm_log)
    >>> tuple(flat_mm['images'].as_tensor().shape)
    (5, 3, 4, 4)
    >>>
    ```
    """
    result: dict[str, list[Any]] = {}

    if len(message_log) == 0:
        return cast(FlatMessagesType, result)

    # Get all unique keys across all messages
    all_keys: set[str] = set()
    for msg in message_log:
        all_keys.update(msg.keys())

    # Initialize result with empty lists for each key
    for key in all_keys:
        result[key] = []

    # Collect values for each key
    for msg in message_log:
        for key in all_keys:
            if key in msg:
                result[key].append(msg[key])

    # Concatenate tensors for each key
    concat: FlatMessagesType = {}
    for key in result:
        if result[key] and isinstance(result[key][0], Tensor):
            try:
                concat[key] = torch.cat(result[key])
            except RuntimeError as e:
                if "same number of dimensions" in str(e):
                    raise RuntimeError(
                        f"tensors for {key=} must have same number of dimensions: {[t.shape for t in result[key]]}"
                    ) from e
                raise
        packed_values = _validated_packed_values(key, result[key])
        if packed_values:
            try:
                concat[key] = PackedTensor.merge_segments(packed_values)
            except Exception as e:
                raise RuntimeError(
                    f"Error concatenating packed multimodal data for {key=}"
                ) from e

    output: FlatMessagesType = {**result, **concat}
    return output


# nemo_rl/data/llm_message_utils.py, lines 202-231
def _pad_tensor(
    tensor: Tensor,
    max_len: int,
    pad_side: str,
    pad_value: int = 0,
) -> Tensor:
    """Pad a tensor to the specified length.

    Args:
        tensor: Tensor to pad
        max_len: Length to pad to
        pad_side: Whether to pad on the 'left' or 'right'
        pad_value: Value to use for padding

    Returns:
        torch.Tensor: Padded tensor
    """
    pad_len = max_len - tensor.size(0)
    if pad_len <= 0:
        return tensor

    padding = torch.full(
        (pad_len, *tensor.shape[1:]),
        pad_value,
        dtype=tensor.dtype,
        device=tensor.device,
    )
    return torch.cat(
        [padding, tensor] if pad_side == "left" else [tensor, padding], dim=0
    )


# nemo_rl/data/llm_message_utils.py, lines 234-254
def _validate_tensor_consistency(tensors: list[Tensor]) -> None:
    """Validate that all tensors have consistent dtypes and devices.

    Args:
        tensors: List of tensors to validate

    Raises:
        RuntimeError: If tensors have different dtypes or devices
    """
    if not tensors:
        return

    first = tensors[0]
    if not all(t is None or t.dtype == first.dtype for t in tensors):
        raise RuntimeError(
            f"expected consistent types but got: {[t.dtype for t in tensors]}"
        )
    if not all(t is None or t.device == first.device for t in tensors):
        raise RuntimeError(
            f"expected tensors on the same device but got: {[t.device for t in tensors]}"
        )


# nemo_rl/data/llm_message_utils.py, lines 257-430
def batched_message_log_to_flat_message(
    message_log_batch: list[LLMMessageLogType],
    pad_value_dict: Optional[dict[str, int]] = None,
    make_sequence_length_divisible_by: int = 1,
) -> tuple[BatchedDataDict[FlatMessagesType], Tensor]:
    """Process and pad a batch of message logs for model input.

    For each message log in the batch:
    1. Converts it to a flat representation using message_log_to_flat_messages
    2. Pads all resulting tensors to the same length for batching
    3. Returns a BatchedDataDict and sequence lengths tensor

    Padding is always applied to the right side of sequences.

    Args:
        message_log_batch: List of LLMMessageLogType (each a conversation with multiple turns)
        pad_value_dict: Dictionary mapping keys to padding values (default is 0)
        make_sequence_length_divisible_by: forces the data to be divisible by this value

    Returns:
        BatchedDataDict[FlatMessagesType]: Dictionary containing padded stacked tensors
        torch.Tensor: Input lengths tensor with shape [batch_size] (pre-padding lengths)

    Raises:
        RuntimeError: If tensors have different dtypes or devices

    Examples:
    ```{doctest}
    >>> import torch
    >>> from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message
    >>> from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    >>> # Create a batch of two message logs with different lengths
    >>> message_log_batch = [
    ...     # First conversation
    ...     [
    ...         {'role': 'user', 'content': 'What is 2+2?', 'token_ids': torch.tensor([1, 2, 3, 4, 5])},
    ...         {'role': 'assistant', 'content': '4', 'token_ids': torch.tensor([6, 7])}
    ...     ],
    ...     # Second conversation
    ...     [
    ...         {'role': 'user', 'content': 'Solve x+10=15', 'token_ids': torch.tensor([1, 8, 9, 10, 11, 12])},
    ...         {'role': 'assistant', 'content': 'x=5', 'token_ids': torch.tensor([13, 14, 15])}
    ...     ]
    ... ]
    >>> pad_value_dict = {'token_ids': 0}
    >>> batched_flat, input_lengths = batched_message_log_to_flat_message(message_log_batch, pad_value_dict)
    >>> batched_flat['token_ids'][0].tolist()
    [1, 2, 3, 4, 5, 6, 7, 0, 0]
    >>> batched_flat['token_ids'][1].tolist()
    [1, 8, 9, 10, 11, 12, 13, 14, 15]
    >>> batched_flat['content'][0]
    ['What is 2+2?', '4']
    >>> batched_flat['content'][1]
    ['Solve x+10=15', 'x=5']
    >>> batched_flat['role']
    [['user', 'assistant'], ['user', 'assistant']]
    >>> input_lengths
    tensor([7, 9], dtype=torch.int32)
    >>>
    >>> # Multimodal example: include images on both conversations and verify packing
    >>> from nemo_rl.data.multimodal_utils import PackedTensor
    >>> mm_batch = [
    ...     [
    ...         {'role': 'user', 'content': 'look', 'token_ids': torch.tensor([1, 2, 3]), 'images': PackedTensor(torch.randn(2, 3, 4, 4), dim_to_pack=0)},
    ...         {'role': 'assistant', 'content': 'ok', 'token_ids': torch.tensor([4])}
    ...     ],
    ...     [
    ...         {'role': 'user', 'content': 'again', 'token_ids': torch.tensor([5, 6]), 'images': PackedTensor(torch.randn(1, 3, 4, 4), dim_to_pack=0)},
    ...         {'role': 'assistant', 'content': 'fine', 'token_ids': torch.tensor([7, 8])}
    ...     ]
    ... ]
    >>> mm_flat, mm_lengths = batched_message_log_to_flat_message(mm_batch, pad_value_dict={'token_ids': 0})
    >>> isinstance(mm_flat['images'], PackedTensor)
    True
    >>> tuple(mm_flat['images'].as_tensor().shape)  # 2 + 1 images
    (3, 3, 4, 4)
    >>> mm_lengths
    tensor([4, 4], dtype=torch.int32)
    >>>
    ```
    """
    if not message_log_batch:
        return BatchedDataDict(), torch.empty(0)

    # Process each message log into a flat representation
    sequenced_lists = [message_log_to_flat_messages(ml) for ml in message_log_batch]
    all_keys = {k for seq in sequenced_lists for k in seq}

    # Find max length and identify tensor keys
    max_len = 0
    tensor_keys = []
    multimodal_keys = []
    for seq in sequenced_lists:
        for key, value in seq.items():
            if isinstance(value, Tensor):
                tensor_keys.append(key)
                max_len = max(max_len, value.size(0))

    if max_len % make_sequence_length_divisible_by != 0:
        max_len = (
            (max_len // make_sequence_length_divisible_by) + 1
        ) * make_sequence_length_divisible_by

    # Handle non-tensor case
    if not tensor_keys:
        result: BatchedDataDict[FlatMessagesType] = BatchedDataDict(
            {
                k: [seq[k][0] if k in seq else None for seq in sequenced_lists]
                for k in all_keys
            }
        )
        return result, torch.empty(0)

    # Create input_lengths tensor
    input_lengths = []
    for seq in sequenced_lists:
        # Find the maximum length among all tensors in the dictionary, default to 0 if none exist
        # Use maximum here since there may be keys that aren't populated for all messages yet.
        # For example, logprobs don't get populated for non-generated tokens until post-processing.
        seq_len = max(
            (v.size(0) for v in seq.values() if isinstance(v, Tensor)), default=0
        )
        input_lengths.append(seq_len)
    input_lengths_tensor = torch.tensor(input_lengths, dtype=torch.int32)

    # Process each key
    result = BatchedDataDict()
    for key in all_keys:
        values = [seq.get(key) for seq in sequenced_lists]
        packed_values = _validated_packed_values(key, values)
        # Preserve one logical row for conversations missing this media key.
        # Async replay may concatenate text-only and multimodal prompt groups in
        # either order, so the first row cannot determine the value type.
        if packed_values:
            template = packed_values[0]
            aligned_values = [
                (
                    value
                    if isinstance(value, PackedTensor)
                    else PackedTensor.empty_rows_like(template, 1)
                )
                for value in values
            ]
            result[key] = PackedTensor.flattened_concat(aligned_values)
            continue
        if not values or not isinstance(values[0], Tensor):
            result[key] = values
            continue

        # Filter out None values and validate consistency
        values: list[Tensor | None] = cast(list[Tensor | None], values)
        tensors = cast(list[Tensor], [t for t in values if t is not None])
        try:
            _validate_tensor_consistency(tensors)
        except RuntimeError as e:
            e.add_note(f"[key={key!r}]")
            raise

        # Create zero tensors for None values
        filled_values: list[Tensor] = [
            (
                torch.zeros(0, dtype=tensors[0].dtype, device=tensors[0].device)  # type: ignore
                if v is None
                else v
            )
            for v in values
        ]

        # Pad and stack tensors (always right padding)
        pad_value = pad_value_dict.get(key, 0) if pad_value_dict else 0
        padded = [_pad_tensor(t, max_len, "right", pad_value) for t in filled_values]
        result[key] = torch.stack(padded)

    return result, input_lengths_tensor


# nemo_rl/experience/rollouts.py, lines 297-302
def _find_routed_experts_template(message_log: list[dict]) -> Optional[torch.Tensor]:
    for msg in message_log:
        routed_experts = msg.get("routed_experts")
        if isinstance(routed_experts, torch.Tensor):
            return routed_experts
    return None


# nemo_rl/experience/rollouts.py, lines 323-364
def backfill_missing_routed_experts(
    message_logs: Sequence[list[dict]],
) -> None:
    """Give every tokenized message a ``routed_experts`` row, in place.

    Routes are attached only where generation ran, so a trajectory whose first
    turn raised (or a turn whose routes vLLM could not return) leaves messages
    without the field while its siblings have it. Flattening then either stacks
    ragged ranks or silently concatenates a short column, so fill the gaps with
    the all--1 missing-route sentinel: Megatron routes those tokens with its own
    router, which is the honest answer for tokens no capture covered.

    No-op when the batch carries no routes at all — that is the router-replay-off
    case, and on the TQ paths the producer-side guard must still see the field
    missing so it can report a capture failure.
    """
    template = None
    for message_log in message_logs:
        template = _find_routed_experts_template(message_log)
        if template is not None:
            break
    if template is None:
        return
    if template.dim() != 3:
        raise ValueError(
            "routed_experts messages must have shape [tokens, layers, topk], "
            f"got {tuple(template.shape)}"
        )

    for message_log in message_logs:
        for msg in message_log:
            token_ids = msg.get("token_ids")
            if not isinstance(token_ids, torch.Tensor):
                continue
            if isinstance(msg.get("routed_experts"), torch.Tensor):
                continue
            msg["routed_experts"] = torch.full(
                (int(token_ids.shape[0]), template.shape[1], template.shape[2]),
                ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL,
                dtype=template.dtype,
                device=template.device,
            )


# nemo_rl/algorithms/grpo.py, lines 1877-1907
def extract_initial_prompt_messages(
    message_logs: list,
    original_prompt_lengths: torch.Tensor,
) -> list:
    """Extract the original prompt messages from message logs using token length.

    This function correctly identifies original prompt messages even when the prompt
    contains assistant messages (e.g., multi-turn conversation history).

    Args:
        message_logs: List of message logs, where each log is a list of messages.
        original_prompt_lengths: Tensor of original prompt token lengths per sample.

    Returns:
        List of message logs containing only the original prompt messages.
    """
    initial_prompt_message_logs = []
    for i, message_log in enumerate(message_logs):
        initial_prompt_log = []
        cumulative_length = 0
        target_length = original_prompt_lengths[i].item()

        for message in message_log:
            if cumulative_length >= target_length:
                break
            initial_prompt_log.append(message)
            cumulative_length += len(message["token_ids"])

        initial_prompt_message_logs.append(initial_prompt_log)

    return initial_prompt_message_logs


# nemo_rl/algorithms/grpo.py, lines 1910-1942
def add_grpo_token_loss_masks_and_generation_logprobs(
    message_logs: list[LLMMessageLogType | VLMMessageLogType],
) -> None:
    """Add GRPO loss masks and ensure generation logprobs exist in message logs.

    Assistant messages can be part of the original multi-turn prompt history. Only
    generated assistant messages have generation_logprobs, so use that field as the
    trainable-token marker. This function mutates each message in-place by adding a
    token_loss_mask and, when missing, a zero-valued generation_logprobs tensor.
    Router-replay routes get the same treatment via
    :func:`backfill_missing_routed_experts`, so every per-token field is defined
    for every tokenized message before the batch is flattened.

    Args:
        message_logs: Batch of tokenized message logs. Each message must contain a
            ``role`` and ``token_ids`` field. Messages that already contain
            ``generation_logprobs`` are treated as rollout-generated messages.
    """
    backfill_missing_routed_experts(message_logs)
    for message_log in message_logs:
        for message in message_log:
            role = cast(str, message["role"])
            token_ids = cast(torch.Tensor, message["token_ids"])

            if role == "assistant" and "generation_logprobs" in message:
                message["token_loss_mask"] = torch.ones_like(token_ids)
            else:
                message["token_loss_mask"] = torch.zeros_like(token_ids)

            if "generation_logprobs" not in message:
                message["generation_logprobs"] = torch.zeros_like(
                    token_ids, dtype=torch.float32
                )


# nemo_rl/algorithms/utils.py, lines 104-198
def calculate_baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
    std_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Function to compute a baseline for each (prompt, response) pair in the batch.

    The same baseline is calculated for each prompt. Samples set to 0 in 'valid_mask'
    are not included in the baseline calculation.

    prompts:    tensor (b, s)     Tensor of prompts the model used. May be on any device
    rewards:    tensor (b,)       Float-valued rewards. May be on any device
    valid_mask: tensor (b,)       Vector of 0/1, where 0 is to ignore and 1 is to keep
    leave_one_out_baseline: bool  Compute an unbiased baseline by leaving out the sample that
                                  the baseline is for (from RLOO https://arxiv.org/abs/2402.14740)
    std_rewards: tensor (b,)      Optional separate reward tensor used only for the std
                                  calculation. Defaults to `rewards`. Useful for DAPO,
                                  which needs std on the raw task metric for dynamic
                                  sampling filtering while keeping baseline on the
                                  shaped reward.

    Returns:
    tensor (b,), tensor (b,) of baselines and std on the same device as 'rewards'
    """
    if std_rewards is None:
        std_rewards = rewards
    unique_prompts = torch.unique(prompts, dim=0)

    baseline = torch.zeros_like(rewards)
    sq_baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    device_ordinal = rewards.get_device()
    if device_ordinal == -1:
        reward_device = torch.device("cpu")
    else:
        reward_device = torch.device(f"cuda:{device_ordinal}")

    for i in range(len(unique_prompts)):
        is_matching_prompt = (prompts == unique_prompts[i]).all(1)
        prompt_idx = torch.arange(len(prompts), device=reward_device)[
            is_matching_prompt
        ]

        if leave_one_out_baseline:
            baseline_mask_matrix = (1 - torch.eye(len(prompt_idx))).to(reward_device)
        else:
            baseline_mask_matrix = torch.ones((len(prompt_idx), len(prompt_idx))).to(
                reward_device
            )

        if valid_mask[prompt_idx].sum() <= 1:
            # Ignore sample: there are no valid responses, so set baseline equal to reward
            # to ignore it in the loss computation
            baseline[prompt_idx] = rewards[prompt_idx]
        else:
            num_valid = valid_mask[prompt_idx].float().sum() - int(
                leave_one_out_baseline
            )
            prompt_baseline = (
                torch.matmul(
                    baseline_mask_matrix, rewards[prompt_idx] * valid_mask[prompt_idx]
                )
                / num_valid
            )
            std_prompt_baseline = (
                prompt_baseline
                if std_rewards is rewards
                else torch.matmul(
                    baseline_mask_matrix,
                    std_rewards[prompt_idx] * valid_mask[prompt_idx],
                )
                / num_valid
            )
            std_prompt_baseline_square = (
                torch.matmul(
                    baseline_mask_matrix,
                    torch.pow(std_rewards[prompt_idx], 2) * valid_mask[prompt_idx],
                )
                / num_valid
            )

            baseline[prompt_idx] = prompt_baseline
            sq_baseline[prompt_idx] = std_prompt_baseline_square
            std[prompt_idx] = (
                (
                    (std_prompt_baseline_square - std_prompt_baseline.square())
                    * (num_valid / (num_valid - 1))
                )
                .sqrt()
                .nan_to_num(0)
            )

    return baseline, std


# nemo_rl/algorithms/advantage_estimator.py, lines 44-54
class AdvEstimatorConfig(BaseModel, extra="allow"):
    """Configuration for advantage estimator (GRPO, GDPO, or Reinforce++)."""

    name: str = "grpo"  # "grpo", "gdpo", or "reinforce_plus_plus"
    # GRPO specific
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    # GDPO specific: optional per-component weights w_n for the aggregation.
    reward_weights: list[float] | None = None
    # Reinforce++ specific
    minus_baseline: bool = True


# nemo_rl/algorithms/advantage_estimator.py, lines 57-98
class GRPOAdvantageEstimator:
    """GRPO-style advantage estimator with leave-one-out baseline.

    Note: GRPO computes advantages over all responses for each prompt.
    """

    def __init__(
        self, estimator_config: AdvEstimatorConfig, loss_config: ClippedPGLossConfig
    ):
        self.use_leave_one_out_baseline = estimator_config.use_leave_one_out_baseline
        self.normalize_rewards = estimator_config.normalize_rewards

    def compute_advantage(self, prompt_ids, rewards, mask, **kwargs):
        """Compute GRPO advantages.

        Args:
            prompt_ids: Tensor of shape [batch_size] identifying which prompt each sample belongs to.
            rewards: Tensor of shape [batch_size] containing reward for each sample.
            mask: Response token mask of shape [batch_size, seq_len], 1 for valid response tokens, 0 for padding.
                  Used only for expanding advantages to token-level shape.
            **kwargs: Additional arguments (unused).

        Returns:
            Advantages tensor of shape [batch_size, seq_len].
        """
        baseline, std = calculate_baseline_and_std_per_prompt(
            prompt_ids,
            rewards,
            torch.ones_like(rewards),
            leave_one_out_baseline=self.use_leave_one_out_baseline,
        )
        advantages = (rewards - baseline).unsqueeze(-1)

        if self.normalize_rewards:
            # don't sharpen the ones with no variation
            epsilon = 1e-6
            non_zero_std_mask = std > 0
            advantages[non_zero_std_mask] = advantages[non_zero_std_mask] / (
                std.unsqueeze(-1)[non_zero_std_mask] + epsilon
            )

        return advantages.expand(mask.shape)

