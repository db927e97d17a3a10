"""OpenRLHF 0.11.2's own rollout-to-batch code, importable and runnable on a CPU.

OpenRLHF imports three GPU-only packages at module level: vLLM (`samples_generator`,
`vllm_engine`), flash-attn (`models/ring_attn_utils`) and DeepSpeed (`models/utils`,
`utils/deepspeed`). None of the code run here calls them: placeholder modules stand in for
them while OpenRLHF's modules are imported, then leave `sys.modules` again (other tests look
those packages up), as OpenRLHF's own CPU tests do. Ray actors are called in process: each
module's `ray` is swapped for `InProcessRay`, which OpenRLHF's own tests do too.

What is faked is what needs a GPU: the vLLM engine's token generation (`FakeLLM`, scripted
per prompt) and the actor model's forward (`ActorGroup`). Everything between them is
OpenRLHF's: `SamplesGenerator`, the real `RolloutRayActor.generate_responses`/`generate`,
`MultiTurnAgentExecutor`, `_process_response_into_experience`, `RemoteExperienceMaker`
(`split_rollout_samples`, `make_experience`, `compute_advantages_and_returns`) and
`BasePPOTrainer.train_step` / `PPOTrainer.evaluate`.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from types import SimpleNamespace as NS
from typing import Any

import torch


class SamplingParams:
    """vLLM's SamplingParams as OpenRLHF uses it: attributes set, read and deep-copied."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def _placeholder(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    # A spec, so that `importlib.util.find_spec` (transformers probes DeepSpeed) does not fail.
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


_PLACEHOLDERS = {
    "vllm": {"SamplingParams": SamplingParams, "__version__": "0.29.0"},
    "vllm.inputs": {"TokensPrompt": dict},
    "vllm.utils": {"random_uuid": lambda: "request"},
    "flash_attn": {},
    "flash_attn.bert_padding": dict.fromkeys(("index_first_axis", "pad_input", "rearrange", "unpad_input")),
    "flash_attn.utils": {},
    "flash_attn.utils.distributed": {"all_gather": None},
    "deepspeed": {},
    "deepspeed.runtime": {},
    "deepspeed.runtime.zero": {},
    "deepspeed.runtime.zero.partition_parameters": {"ZeroParamStatus": None},
}


def _import_openrlhf() -> NS:
    missing = [name for name in _PLACEHOLDERS if name not in sys.modules]
    for name in missing:
        sys.modules[name] = _placeholder(name, **_PLACEHOLDERS[name])
    try:
        from openrlhf.trainer import ppo_trainer
        from openrlhf.trainer.ppo_utils import experience, experience_maker, samples_generator
        from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
        from openrlhf.trainer.ray import vllm_engine
        from openrlhf.utils import agent
    finally:
        for name in missing:
            sys.modules.pop(name, None)
    for module in (samples_generator, experience_maker, ppo_trainer, vllm_engine):
        module.ray = InProcessRay  # type: ignore[attr-defined]
    return NS(
        ppo_trainer=ppo_trainer,
        experience=experience,
        experience_maker=experience_maker,
        samples_generator=samples_generator,
        vllm_engine=vllm_engine,
        agent=agent,
        FixedKLController=FixedKLController,
    )


class InProcessRay:
    """`ray.get`/`put`/`wait` for actors called in this process (their results are plain values)."""

    @staticmethod
    def get(value: Any) -> Any:
        return value

    @staticmethod
    def put(value: Any) -> Any:
        return value

    @staticmethod
    def wait(
        refs: list[Any], num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        return refs[:num_returns], refs[num_returns:]


openrlhf = _import_openrlhf()
RolloutRayActor = openrlhf.vllm_engine.RolloutRayActor.__ray_metadata__.modified_class
PPOTrainer = openrlhf.ppo_trainer.PPOTrainer.__ray_metadata__.modified_class

TOOL = "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
"""What the tool answers a `<tool_call>`: the environment feedback between two turns."""


def logprob_of(position: int) -> float:
    """The log-prob the fake engine reports for the response token at `position`."""
    return -0.01 * (position + 1)


class FakeLLM:
    """vLLM's AsyncLLMEngine.generate, scripted: `script[p][k]` are the turns of rollout k of prompt p.

    The first turn of each rollout is handed out in call order (the agent executor starts the
    `n` rollouts of a prompt in order); later turns are found by the conversation so far.
    """

    def __init__(
        self, tokenizer: Any, prompts: Sequence[str], script: Sequence[Sequence[Sequence[str]]]
    ) -> None:
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.script = script
        self.started: dict[int, int] = {}

    def _next_turn(self, text: str) -> str:
        matches = [i for i, prompt in enumerate(self.prompts) if text.startswith(prompt)]
        assert matches, f"no prompt starts {text!r}"
        p = matches[0]
        turn = text.count(TOOL)
        if turn == 0:
            k = self.started.get(p, 0)
            self.started[p] = k + 1
            return self.script[p][k][0]
        for turns in self.script[p]:
            if text == self.prompts[p] + TOOL.join(turns[:turn]) + TOOL:
                return turns[turn]
        raise AssertionError(f"no scripted turn follows {text!r}")

    async def generate(self, prompt: dict[str, Any], sampling_params: Any, request_id: str) -> Any:
        text = self.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)
        answer = self._next_turn(text)
        ids = self.tokenizer(text=answer, add_special_tokens=False)["input_ids"]
        logprobs = (
            [{t: NS(logprob=logprob_of(i))} for i, t in enumerate(ids)] if sampling_params.logprobs else None
        )
        output = NS(token_ids=ids, text=answer, finish_reason="stop", logprobs=logprobs)
        yield NS(outputs=[output])


class ToolAgent(openrlhf.agent.AgentInstanceBase):
    """An environment: a `<tool_call>` gets the tool's output, any other answer ends the episode,
    rewarded 1 when it contains the label."""

    def __init__(self) -> None:
        self.turns = 0

    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        self.turns += 1
        if "<tool_call>" in states["action_text"]:
            return {"rewards": torch.tensor(0.0), "environment_feedback": TOOL, "done": False}
        reward = 1.0 if states["label"] in states["action_text"] else 0.0
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "",
            "done": True,
            "extra_logs": {"turns": self.turns},
        }


def _sent(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v if k == "hf_tokenizer" else copy.deepcopy(v) for k, v in kwargs.items()}


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


class EngineHandle:
    """The Ray handle of one `RolloutRayActor`, calling the real actor class in this process.

    Arguments are copied as Ray's serialisation copies them: the executors change the
    `SamplingParams` they are given, which each remote call gets its own copy of.
    """

    def __init__(self, actor: Any) -> None:
        self.generate_responses = _Method(lambda **kw: asyncio.run(actor.generate_responses(**_sent(kw))))
        self.get_num_unfinished_requests = _Method(lambda: 0)


class ActorGroup:
    """The actor model's Ray group: its forward gives each action token log-prob -0.5; fit reports a loss."""

    def __init__(self) -> None:
        self.appended: list[Any] = []

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list[Any]:
        if method_name == "forward":
            return [[-0.5 * mask.float() for mask in kwargs["action_mask"]]]
        self.appended.append(kwargs["experience"])
        return []

    def async_run_method(self, method_name: str, **kwargs: Any) -> list[Any]:
        return [{"policy_loss": 0.25}]


def make_args(
    n: int,
    *,
    prompts: int,
    micro_batch_size: int = 4,
    dynamic_batch: bool = False,
    project: str = "openrlhf-test",
) -> NS:
    """The parts of OpenRLHF's nested arguments the exercised code reads (train_ppo_ray's defaults)."""
    return NS(
        rollout=NS(
            batch_size=prompts,
            n_samples_per_prompt=n,
            micro_batch_size=micro_batch_size,
            vllm_generate_batch_size=None,
            max_tokens_per_gpu=64,
        ),
        vllm=NS(enable_sleep=False),
        algo=NS(
            dynamic_filtering_enable=False,
            advantage=NS(
                estimator="group_norm", is_correction_level="token", gamma=1.0, lambd=1.0, no_std_norm=False
            ),
            kl=NS(use_loss=False, estimator="k1", init_coef=0.0, target=None),
        ),
        train=NS(
            dynamic_batch_enable=dynamic_batch,
            async_enable=False,
            colocate_all=False,
            colocate_actor_ref=False,
            colocate_critic_reward=False,
        ),
        ds=NS(ring_attn_size=1, tensor_parallel_size=1, enable_sleep=False),
        actor=NS(num_nodes=1, num_gpus_per_node=2),
        critic=NS(freezing_steps=-1),
        reward=NS(clip_range=(-10.0, 10.0)),
        logger=NS(
            wandb=NS(key=None, project=project, run_name="grpo/tool"), tensorboard_dir=None, logging_steps=1
        ),
        eval=NS(steps=-1),
        ckpt=NS(best_metric_key=""),
    )


def rollout_actor(
    hf_tokenizer: Any, prompts: Sequence[str], script: Sequence[Sequence[Sequence[str]]]
) -> Any:
    """The real `RolloutRayActor` with OpenRLHF's `MultiTurnAgentExecutor` and a scripted engine."""
    actor = object.__new__(RolloutRayActor)
    actor.executor = openrlhf.agent.MultiTurnAgentExecutor(ToolAgent)
    actor.llm = FakeLLM(hf_tokenizer, prompts, script)
    actor._mm_pad_token_ids = None
    return actor


def trainer(
    hf_tokenizer: Any,
    args: NS,
    prompts: Sequence[str],
    labels: Sequence[str],
    script: Sequence[Sequence[Sequence[str]]],
    *,
    eval_batches: list[Any] | None = None,
) -> Any:
    """A `PPOTrainer` as its `__init__` wires it, minus the datasets and the tokenizer download."""
    strategy = NS(args=args)
    engine = EngineHandle(rollout_actor(hf_tokenizer, prompts, script))
    batches = [(["data"], [p], [label], [None]) for p, label in zip(prompts, labels, strict=True)]
    self = object.__new__(PPOTrainer)
    self.samples_generator = openrlhf.samples_generator.SamplesGenerator(
        strategy=strategy,
        prompts_dataloader=batches,
        eval_dataloader=eval_batches,
        tokenizer=hf_tokenizer,
        vllm_engines=[engine],
    )
    self.eval_dataloader = eval_batches
    openrlhf.ppo_trainer.BasePPOTrainer.__init__(
        self, strategy, ActorGroup(), None, None, None, None, hf_tokenizer
    )
    return self


def page_hooked() -> dict[str, Any]:
    """OpenRLHF's `train_step` and `evaluate` with docs/frameworks/openrlhf.md's lines in them, as
    the edited file has them, by `Class.function`."""
    from tests.adapters._snippets import code_block, hook_lines, patched

    imports, insertions = hook_lines(code_block("openrlhf.md"))
    functions = {
        "BasePPOTrainer.train_step": openrlhf.ppo_trainer.BasePPOTrainer.train_step,
        "PPOTrainer.evaluate": PPOTrainer.evaluate,
    }
    assert [i.function for i in insertions] == list(functions)
    return {i.function: patched(functions[i.function], i, imports) for i in insertions}
