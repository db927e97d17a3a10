# Copied verbatim from allenai/open-instruct at commit e6c3044aa6201c8bfa4573c1b03142af599e730d
# (https://github.com/allenai/open-instruct), file(s): open_instruct/data_types.py.
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
# (line numbers given). Left out: ShutdownSentinel and the classes after GenerationResult (torch-only).

from dataclasses import dataclass, field
from typing import Any


# open_instruct/data_types.py lines 12-61
@dataclass
class TokenStatistics:
    """Container for token statistics from inference."""

    num_prompt_tokens: int
    num_response_tokens: int
    generation_time: float
    earliest_start_time: float | None = None


@dataclass
class ToolCallStats:
    """Statistics for a single tool call."""

    tool_name: str
    success: bool
    runtime: float


@dataclass
class RequestInfo:
    """Container for tool usage information used in queue payloads."""

    num_calls: list[int]
    timeouts: list[int]
    tool_errors: list[str]
    tool_outputs: list[str]
    tool_runtimes: list[float]
    tool_calleds: list[bool]
    tool_call_stats: list[list[ToolCallStats]] = field(default_factory=list)
    rollout_states: list[dict] = field(default_factory=list)
    """Per-sample rollout state dicts (rewards, step_count, done, info) — always present."""


@dataclass
class GenerationResult:
    """Container for generation results returned via Ray queues."""

    responses: list[list[int]]
    finish_reasons: list[str]
    masks: list[list[int]]
    request_info: RequestInfo
    index: int | None
    prompt_id: str | None
    token_statistics: TokenStatistics | None = None
    start_time: float = 0.0
    logprobs: list[list[float]] = field(default_factory=list)
    reward_scores: list[float] | None = None
    reward_metrics: dict[str, Any] | None = None
    model_step: int = 0
