"""The Ray actors OpenRLHF's and slime's hooks live in, for tests/adapters/test_ray_hooks.py.

OpenRLHF's `PPOTrainer` and slime's `RolloutManager` are Ray actors: the hooks run, and their
sessions open, in the actor's process. `OpenRLHFTrainer` and `SlimeRolloutManager` are those
actors as the tests can run them (what needs a GPU scripted, as in `_openrlhf_setup` and
`_slime_setup`); `Host` runs one of each in one Ray actor, so that the test starts two worker
processes rather than four (each imports torch, transformers and OpenRLHF). Ray workers import
this module, which imports no pytest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from asynctrace.adapters import openrlhf_adapter, slime_adapter
from asynctrace.rollouts import toy_tokenizer


class OpenRLHFTrainer:
    """OpenRLHF's `PPOTrainer` actor: built as `_openrlhf_setup.trainer` builds it, its `fit` runs
    `train_step` with docs/frameworks/openrlhf.md's lines in it, one scripted rollout per step."""

    def __init__(self, project: str, script: dict[str, Any], session_options: dict[str, Any]) -> None:
        from transformers import PreTrainedTokenizerFast

        from tests.adapters import _openrlhf_setup as setup

        self.setup = setup
        self.script = script
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=toy_tokenizer(), pad_token="<pad>")
        self.args = setup.make_args(script["n"], prompts=len(script["prompts"]), project=project)
        self.trainer = self._fresh()
        self.train_step = setup.page_hooked()["BasePPOTrainer.train_step"]
        if session_options:
            # The page's way to choose the session: in the trainer, before the first step.
            openrlhf_adapter.open_session(self.trainer, **session_options)

    def _fresh(self) -> Any:
        s = self.script
        return self.setup.trainer(self.tokenizer, self.args, s["prompts"], s["labels"], s["turns"])

    def fit(self, steps: int) -> int:
        """`PPOTrainer.fit`'s loop for `steps` steps; returns the actor's process id."""
        for global_step in range(steps):
            # The scripted engine answers each rollout once: a fresh one for each step's prompts.
            self.trainer.samples_generator = self._fresh().samples_generator
            rollout_samples, _, _, _ = self.trainer.samples_generator.generate_samples(**self.script["gen"])
            self.train_step(self.trainer, rollout_samples, global_step)
        return os.getpid()


class SlimeRolloutManager:
    """slime's `RolloutManager` actor: its `generate` makes a scripted rollout and logs it through
    slime's `log_rollout_data`, which calls the plugin docs/frameworks/slime.md's flag names."""

    def __init__(self, checkpoint: str, project: str, session_options: dict[str, Any]) -> None:
        from transformers import PreTrainedTokenizerFast

        from tests.adapters import _slime_setup as setup

        self.setup = setup
        self.args = setup.make_args(Path(checkpoint), wandb_project=project)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
        if session_options:
            # The page's way to choose the session: opened before the first rollout.
            slime_adapter.open_session(self.args, **session_options)

    def generate(self, rollout_ids: list[int]) -> int:
        """One rollout per id, each logged as slime logs it; returns the actor's process id."""
        from tests.adapters._upstream.slime_rollout_metrics import log_rollout_data

        for rollout_id in rollout_ids:
            data = self.setup.rollout(self.args, self.tokenizer)
            log_rollout_data(rollout_id, self.args, data, None, 1.0)
        return os.getpid()


class Host:
    """One Ray actor process running OpenRLHF's trainer actor and slime's rollout manager actor,
    each with its own session options (a session per spool directory)."""

    def __init__(self, openrlhf: dict[str, Any], slime: dict[str, Any]) -> None:
        self.trainer = OpenRLHFTrainer(openrlhf["project"], openrlhf["script"], openrlhf["session"])
        self.manager = SlimeRolloutManager(slime["checkpoint"], slime["project"], slime["session"])

    def run(self) -> int:
        """Two OpenRLHF steps and two slime rollouts; returns the process id."""
        self.trainer.fit(2)
        return self.manager.generate([0, 1])
