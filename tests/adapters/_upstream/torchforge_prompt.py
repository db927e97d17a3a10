# Copied from meta-pytorch/torchforge at commit 6e77f0b37596ef4d4f31924fbc46eb77d0c8043d
# (https://github.com/meta-pytorch/torchforge), file: src/forge/data_models/prompt.py.
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

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Role(Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    NONE = "none"


@dataclass
class Message:
    """A single message in a conversation."""

    chunks: Sequence[str]
    role: Role


@dataclass
class Prompt:
    """A multi-turn prompt (conversation history)."""

    # Multi-turn messages, each turn is a message.
    messages: Sequence[Message]

    @classmethod
    def from_prompt(
        cls, prompt: str, system_instruction: str | None = None
    ) -> "Prompt":
        messages = prompt_to_messages(prompt, system_instruction)
        return Prompt(
            messages=messages,
        )


def prompt_to_messages(
    prompt: str, system_instruction: str | None = None
) -> Sequence[Message]:
    """Convert a prompt to a sequence of messages."""
    messages = []
    if system_instruction is not None:
        messages.append(Message(chunks=[system_instruction], role=Role.SYSTEM))
    messages.append(
        Message(chunks=[prompt], role=Role.USER),
    )
    return messages


def to_prompt(prompt: str, system_instruction: str | None = None) -> Prompt:
    """Converts a prompt to a sequence of messages."""
    return Prompt(
        messages=prompt_to_messages(prompt, system_instruction),
    )
