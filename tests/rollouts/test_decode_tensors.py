from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any
from unittest import mock

import pytest

from asynctrace.rollouts import decode_rollouts, row_scores
from tests.rollouts._helpers import CONVERSATIONS, encode, expected_messages, pad, padded_batch

torch = pytest.importorskip("torch")


class CountingTokenizer:
    """The real tokenizer, counting how it is called (it still does all the decoding)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batch_calls: list[int] = []
        self.single_calls = 0

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        self.batch_calls.append(len(sequences))
        return list(self.inner.decode_batch(sequences, skip_special_tokens=skip_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.single_calls += 1
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_either_side_gives_back_every_turn(tokenizer: Any, side: str) -> None:
    """Right- and left-padded batches decode to the original text of every turn."""
    batch = padded_batch(tokenizer, CONVERSATIONS, side=side)
    samples = decode_rollouts(
        batch["input_ids"],
        tokenizer=tokenizer,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
    )
    assert [s.messages for s in samples] == [expected_messages(c) for c in CONVERSATIONS]


def test_tool_turns_take_env_role(tokenizer: Any) -> None:
    """Later 0-runs of the loss mask become turns of `env_role`; the first stays the user prompt."""
    batch = padded_batch(tokenizer, CONVERSATIONS[:1])
    (sample,) = decode_rollouts(
        batch["input_ids"],
        tokenizer=tokenizer,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
        env_role="user",
    )
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "user", "assistant"]
    assert sample.messages == expected_messages(CONVERSATIONS[0], env_role="user")


def test_metadata_counts_tokens_and_turns(tokenizer: Any) -> None:
    """prompt_len, response_len, seq_len and num_turns count real tokens and assistant turns."""
    batch = padded_batch(tokenizer, CONVERSATIONS, side="left")
    samples = decode_rollouts(
        batch["input_ids"],
        tokenizer=tokenizer,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
    )
    for sample, conversation in zip(samples, CONVERSATIONS, strict=True):
        ids, _ = encode(tokenizer, conversation)
        prompt_len = len(encode(tokenizer, conversation[:1])[0])
        assert sample.metadata["seq_len"] == len(ids)
        assert sample.metadata["prompt_len"] == prompt_len
        assert sample.metadata["response_len"] == len(ids) - prompt_len
        assert sample.metadata["num_turns"] == sum(role == "assistant" for role, _ in conversation)


def test_prompt_lens_without_loss_mask_give_user_and_assistant(tokenizer: Any) -> None:
    """With prompt_lens and no loss mask, each sample is one user and one assistant message."""
    conversation = CONVERSATIONS[1]
    prompt, _ = encode(tokenizer, conversation[:1])
    response, _ = encode(tokenizer, conversation[1:])
    ids = pad([prompt + response], len(prompt) + len(response) + 3)
    mask = pad([[1] * (len(prompt) + len(response))], ids.shape[1]).bool()
    (sample,) = decode_rollouts(
        ids, tokenizer=tokenizer, attention_mask=mask, prompt_lens=torch.tensor([len(prompt)])
    )
    assert sample.messages == [
        {"role": "user", "content": conversation[0][1]},
        {"role": "assistant", "content": conversation[1][1]},
    ]
    assert sample.metadata["prompt_len"] == len(prompt)
    assert sample.metadata["num_turns"] == 1


def test_prompt_lens_mark_the_prompt_when_the_response_starts_masked(tokenizer: Any) -> None:
    """prompt_lens set the prompt boundary even when the response begins with loss-mask 0 tokens."""
    prompt, _ = encode(tokenizer, [("user", "Question?")])
    header, _ = encode(tokenizer, [("tool", "<|im_start|>assistant\n")])
    answer, _ = encode(tokenizer, [("assistant", "Answer.")])
    ids = torch.tensor([prompt + header + answer])
    loss = torch.tensor([[0] * (len(prompt) + len(header)) + [1] * len(answer)])
    (sample,) = decode_rollouts(ids, tokenizer=tokenizer, loss_mask=loss, prompt_lens=[len(prompt)])
    assert sample.messages == [
        {"role": "user", "content": "Question?"},
        {"role": "tool", "content": "<|im_start|>assistant\n"},
        {"role": "assistant", "content": "Answer."},
    ]


def test_no_split_information_means_one_assistant_message(tokenizer: Any) -> None:
    """Without loss mask or prompt_lens, the whole sequence is what the policy generated."""
    ids, _ = encode(tokenizer, CONVERSATIONS[3])
    (sample,) = decode_rollouts(torch.tensor([ids]), tokenizer=tokenizer)
    assert sample.messages == [{"role": "assistant", "content": "".join(t for _, t in CONVERSATIONS[3])}]
    assert sample.metadata["prompt_len"] == 0


def test_versions_min_max_ignore_minus_one(tokenizer: Any) -> None:
    """Policy version min/max come from generated tokens only; -1 (prompt) is ignored."""
    batch = padded_batch(tokenizer, CONVERSATIONS[:2])
    versions = batch["versions"].clone()
    real = batch["loss_mask"][0] == 1
    positions = real.nonzero().flatten()
    versions[0, positions[0]] = 1
    versions[0, positions[-1]] = 9
    versions[1] = -1
    samples = decode_rollouts(
        batch["input_ids"],
        tokenizer=tokenizer,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
        versions=versions,
    )
    assert samples[0].metadata["policy_version_min"] == 1
    assert samples[0].metadata["policy_version_max"] == 9
    assert "policy_version_min" not in samples[1].metadata
    assert "policy_version_max" not in samples[1].metadata


def test_rows_select_and_order_the_samples(tokenizer: Any) -> None:
    """Samples come back in the order of `rows`, each naming its row and keeping its reward."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    rewards = torch.tensor([0.1, 0.2, 0.3, 0.4])
    samples = decode_rollouts(
        batch["input_ids"],
        tokenizer=tokenizer,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
        versions=batch["versions"],
        rewards=rewards,
        metadata={"uid": torch.tensor([10, 11, 12, 13]), "dataset": ["a", "b", "c", "d"]},
        rows=torch.tensor([3, 0, 2]),
    )
    assert [s.metadata["sample_index"] for s in samples] == [3, 0, 2]
    assert [s.messages for s in samples] == [expected_messages(CONVERSATIONS[r]) for r in (3, 0, 2)]
    assert [s.metadata["reward"] for s in samples] == pytest.approx([0.4, 0.1, 0.3])
    assert [s.metadata["uid"] for s in samples] == [13, 10, 12]
    assert [s.metadata["dataset"] for s in samples] == ["d", "a", "c"]
    assert [s.metadata["policy_version_max"] for s in samples] == [6, 3, 5]


def test_samples_rank_by_metadata_reward(tokenizer: Any) -> None:
    """Each sample leaves `score` unset and carries its reward in metadata, as samplers expect."""
    batch = padded_batch(tokenizer, CONVERSATIONS[:2])
    samples = decode_rollouts(
        batch["input_ids"], tokenizer=tokenizer, attention_mask=batch["attention_mask"], rewards=[1.5, -2]
    )
    assert [s.score for s in samples] == [None, None]
    assert [s.ranking_score() for s in samples] == [1.5, -2.0]


def test_short_optional_columns_warn_once_and_leave_fields_out(tokenizer: Any) -> None:
    """Optional per-sample columns shorter than the batch never raise IndexError: one warning."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    with pytest.warns(UserWarning) as record:
        samples = decode_rollouts(
            batch["input_ids"],
            tokenizer=tokenizer,
            attention_mask=batch["attention_mask"],
            rewards=torch.tensor([1.0, 2.0]),
            prompt_lens=[1, 1, 1],
            metadata={"dataset": ["gsm8k"], "uid": torch.tensor([7, 8, 9])},
        )
    assert len(record) == 1
    message = str(record[0].message)
    assert "rewards" in message and "prompt_lens" in message and "dataset" in message
    assert [s.metadata.get("reward") for s in samples] == [1.0, 2.0, None, None]
    assert [s.metadata.get("uid") for s in samples] == [7, 8, 9, None]
    assert [s.metadata.get("dataset") for s in samples] == ["gsm8k", None, None, None]
    # The row without a prompt length falls back to a single assistant message.
    assert [m["role"] for m in samples[3].messages] == ["assistant"]


def test_short_column_that_covers_the_selected_rows_is_silent(tokenizer: Any) -> None:
    """No warning when every selected row has its value, even if the column is short."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        samples = decode_rollouts(
            batch["input_ids"], tokenizer=tokenizer, rewards=torch.tensor([1.0, 2.0]), rows=[1]
        )
    assert samples[0].metadata["reward"] == 2.0
    with pytest.warns(UserWarning, match="rewards has 2 values for 4 samples"):
        decode_rollouts(batch["input_ids"], tokenizer=tokenizer, rewards=[1.0, 2.0], rows=[1, 3])


def test_one_tokenizer_call_for_the_whole_batch(tokenizer: Any) -> None:
    """Every turn of every sample is decoded in a single batch call, shared prompts once."""
    counting = CountingTokenizer(tokenizer)
    conversations = [CONVERSATIONS[0]] * 4 + [CONVERSATIONS[2]] * 4
    batch = padded_batch(tokenizer, conversations)
    samples = decode_rollouts(
        batch["input_ids"],
        tokenizer=counting,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
    )
    turns = sum(len(s.messages) for s in samples)
    assert counting.single_calls == 0
    assert counting.batch_calls == [turns - 6]  # 8 prompts, 2 distinct
    assert [s.messages for s in samples] == [expected_messages(c) for c in conversations]


def test_transformers_style_tokenizer_gets_exact_text_options(tokenizer: Any) -> None:
    """A `batch_decode` tokenizer is asked to keep special tokens and spaces as they are."""
    seen: dict[str, Any] = {}

    class HFStyle:
        def batch_decode(self, sequences: list[list[int]], **kwargs: Any) -> list[str]:
            seen.update(kwargs)
            return list(tokenizer.decode_batch(sequences, skip_special_tokens=False))

    batch = padded_batch(tokenizer, CONVERSATIONS[:1])
    (sample,) = decode_rollouts(
        batch["input_ids"],
        tokenizer=HFStyle(),
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
    )
    assert seen == {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    assert sample.messages == expected_messages(CONVERSATIONS[0])


def test_tokenizer_that_takes_no_options_still_works(tokenizer: Any) -> None:
    """A `batch_decode(sequences)` without keyword options is called without them."""

    class Plain:
        def batch_decode(self, sequences: list[list[int]]) -> list[str]:
            return list(tokenizer.decode_batch(sequences, skip_special_tokens=False))

    batch = padded_batch(tokenizer, CONVERSATIONS[1:2])
    (sample,) = decode_rollouts(
        batch["input_ids"],
        tokenizer=Plain(),
        loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"],
    )
    assert sample.messages == expected_messages(CONVERSATIONS[1])


def test_holes_in_the_attention_mask_keep_token_order(tokenizer: Any) -> None:
    """Padding inside a row (not one block) is dropped and the real tokens keep their order."""
    ids, mask = encode(tokenizer, CONVERSATIONS[1])
    pad_id = tokenizer.token_to_id("<pad>")
    split = 3
    row = [*ids[:split], pad_id, pad_id, *ids[split:]]
    attention = [1] * split + [0, 0] + [1] * (len(ids) - split)
    loss = [*mask[:split], 0, 0, *mask[split:]]
    (sample,) = decode_rollouts(
        torch.tensor([row]),
        tokenizer=tokenizer,
        attention_mask=torch.tensor([attention]),
        loss_mask=torch.tensor([loss]),
    )
    assert sample.messages == expected_messages(CONVERSATIONS[1])


def test_float_loss_mask_and_empty_rows(tokenizer: Any) -> None:
    """A float loss mask works; a row with no real tokens gives a sample with no messages."""
    batch = padded_batch(tokenizer, CONVERSATIONS[1:2])
    attention = torch.cat([batch["attention_mask"], torch.zeros_like(batch["attention_mask"])])
    ids = torch.cat([batch["input_ids"], batch["input_ids"]])
    loss = torch.cat([batch["loss_mask"], batch["loss_mask"]]).float()
    samples = decode_rollouts(ids, tokenizer=tokenizer, attention_mask=attention, loss_mask=loss)
    assert samples[0].messages == expected_messages(CONVERSATIONS[1])
    assert samples[1].messages == []
    assert samples[1].metadata["seq_len"] == 0


def test_empty_batch_and_empty_rows_selection(tokenizer: Any) -> None:
    """No rows in, no samples out."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    assert decode_rollouts(batch["input_ids"], tokenizer=tokenizer, rows=[]) == []
    empty = torch.zeros((0, 8), dtype=torch.long)
    assert decode_rollouts(empty, tokenizer=tokenizer, loss_mask=empty, versions=empty) == []


def test_shape_mismatches_name_the_argument(tokenizer: Any) -> None:
    """Per-token tensors that do not match input_ids are refused with the argument's name."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    ids = batch["input_ids"]
    for name in ("loss_mask", "attention_mask", "versions"):
        with pytest.raises(ValueError, match=name):
            decode_rollouts(ids, tokenizer=tokenizer, **{name: batch[name][:, :-1]})
    with pytest.raises(ValueError, match="input_ids"):
        decode_rollouts(ids[0], tokenizer=tokenizer)
    with pytest.raises(ValueError, match="loss_mask"):
        decode_rollouts(ids, tokenizer=tokenizer, loss_mask=batch["loss_mask"].tolist())
    with pytest.raises(ValueError, match="rewards"):
        decode_rollouts(ids, tokenizer=tokenizer, rewards=torch.ones(ids.shape))
    with pytest.raises(ValueError, match="env_role"):
        decode_rollouts(ids, tokenizer=tokenizer, env_role="")


def test_rows_are_bounds_checked(tokenizer: Any) -> None:
    """Rows outside the batch (or not ints) are a ValueError naming `rows`."""
    batch = padded_batch(tokenizer, CONVERSATIONS)
    for rows in ([4], [-1], [0.5]):
        with pytest.raises(ValueError, match="rows"):
            decode_rollouts(batch["input_ids"], tokenizer=tokenizer, rows=rows)  # type: ignore[arg-type]


def test_reward_column_of_shape_n_by_one(tokenizer: Any) -> None:
    """Rewards shaped [n, 1] count as one value per sample."""
    batch = padded_batch(tokenizer, CONVERSATIONS[:2])
    samples = decode_rollouts(batch["input_ids"], tokenizer=tokenizer, rewards=torch.tensor([[0.5], [1.0]]))
    assert [s.metadata["reward"] for s in samples] == [0.5, 1.0]


def test_row_scores_transfer_rewards_once() -> None:
    """row_scores gives floats per row, None where short or not finite."""
    rewards = torch.tensor([1.0, float("nan"), -0.5])
    assert row_scores(rewards, 4) == [1.0, None, -0.5, None]
    assert row_scores([2, None, math.inf], 3) == [2.0, None, None]
    assert row_scores(None, 2) == [None, None]
    assert row_scores(torch.tensor([[3.0], [4.0]]), 2) == [3.0, 4.0]


@pytest.mark.parametrize("torch_ops", [False, True], ids=["numpy-on-cpu", "torch-ops"])
def test_device_transfers_do_not_grow_with_the_batch(tokenizer: Any, torch_ops: bool) -> None:
    """`.cpu()` is called a fixed number of times per batch and `.item()` never, whatever its size."""
    from asynctrace.rollouts import _decode

    # torch_ops: what runs for tensors on an accelerator (torch ops on the device, then transfers).
    layout = (
        mock.patch.object(_decode, "_numpy_parts", return_value=None)
        if torch_ops
        else contextlib.nullcontext()
    )
    calls: dict[str, int] = {}

    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            if name in ("cpu", "item"):
                calls[name] = calls.get(name, 0) + 1
            return super().__torch_function__(func, types, args, kwargs or {})

    def transfers(n: int) -> dict[str, int]:
        batch = padded_batch(tokenizer, (CONVERSATIONS * 4)[:n])
        watched = {name: tensor.as_subclass(Watched) for name, tensor in batch.items()}
        calls.clear()
        decode_rollouts(
            watched["input_ids"],
            tokenizer=tokenizer,
            attention_mask=watched["attention_mask"],
            loss_mask=watched["loss_mask"],
            versions=watched["versions"],
            rewards=torch.arange(n, dtype=torch.float32).as_subclass(Watched),
        )
        return dict(calls)

    with layout:
        small, large = transfers(4), transfers(16)
    assert small == large
    assert "item" not in small
    assert small.get("cpu", 0) <= 6


def test_rewards_as_bools_zero_d_tensors_and_one_element_arrays(tokenizer: Any) -> None:
    """Bool rewards count as 0/1; 0-d tensors and one-element arrays in a list are numbers."""
    np = pytest.importorskip("numpy")
    ids = padded_batch(tokenizer, CONVERSATIONS[:2])["input_ids"]
    for rewards, expected in (
        (torch.tensor([True, False]), [1.0, 0.0]),
        (np.array([False, True]), [0.0, 1.0]),
        ([torch.tensor(1.5), torch.tensor(-2.0)], [1.5, -2.0]),
        ([torch.tensor([0.5]), torch.tensor([True])], [0.5, 1.0]),
        ([np.array([1.0]), np.array([2.0])], [1.0, 2.0]),
        ([np.float32(0.25), np.bool_(True)], [0.25, 1.0]),
    ):
        samples = decode_rollouts(ids, tokenizer=tokenizer, rewards=rewards)
        assert [s.metadata["reward"] for s in samples] == expected
        assert row_scores(rewards, 2) == expected
    (sample,) = decode_rollouts(ids, tokenizer=tokenizer, rewards=[np.array([math.nan]), 1.0], rows=[0])
    assert math.isnan(sample.metadata["reward"])
    assert row_scores([np.array([math.nan]), torch.tensor(1.0)], 2) == [None, 1.0]
    with pytest.raises(ValueError, match="prompt_lens: expected one number per sample, got bool"):
        decode_rollouts(ids, tokenizer=tokenizer, prompt_lens=[True, False])


@pytest.mark.parametrize("numpy_side", ["masks", "input_ids"])
def test_numpy_and_tensors_mix(tokenizer: Any, numpy_side: str) -> None:
    """A numpy input_ids with tensor masks, or the reverse, decodes like all tensors."""
    pytest.importorskip("numpy")
    batch = padded_batch(tokenizer, CONVERSATIONS, side="left")
    per_token = ("attention_mask", "loss_mask", "versions")
    args = dict(batch)
    if numpy_side == "masks":
        args.update({name: batch[name].numpy() for name in per_token})
    else:
        args["input_ids"] = batch["input_ids"].numpy()
    ids = args.pop("input_ids")
    samples = decode_rollouts(ids, tokenizer=tokenizer, rows=[2, 0], **args)
    expected = decode_rollouts(batch.pop("input_ids"), tokenizer=tokenizer, rows=[2, 0], **batch)
    assert [s.messages for s in samples] == [s.messages for s in expected]
    assert [s.metadata for s in samples] == [s.metadata for s in expected]
    assert samples[0].messages == expected_messages(CONVERSATIONS[2])
    with pytest.raises(ValueError, match="loss_mask"):
        decode_rollouts(ids, tokenizer=tokenizer, loss_mask=args["loss_mask"][:, :-1])


@pytest.mark.parametrize("kind", ["tensor", "list"])
def test_prompt_lens_with_an_empty_response_keep_the_assistant_message(tokenizer: Any, kind: str) -> None:
    """With prompt_lens and no loss mask, a 0-token response is an empty assistant message."""
    prompt, _ = encode(tokenizer, CONVERSATIONS[1][:1])
    full, _ = encode(tokenizer, CONVERSATIONS[1])
    rows = [prompt, full]
    ids: Any = pad(rows, len(full)) if kind == "tensor" else rows
    mask: Any = pad([[1] * len(r) for r in rows], len(full)) if kind == "tensor" else None
    empty, answered = decode_rollouts(
        ids, tokenizer=tokenizer, attention_mask=mask, prompt_lens=[len(prompt), len(prompt)]
    )
    assert empty.messages == [
        {"role": "user", "content": CONVERSATIONS[1][0][1]},
        {"role": "assistant", "content": ""},
    ]
    assert empty.metadata["response_len"] == 0
    assert empty.metadata["num_turns"] == 1
    assert answered.messages == expected_messages(CONVERSATIONS[1])
    # A row with no tokens at all still has no messages.
    (nothing,) = decode_rollouts([[]], tokenizer=tokenizer, prompt_lens=[3])
    assert nothing.messages == []


def test_padding_needs_the_attention_mask_and_prompt_lens_count_real_tokens(tokenizer: Any) -> None:
    """Pads are only dropped by attention_mask; verl-style prompt_lens are the real prompt tokens."""
    conversation = CONVERSATIONS[1]
    prompt, _ = encode(tokenizer, conversation[:1])
    response, _ = encode(tokenizer, conversation[1:])
    pad_id = tokenizer.token_to_id("<pad>")
    width = len(prompt) + 2
    # Left-padded prompts, right-padded responses, concatenated: the verl layout.
    prompts = pad([prompt], width, "left", fill=pad_id)
    responses = pad([response], len(response) + 3, fill=pad_id)
    ids = torch.cat([prompts, responses], dim=1)
    real_response = pad([[1] * len(response)], len(response) + 3)
    attention = torch.cat([pad([[1] * len(prompt)], width, "left"), real_response], dim=1)
    (sample,) = decode_rollouts(
        ids, tokenizer=tokenizer, attention_mask=attention, prompt_lens=attention[:, :width].sum(dim=1)
    )
    assert sample.messages == expected_messages(conversation)
    assert sample.metadata["seq_len"] == len(prompt) + len(response)
    # Without the attention mask, the right padding of a loss mask becomes a turn of pads.
    loss = torch.cat([torch.zeros_like(prompts), real_response], dim=1)
    (padded,) = decode_rollouts(ids[:, width - len(prompt) :], tokenizer=tokenizer, loss_mask=loss[:, 2:])
    assert padded.messages[-1] == {"role": "tool", "content": "<pad>" * 3}
    assert padded.metadata["seq_len"] == len(prompt) + len(response) + 3


def test_a_prompt_with_no_generated_tokens_gets_an_empty_assistant_turn(tokenizer: Any) -> None:
    """A row whose loss mask is all 0 (nothing generated) is its prompt and an empty answer."""
    prompt, _ = encode(tokenizer, CONVERSATIONS[1][:1])
    full, loss = encode(tokenizer, CONVERSATIONS[1])
    width = len(full)
    ids = pad([prompt, full], width)
    attention = pad([[1] * len(prompt), [1] * len(full)], width)
    losses = pad([[0] * len(prompt), loss], width)
    empty, answered = decode_rollouts(ids, tokenizer=tokenizer, attention_mask=attention, loss_mask=losses)
    assert empty.messages == [
        {"role": "user", "content": CONVERSATIONS[1][0][1]},
        {"role": "assistant", "content": ""},
    ]
    assert empty.metadata["num_turns"] == 1 and empty.metadata["response_len"] == 0
    assert answered.messages == expected_messages(CONVERSATIONS[1])
