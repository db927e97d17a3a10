"""TRL 1.16.0 on its own code: a real GRPOTrainer on CPU, logged through `trl_adapter.attach`.

The trainer is TRL's `GRPOTrainer` with a randomly initialised tiny Qwen2 and a tokenizer built
in-process (`_trl_setup.py`); the truth the traces are compared with is what TRL handed the
reward functions, what they returned, and the advantages and mean reward TRL computed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trl

import asynctrace as at
from asynctrace.adapters import trl_adapter
from asynctrace.adapters.trl_adapter import attach
from tests._util import as_logged, read_traces
from tests.adapters._trl_setup import (
    WEIGHTS,
    Recorder,
    build_trainer,
    conversations,
    expected_rows,
    hf_tokenizer,
    nanmean,
    tiny_model,
)
from tests.adapters.conftest import moved

# `import trl` is light; its trainer (transformers' models, accelerate, datasets: seconds) is
# imported where a test builds or patches one, not when the module is collected.
if TYPE_CHECKING:
    from trl import GRPOTrainer

ROOT = Path(__file__).resolve().parents[2]

assert trl.__version__ == "1.16.0", f"these tests pin TRL 1.16.0, found {trl.__version__}"


def _key(trace: dict[str, Any]) -> tuple[str, int, int]:
    meta = trace["metadata"]
    return trace["key"].split("/")[0], meta["batch_index"], meta["sample_index"]


def _as_expected(trace: dict[str, Any]) -> dict[str, Any]:
    return {
        "split": trace["key"].split("/")[0],
        "step": trace["step"],
        "messages": trace["messages"],
        "metadata": as_logged(trace["metadata"]),
    }


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    return {(r["split"], r["metadata"]["batch_index"], r["metadata"]["sample_index"]): r for r in rows}


@dataclass
class Trained:
    trainer: GRPOTrainer
    tracer: trl_adapter.GRPOTracer
    recorder: Recorder
    project: str
    run: str
    traces: list[dict[str, Any]]
    expected: list[dict[str, Any]]
    after_train: at.SessionStats
    closed_after_train: bool
    eval_after: list[dict[str, Any]]
    batches_in_training: int


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """4 steps of GRPO (num_iterations=2, logging_steps=2, eval every 2 steps), then one more
    `evaluate()` after training, all through the documented integration."""
    project, run = f"t-{uuid.uuid4().hex[:10]}", "grpo-run"
    recorder = Recorder()
    trainer = build_trainer(str(tmp_path_factory.mktemp("grpo")), project, run, recorder)
    tracer = attach(trainer)  # the integration: project and run come from the training arguments
    recorder.spy(trainer)
    trainer.train()
    session = tracer.session
    assert isinstance(session, at.SyncTraceSession)
    closed = not session.is_open
    after_train = session.stats()
    traces = read_traces(project, run)
    n_train = len(recorder.batches)
    trainer.evaluate()
    tracer.finish()
    eval_after = [t for t in read_traces(project, run) if t["id"] not in {u["id"] for u in traces}]
    return Trained(
        trainer,
        tracer,
        recorder,
        project,
        run,
        traces,
        expected_rows([recorder.batches[:n_train]]),
        after_train,
        closed,
        eval_after,
        n_train,
    )


def test_each_generated_batch_is_logged_once(trained: Trained) -> None:
    """With num_iterations=2, logging_steps=2 and eval passes, every batch TRL generated is
    logged exactly once, with TRL's split and the global step it was generated at."""
    splits = Counter(b["split"] for b in trained.recorder.batches[: trained.batches_in_training])
    assert splits == {"train": 2, "eval": 4}
    keys = [_key(t) for t in trained.traces]
    assert len(keys) == len(set(keys)) == len(trained.expected) == 24
    assert Counter((k[0], t["step"]) for k, t in zip(keys, trained.traces, strict=True)) == {
        ("train", 0): 4,
        ("train", 2): 4,
        ("eval", 2): 8,
        ("eval", 4): 8,
    }
    assert trained.after_train.written == 24 and trained.after_train.check()


def test_traces_equal_what_trl_computed(trained: Trained) -> None:
    """Messages, per-function rewards, the weighted reward, advantages, groups and log_extra
    columns of every trace are what TRL and the reward functions computed for that row."""
    got = _by_key([_as_expected(t) for t in trained.traces])
    want = {
        k: {f: r[f] for f in ("split", "step", "messages", "metadata")}
        for k, r in _by_key(trained.expected).items()
    }
    assert got == want
    weights = trained.trainer.reward_weights.tolist()
    assert weights == list(WEIGHTS)


def test_unscorable_rows_have_no_reward_and_the_mean_is_trls(trained: Trained) -> None:
    """A row every reward function returned None for has reward None (TRL: NaN, left out),
    and the mean reward of each logged batch is the one TRL logged."""
    unscorable = [
        t for t in trained.traces if t["metadata"]["reward_breakdown"] == {"length": None, "keyword": None}
    ]
    assert len(unscorable) == 6 and all(t["metadata"]["reward"] is None for t in unscorable)
    assert all(t["metadata"]["advantage"] == 0.0 for t in unscorable)  # TRL's nan_to_num
    batches: dict[tuple[str, int], list[float | None]] = {}
    for t in trained.traces:
        batches.setdefault(_key(t)[:2], []).append(t["metadata"]["reward"])
    means = {(r["split"], r["metadata"]["batch_index"]): r["reward_mean"] for r in trained.expected}
    for key, rewards in batches.items():
        assert nanmean(rewards) == pytest.approx(means[key], rel=1e-6)


def test_top_bottom_never_ranks_an_unscorable_row(trained: Trained, project: str) -> None:
    """TRL's own columns for its last batch, kept top/bottom: an unscorable row is neither the
    best nor the worst completion."""
    logs = trained.trainer._logs
    samples = trl_adapter.to_samples(
        logs["prompt"],
        logs["completion"],
        rewards=logs["rewards"],
        advantages=logs["advantages"],
        num_generations=trained.trainer.num_generations_eval,
        reward_weights=trained.trainer.reward_weights,
    )
    assert any(s.metadata["reward"] is None for s in samples)
    with at.TraceSession(
        project, run="r", max_traces_per_step=2, sampler="top_bottom", on_invalid="skip"
    ) as s:
        s.log_samples(samples, step=0)
    kept = [t["metadata"]["reward"] for t in read_traces(project, "r")]
    scored = sorted(m.metadata["reward"] for m in samples if m.metadata["reward"] is not None)
    assert sorted(kept) == [scored[0], scored[-1]]


def test_the_run_is_named_after_run_name_with_the_config_and_finished(trained: Trained) -> None:
    """The session's project and run are the training arguments' project and run_name, the
    run's config is the training arguments, and training's end finished the session."""
    from trackio.sqlite_storage import SQLiteStorage

    session = trained.tracer.session
    assert session is not None and (session.project, session.run) == (trained.project, "grpo-run")
    assert trained.closed_after_train and trained.after_train.pending == 0
    config = SQLiteStorage.get_run_config(trained.project, "grpo-run")
    assert config is not None
    assert config["num_iterations"] == 2 and config["reward_weights"] == list(WEIGHTS)
    assert config["run_name"] == "grpo-run"


def test_evaluate_after_training_logs_to_the_same_run(trained: Trained) -> None:
    """`trainer.evaluate()` after `train()` (whose end finished the session) is still logged,
    to the same run, as eval rows of the final step."""
    assert len(trained.eval_after) == 8
    assert {(t["key"], t["step"]) for t in trained.eval_after} == {("eval/traces", 4)}
    assert trained.tracer.batches == {"train": 2, "eval": 6}  # evaluate() runs 2 batches of 4 rows


def test_attach_refuses_what_it_cannot_trace(trained: Trained) -> None:
    """Attaching twice, or to something that is not a GRPOTrainer, is refused before training."""
    with pytest.raises(ValueError, match="already attached"):
        attach(trained.trainer)
    with pytest.raises(TypeError, match="GRPOTrainer"):
        attach(object())


def test_a_moved_hook_point_is_named_and_the_trainer_left_as_it_is(
    tmp_path: Path, project: str, monkeypatch: pytest.MonkeyPatch, hook_warnings: list[str]
) -> None:
    """A GRPOTrainer whose TRL renamed the method attach wraps, or laid out `_logs` without a
    column it reads: attach says so once, naming TRL 1.16.0 and what is missing, opens no
    session and leaves the trainer untouched; nothing raises."""
    from trl import GRPOTrainer

    trainer = build_trainer(str(tmp_path), project, "r", Recorder())
    callbacks = list(trainer.callback_handler.callbacks)
    method = GRPOTrainer._generate_and_score_completions
    monkeypatch.delattr(GRPOTrainer, "_generate_and_score_completions")
    monkeypatch.setattr(GRPOTrainer, "_generate_score_and_gather", method, raising=False)
    tracer = attach(trainer)
    assert tracer.session is None and tracer.batches == {"train": 0, "eval": 0}
    assert not hasattr(trainer, "_asynctrace_tracer") and trainer.callback_handler.callbacks == callbacks
    moved(hook_warnings, "trl_adapter.attach", "TRL 1.16.0", "GRPOTrainer._generate_and_score_completions")
    monkeypatch.undo()
    del trainer._logs["rewards"]
    assert attach(trainer).session is None
    assert sum("GRPOTrainer._logs has no 'rewards'" in m for m in hook_warnings) == 1
    assert read_traces(project, "r") == []


def test_logs_it_cannot_read_never_stop_training(
    tmp_path: Path, project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A session already finished, then a trainer whose logs are not laid out as in TRL 1.16:
    evaluation runs to the end and nothing raises; the rows are counted, with a warning."""
    caplog.set_level(logging.WARNING, logger="asynctrace")
    sink = at.testing.MemorySink()
    with at.TraceSession(project, run="r", sinks=[sink]) as session:
        pass
    trainer = build_trainer(str(tmp_path), project, "r", Recorder())
    tracer = attach(trainer, session=session)
    metrics = trainer.evaluate()  # logged to a finished session: counted "closed"
    assert "eval_reward" in metrics
    assert session.stats().dropped.get("closed") == 8 and session.stats().check()
    trainer._logs["rewards"] = dict(trainer._logs["rewards"])  # not the defaultdict TRL 1.16 keeps
    assert "eval_reward" in trainer.evaluate()
    assert any("cannot read GRPOTrainer._logs" in r.getMessage() for r in caplog.records)
    assert session.stats().dropped.get("invalid") == 8 and session.stats().check()
    assert tracer.batches["eval"] == 2  # the second evaluate() was not read


@pytest.mark.timeout(300)  # about 20 s on 2 idle cores; room for a loaded machine
def test_rows_follow_trl_on_two_processes(tmp_path: Path) -> None:
    """Under torchrun with 2 processes (gloo, CPU): every batch is written once, by the main
    process only, gathered in TRL's order; top_bottom leaves unscorable rows out and counts
    them; the evaluation after training is finished at exit."""
    project, run = f"t-{uuid.uuid4().hex[:10]}", "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests" / "adapters" / "_trl_torchrun.py"),
        project,
        run,
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["has_session"] for r in ranks] == [True, False]
    expected = expected_rows([r["batches"] for r in ranks])
    assert len(expected) == 40  # 2 train and 3 eval batches of 2 x 4 rows
    scored = [r for r in expected if r["metadata"]["reward"] is not None]
    traces = read_traces(project, run)
    keys = [_key(t) for t in traces]
    assert len(keys) == len(set(keys)) == len(scored)
    assert _by_key([_as_expected(t) for t in traces]) == {
        k: {f: r[f] for f in ("split", "step", "messages", "metadata")} for k, r in _by_key(scored).items()
    }
    after_train = ranks[0]["after_train"]
    assert after_train["dropped"] == {"invalid": 8} and after_train["written"] == 24 and after_train["check"]
    assert ranks[0]["batches_logged"] == {"train": 2, "eval": 3}


def _reporting_to_trackio(tmp_path: Path, project: str, run: str) -> GRPOTrainer:
    """One step of GRPO with `report_to="trackio"`: TRL opens its own Trackio run too."""
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = hf_tokenizer()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        project=project,
        run_name=run,
        use_cpu=True,
        report_to="trackio",
        disable_tqdm=True,
        save_strategy="no",
        seed=0,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=2,
        logging_steps=1,
    )
    return GRPOTrainer(
        model=tiny_model(len(tokenizer)),
        reward_funcs=[Recorder().length],
        args=args,
        train_dataset=conversations(2, "What is"),
        processing_class=tokenizer,
    )


def _traces_first(tracer: trl_adapter.GRPOTracer) -> Any:
    """A callback that writes a trace as training begins, before TRL has logged anything: the
    order in which Trackio made two runs of one name, one for TRL's metrics and one for the traces."""
    from transformers import TrainerCallback

    class TracesFirst(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            session = tracer.session
            assert isinstance(session, at.SyncTraceSession)
            session.log_samples([at.Sample(messages=[{"role": "user", "content": "first"}])], step=0)
            assert session.flush(timeout=60)

    return TracesFirst()


@pytest.mark.timeout(300)  # about 20 s on 2 idle cores
def test_trl_reporting_to_trackio_shares_one_run_every_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `report_to="trackio"`, TRL's metrics and the traces land in one Trackio run, in
    4 runs of 4, half of them with a trace written before TRL logs anything (the order that
    split the run in two before the sink joined TRL's run by id)."""
    from trackio.sqlite_storage import SQLiteStorage

    runs = []
    for k in range(4):
        project = f"t-{uuid.uuid4().hex[:10]}"
        trainer = _reporting_to_trackio(tmp_path / str(k), project, "shared")
        tracer = attach(trainer)
        if k % 2:
            trainer.add_callback(_traces_first(tracer))
        trainer.train()
        assert tracer.session is not None
        written = tracer.session.stats().written
        records = SQLiteStorage.get_run_records(project)
        names = SQLiteStorage.get_all_metrics_for_run(project, run_id=records[0]["id"])
        traces = SQLiteStorage.get_traces(project, run_id=records[0]["id"])
        runs.append((len(records), records[0]["name"], "train/reward" in names, len(traces) == written))
    capsys.readouterr()  # Trackio's console lines
    assert runs == [(1, "shared", True, True)] * 4


def test_importing_the_adapter_needs_no_transformers_and_keeps_trl() -> None:
    """`asynctrace.adapters` imports without transformers or any framework, and importing its
    TRL module does not bind the name `trl` (the user's own `import trl` stays TRL)."""
    code = (
        "import sys\n"
        "from asynctrace.adapters import *\n"
        "from asynctrace.adapters import nemo_rl_adapter, prime_rl_adapter, trl_adapter\n"
        "frameworks = {'transformers', 'trl', 'accelerate', 'verifiers', 'prime_rl', 'nemo_rl'}\n"
        "assert not frameworks & {m.split('.')[0] for m in sys.modules}\n"
        "assert 'trl' not in dir() and trl_adapter.__name__ == 'asynctrace.adapters.trl_adapter'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    from trl import GRPOTrainer

    assert trl.GRPOTrainer is GRPOTrainer


# -- the column converter -----------------------------------------------------------------


def test_an_all_nan_row_gets_no_reward() -> None:
    """A row whose every reward function returned NaN (TRL's mark for None) has reward None,
    not TRL's nansum 0.0; partly scored rows sum what was scored, weighted."""
    nan = math.nan
    samples = trl_adapter.to_samples(
        ["q", "q"],
        ["a", "b"],
        rewards={"length": [nan, 2.0], "keyword": [nan, nan]},
        reward_weights=list(WEIGHTS),
    )
    assert samples[0].metadata["reward"] is None
    assert samples[0].metadata["reward_breakdown"] == {"length": None, "keyword": None}
    assert samples[1].metadata["reward"] == 1.0


def test_conversational_completions_with_tool_turns() -> None:
    """Conversational prompts and completions (tool calls and tool results) keep every message."""
    prompt = [[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]]
    completion = [
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "name": "weather", "content": "18C, sunny"},
            {"role": "assistant", "content": "It is 18C and sunny."},
        ]
    ]
    (sample,) = trl_adapter.to_samples(prompt, completion)
    assert sample.messages == [*prompt[0], *completion[0]]
    assert sample.messages is not completion[0]


def test_converter_refuses_columns_that_disagree() -> None:
    """Prompt and completion of different lengths, broken groups, weights for other functions,
    and extra columns that would replace the adapter's keys are refused, naming the column."""
    with pytest.raises(ValueError, match="prompt: has 1 entries but completion has 2"):
        trl_adapter.to_samples(["q"], ["a", "b"])
    with pytest.raises(ValueError, match="num_generations"):
        trl_adapter.to_samples(["q"] * 3, ["a"] * 3, num_generations=2)
    with pytest.raises(ValueError, match="reward_weights"):
        trl_adapter.to_samples(["q"], ["a"], rewards={"a": [1.0], "b": [1.0]}, reward_weights=[1.0])
    with pytest.raises(ValueError, match=r"extra\['reward'\]"):
        trl_adapter.to_samples(["q"], ["a"], rewards={"a": [1.0]}, extra={"reward": [0.0]})
    with pytest.raises(ValueError, match=r"prompt\[1\]: expected a string"):
        trl_adapter.to_samples(["q", None], ["a", "b"])


@contextlib.contextmanager
def doc_snippet(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], Callable[..., None]]]:
    """What docs/frameworks/trl.md's lines find in a training script: the model (saved with its
    tokenizer, as a hub model would be named), reward functions, GRPOConfig and dataset."""
    from trl import GRPOConfig, GRPOTrainer

    tmp_path = request.getfixturevalue("tmp_path")
    tokenizer = hf_tokenizer()
    model_dir = tmp_path / "model"
    tiny_model(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    project = f"t-{uuid.uuid4().hex[:10]}"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        project=project,
        run_name="grpo-1",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=2,
    )
    names = {
        "GRPOTrainer": GRPOTrainer,
        "model": str(model_dir),
        "reward_funcs": [Recorder().length],
        "args": args,
        "dataset": conversations(2, "What is"),
    }

    def check(namespace: dict[str, Any]) -> None:
        session = namespace["trainer"]._asynctrace_tracer.session
        assert session is not None and not session.is_open
        assert len(read_traces(project, "grpo-1")) == 2

    yield names, check
