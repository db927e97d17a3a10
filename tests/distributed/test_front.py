"""The front engine both a Ray client and a rank's logger hold, without Ray or torch."""

from __future__ import annotations

from typing import Any

from asynctrace import TopBottomSampler, Watch
from asynctrace._fronts.front import Front
from asynctrace._fronts.selection import WATCHED, Encoded, Part, PartSelection


def _front(selection: PartSelection) -> Front:
    return Front(
        selection,
        sampler=selection.sampler,
        redact=None,
        on_invalid="skip",
        group_keys=(),
        owner="front",
        quiet=("capped",),
    )


def _samples(prompt_id: str, rewards: list[float]) -> list[dict[str, Any]]:
    return [{"prompt": f"q{r}", "reward": r, "prompt_id": prompt_id} for r in rewards]


def test_watched_places_of_samples_not_kept_go_back() -> None:
    """Watched samples a call could not keep (past the front's bound, or the front closing) give
    their places in the step's watch budget back, so later watched samples of the step still
    pass the selection by, up to max_per_step; every sample is counted once."""
    watch = Watch(ids=["w"], max_per_step=2)
    selection = PartSelection.streaming(
        2, TopBottomSampler(), 1, max_open_steps=0, step_timeout=None, watch=watch
    )
    front = _front(selection)
    room = 0
    closing = False
    released: list[Part] = []

    def fit(encoded: list[Encoded]) -> int:
        return min(len(encoded), room)

    def admit(samples: list[dict[str, Any]]) -> int:
        return front.admit(
            samples,
            step=0,
            split="train",
            refused=lambda: "closed" if closing else None,
            fit=fit,
            release=lambda parts, now: released.extend(parts),
        )

    assert admit(_samples("w", [1.0, 2.0])) == 0  # no room: both dropped, their places back
    room = 10
    assert admit(_samples("w", [3.0, 4.0, 5.0])) == 3  # two pass by, the third is a candidate
    assert [(p.part, len(p.payloads)) for p in released] == [(WATCHED, 2)]
    closing = True
    assert admit(_samples("w", [6.0])) == 0
    tally = front.tally()
    assert tally.submitted == 6 and tally.handed_on == 0 and tally.held == 1
    assert tally.dropped == {"queue_full": 2, "closed": 1}


def test_a_rank_counts_a_step_in_transit_as_held_until_it_is_settled() -> None:
    """A rank's ended step is held while it is on its way out, then handed on or dropped, so its
    counts add up at every moment; a sample for a step ended here is "late"."""
    front = _front(PartSelection(2, TopBottomSampler(), 0))

    def add_up() -> bool:
        t = front.tally()
        return t.submitted == t.handed_on + t.held + sum(t.dropped.values())

    assert front.admit(_samples("p", [1.0, 2.0, 3.0]), step=0, split="train", refused=lambda: None) == 2
    assert front.tally().held == 2 and add_up()  # one capped
    ended = front.take_ended(0, None)
    assert [key for key, _ in ended] == [("train", 0)] and front.tally().held == 2 and add_up()
    front.settle(2, 1)
    assert front.tally().handed_on == 1 and front.tally().dropped == {"capped": 2} and add_up()
    assert front.admit(_samples("p", [4.0]), step=0, split="train", refused=lambda: None) == 0
    assert front.tally().dropped["late"] == 1 and add_up()
