# Copied from meta-pytorch/torchforge at commit 6e77f0b37596ef4d4f31924fbc46eb77d0c8043d
# (https://github.com/meta-pytorch/torchforge), file: apps/grpo/main.py.
#
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree. That license (BSD 3-Clause):
#
# Redistribution and use in source and binary forms, with or without modification, are
# permitted provided that the following conditions are met:
# 1. Redistributions of source code must retain the above copyright notice, this list of
#    conditions and the following disclaimer.
# 2. Redistributions in binary form must reproduce the above copyright notice, this list of
#    conditions and the following disclaimer in the documentation and/or other materials
#    provided with the distribution.
# 3. Neither the name of the copyright holder nor the names of its contributors may be used
#    to endorse or promote products derived from this software without specific prior
#    written permission.
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS
# OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF
# MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE
# COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL,
# EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF
# SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION)
# HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY, OR
# TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE OF THIS
# SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.
#
# torchforge's package-index release is a placeholder, so the tests run these definitions from
# its source. Upstream's text is kept unchanged (line numbers given) except where noted.
# The actors' endpoint bodies and the episode construction of continuous_rollouts are plain
# functions here (ForgeActor, endpoint and the services need monarch); marked where changed.

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tests.adapters._upstream.torchforge_completion import Completion


# apps/grpo/main.py lines 43-78
@dataclass
class Episode:
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    # Processed data
    completion: Completion | None = None
    ref_logprobs: torch.Tensor | None = None
    reward: float | None = None
    advantage: float | None = None

    @property
    def policy_version(self) -> int | None:
        return self.completion.generator_version

    @property
    def request_tensor(self) -> torch.Tensor:
        tensor: torch.Tensor = self.completion.prompt_ids.to(torch.long)
        if tensor.shape[0] < self.request_len:  # left pad
            diff = self.request_len - tensor.shape[0]
            tensor = F.pad(tensor, (diff, 0), value=self.pad_id)
        return tensor

    @property
    def response_tensor(self) -> torch.Tensor:
        tensor: torch.Tensor = self.completion.token_ids.to(torch.long)
        if tensor.shape[0] < self.response_len:  # right pad
            diff = self.response_len - tensor.shape[0]
            tensor = F.pad(tensor, (0, diff), value=self.pad_id)
        return tensor


# Represents the group (G) of episodes in GRPO
Group = list[Episode]


# RewardActor (apps/grpo/main.py lines 141-186): not a ForgeActor here, evaluate_response is a
# plain synchronous method (not an async endpoint), and its record_metric calls are left out.
@dataclass
class RewardActor:
    reward_functions: list[Callable]

    def evaluate_response(self, prompt: str, response: str, target: str) -> float:
        total_rewards = 0.0
        for reward_fn in self.reward_functions:
            reward = reward_fn(prompt, response, target)
            total_rewards += reward

        avg_reward = total_rewards / len(self.reward_functions)
        return avg_reward


# ComputeAdvantages.compute (apps/grpo/main.py lines 192-198).
def compute(group: Group) -> list[float]:
    # TODO: add batch processing
    rewards = torch.tensor([[e.reward for e in group]])
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True)
    advantages = (rewards - mean) / (std + 1e-4)
    return advantages.squeeze(0).tolist()


def rollout_group(
    responses: list[Completion],
    prompt: str,
    target: Any,
    pad_id: int,
    group_size: int,
    max_req_tokens: int,
    max_res_tokens: int,
    reward_actor: RewardActor,
) -> list[Episode]:
    """One iteration of continuous_rollouts (apps/grpo/main.py lines 376-412) after generation.

    Changed: `reward_actor.evaluate_response.route(...)` and
    `compute_advantages.compute.call_one(...)` are direct calls of the copies above; the
    reference model's logprobs and the replay buffer are left out.
    """
    episodes = []
    input_ids = torch.ones(
        (group_size, max_req_tokens + max_res_tokens),
        dtype=torch.long,
    )
    for i, response in enumerate(responses):
        episode = Episode(
            episode_id=str(uuid.uuid4()),
            pad_id=pad_id,
            request_len=max_req_tokens,
            response_len=max_res_tokens,
            target=target,
            completion=response,
        )
        episode.reward = reward_actor.evaluate_response(
            prompt=prompt, response=response.text, target=target
        )
        episodes.append(episode)

        # Build input_ids for reference logprobs
        input_ids[i, :max_req_tokens] = episode.request_tensor
        input_ids[i, max_req_tokens:] = episode.response_tensor

    advantages = compute(episodes)
    for episode, advantage in zip(episodes, advantages):
        episode.advantage = advantage
    return episodes
