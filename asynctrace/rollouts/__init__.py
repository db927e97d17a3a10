"""Rollout codecs: token tensors or lists in, chat-shaped `Sample`s out.

torch is imported only when a tensor is passed; plain Python lists work everywhere.
"""

from __future__ import annotations

from ._decode import decode_rollouts, row_scores
from ._mapping import prompt_index, prompt_indices
from ._stepwise import MergeStats, StepWiseMerge, merge_step_wise
from ._toy import encode_turns, toy_tokenizer

__all__ = [
    "MergeStats",
    "StepWiseMerge",
    "decode_rollouts",
    "encode_turns",
    "merge_step_wise",
    "prompt_index",
    "prompt_indices",
    "row_scores",
    "toy_tokenizer",
]
