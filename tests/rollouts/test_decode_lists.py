from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from asynctrace.rollouts import decode_rollouts
from tests.rollouts._helpers import CONVERSATIONS, encode, expected_messages


def test_ragged_lists_give_back_every_turn(tokenizer: Any) -> None:
    """Plain lists of different lengths need no padding and decode to every turn's text."""
    encoded = [encode(tokenizer, c) for c in CONVERSATIONS]
    samples = decode_rollouts(
        [ids for ids, _ in encoded], tokenizer=tokenizer, loss_mask=[mask for _, mask in encoded]
    )
    assert [s.messages for s in samples] == [expected_messages(c) for c in CONVERSATIONS]
    assert [s.metadata["seq_len"] for s in samples] == [len(ids) for ids, _ in encoded]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_lists_with_attention_mask(tokenizer: Any, side: str) -> None:
    """Padded lists with an attention mask decode like their tensor twins."""
    encoded = [encode(tokenizer, c) for c in CONVERSATIONS]
    width = max(len(ids) for ids, _ in encoded) + 2

    def padded(row: list[int], fill: int) -> list[int]:
        extra = [fill] * (width - len(row))
        return row + extra if side == "right" else extra + row

    samples = decode_rollouts(
        [padded(ids, 0) for ids, _ in encoded],
        tokenizer=tokenizer,
        attention_mask=[padded([1] * len(ids), 0) for ids, _ in encoded],
        loss_mask=[padded(mask, 0) for _, mask in encoded],
        versions=[padded([5 if m else -1 for m in mask], -1) for _, mask in encoded],
        rewards=[0.0, 1.0, 0.5, 0.25],
    )
    assert [s.messages for s in samples] == [expected_messages(c) for c in CONVERSATIONS]
    assert {s.metadata["policy_version_min"] for s in samples} == {5}
    assert [s.metadata["reward"] for s in samples] == [0.0, 1.0, 0.5, 0.25]


def test_numpy_arrays_are_accepted(tokenizer: Any) -> None:
    """numpy arrays are read as lists."""
    np = pytest.importorskip("numpy")
    ids, mask = encode(tokenizer, CONVERSATIONS[1])
    (sample,) = decode_rollouts(
        np.array([ids]), tokenizer=tokenizer, loss_mask=np.array([mask]), rewards=np.array([0.5])
    )
    assert sample.messages == expected_messages(CONVERSATIONS[1])
    assert sample.metadata["reward"] == 0.5


def test_rows_order_and_short_columns_on_lists(tokenizer: Any) -> None:
    """`rows` orders the samples; short columns warn once and leave the field out."""
    encoded = [encode(tokenizer, c) for c in CONVERSATIONS]
    with pytest.warns(UserWarning) as record:
        samples = decode_rollouts(
            [ids for ids, _ in encoded],
            tokenizer=tokenizer,
            loss_mask=[mask for _, mask in encoded],
            rewards=[1.0, 2.0],
            metadata={"uid": ["a", "b", "c"], "dataset": "gsm8k"},
            rows=[2, 1, 3],
        )
    assert len(record) == 1
    assert [s.metadata["sample_index"] for s in samples] == [2, 1, 3]
    assert [s.metadata.get("reward") for s in samples] == [None, 2.0, None]
    assert [s.metadata.get("uid") for s in samples] == ["c", "b", None]
    assert {s.metadata["dataset"] for s in samples} == {"gsm8k"}


def test_list_rows_that_do_not_match_name_the_argument(tokenizer: Any) -> None:
    """A loss mask row of the wrong length, or a missing row, is a ValueError naming it."""
    ids, mask = encode(tokenizer, CONVERSATIONS[1])
    with pytest.raises(ValueError, match="loss_mask: row 0"):
        decode_rollouts([ids], tokenizer=tokenizer, loss_mask=[mask[:-1]])
    with pytest.raises(ValueError, match="attention_mask: has 2 rows"):
        decode_rollouts([ids], tokenizer=tokenizer, attention_mask=[[1] * len(ids)] * 2)
    with pytest.raises(ValueError, match="input_ids"):
        decode_rollouts("not tokens", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="prompt_lens"):
        decode_rollouts([ids], tokenizer=tokenizer, prompt_lens=["three"])


def test_plain_lists_never_import_torch() -> None:
    """Decoding lists works without torch being imported at all."""
    code = textwrap.dedent(
        """
        import sys
        from asynctrace.rollouts import decode_rollouts, merge_step_wise, prompt_indices, toy_tokenizer
        tok = toy_tokenizer()
        ids = tok.encode("hello there").ids
        out = decode_rollouts([ids], tokenizer=tok, loss_mask=[[0] + [1] * (len(ids) - 1)], rewards=[1.0])
        assert out[0].messages[0]["role"] == "user", out
        merge_step_wise([[1]], [[2]])
        prompt_indices(n_prompts=1, n_samples=2)
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_tokenizer_with_only_decode_is_called_per_sequence(tokenizer: Any) -> None:
    """A tokenizer offering only `decode` still works, one call per sequence, special tokens kept."""

    class DecodeOnly:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    ids, mask = encode(tokenizer, CONVERSATIONS[0])
    (sample,) = decode_rollouts([ids], tokenizer=DecodeOnly(), loss_mask=[mask])
    assert sample.messages == expected_messages(CONVERSATIONS[0])
    with pytest.raises(TypeError, match="tokenizer"):
        decode_rollouts([ids], tokenizer=object())
