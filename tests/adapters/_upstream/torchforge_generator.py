# Copied from meta-pytorch/torchforge at commit 6e77f0b37596ef4d4f31924fbc46eb77d0c8043d
# (https://github.com/meta-pytorch/torchforge), file: src/forge/actors/generator.py (Generator._to_completions, Generator._extract_logprobs).
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
# The two methods are module-level functions here (taking the Generator as self), as the
# Generator actor needs vLLM and monarch; the request_output they read is vLLM's RequestOutput.

from __future__ import annotations

from typing import Any

import torch

from tests.adapters._upstream.torchforge_completion import Completion
from tests.adapters._upstream.torchforge_prompt import to_prompt

RequestOutput = CompletionOutput = Any


# src/forge/actors/generator.py lines 531-561
def _to_completions(self, request_output: RequestOutput) -> list[Completion]:
    """Convert a vLLM RequestOutput to a list of Completion objects."""
    completions = []
    original_prompt = request_output.prompt
    prompt_token_ids = request_output.prompt_token_ids
    for output in request_output.outputs:
        completions.append(
            Completion(
                # TODO: the to_prompt encoding will be different from the original.
                # This is okay for now, since I don't see any direct usage of prompt using completion object.
                prompt=to_prompt(original_prompt),
                stop_reason=output.finish_reason,
                text=output.text,
                prompt_ids=torch.tensor(prompt_token_ids),
                token_ids=torch.tensor(output.token_ids),
                logprobs=self._extract_logprobs(output),
                generator_version=self.generator_version,
                metadata={"num_cached_tokens": request_output.num_cached_tokens},
            )
        )
    return completions

def _extract_logprobs(self, sample: CompletionOutput) -> torch.Tensor | None:
    if sample.logprobs is not None:
        return torch.tensor(
            [
                top_k_dict[token].logprob
                for token, top_k_dict in zip(sample.token_ids, sample.logprobs)
            ]
        )
    return None
