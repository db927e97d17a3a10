# Copied verbatim from allenai/open-instruct at commit e6c3044aa6201c8bfa4573c1b03142af599e730d
# (https://github.com/allenai/open-instruct), file(s): open_instruct/rl_utils.py.
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
# open-instruct's own rollout saving (config.save_traces), which runs at the same point.

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

import numpy as np

from tests.adapters._upstream import open_instruct_data_types as data_types
from tests.adapters._upstream import open_instruct_model_utils as model_utils

logger = logging.getLogger(__name__)


# open_instruct/rl_utils.py lines 30-44
@dataclass
class RolloutRecord:
    step: int
    sample_idx: int
    prompt_idx: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    reward: float
    advantage: float
    finish_reason: str
    dataset: str
    ground_truth: list[int] | None = None
    request_info: dict | None = None
    logprobs: list[float] | None = None



# open_instruct/rl_utils.py lines 70-128
def _get_request_info_for_sample(request_info: data_types.RequestInfo | None, i: int) -> dict | None:
    """Extract per-sample request info from batch-level RequestInfo."""
    if not request_info:
        return None
    return {
        "num_calls": request_info.num_calls[i] if i < len(request_info.num_calls) else 0,
        "timeouts": request_info.timeouts[i] if i < len(request_info.timeouts) else 0,
        "tool_errors": request_info.tool_errors[i] if i < len(request_info.tool_errors) else "",
        "tool_outputs": request_info.tool_outputs[i] if i < len(request_info.tool_outputs) else "",
        "tool_runtimes": request_info.tool_runtimes[i] if i < len(request_info.tool_runtimes) else 0.0,
        "tool_calleds": request_info.tool_calleds[i] if i < len(request_info.tool_calleds) else False,
        "tool_call_stats": (
            [asdict(s) for s in request_info.tool_call_stats[i]] if i < len(request_info.tool_call_stats) else []
        ),
        "rollout_state": request_info.rollout_states[i] if i < len(request_info.rollout_states) else {},
    }


def _save_rollouts(
    save_path: str,
    run_name: str,
    step: int,
    batch: model_utils.Batch,
    result: data_types.GenerationResult,
    advantages: np.ndarray,
    num_samples_per_prompt: int,
    shard_idx: int,
) -> None:
    shard_filename = f"{run_name}_rollouts_{shard_idx:06d}.jsonl"
    filepath = os.path.join(save_path, shard_filename)
    os.makedirs(save_path, exist_ok=True)

    assert batch.scores is not None, "batch.scores must not be None when saving rollouts"

    records = []
    for i in range(len(batch.queries)):
        records.append(
            asdict(
                RolloutRecord(
                    step=step,
                    sample_idx=i,
                    prompt_idx=i // num_samples_per_prompt,
                    prompt_tokens=batch.queries[i],
                    response_tokens=result.responses[i],
                    reward=float(batch.scores[i]),
                    advantage=float(advantages[i]),
                    finish_reason=result.finish_reasons[i],
                    dataset=batch.datasets[i],
                    ground_truth=batch.ground_truths[i],
                    request_info=_get_request_info_for_sample(result.request_info, i),
                    logprobs=result.logprobs[i] if result.logprobs else None,
                )
            )
        )

    with open(filepath, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    logger.info(f"Saved {len(records)} rollouts to {filepath}")
