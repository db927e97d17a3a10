"""Every rollout to a Parquet archive, with per-token log-probs, and the run read back with DuckDB.

A toy GRPO-like loop: each step, 16 rollouts of a tool-use conversation, tokenized with an
in-process tokenizer, with per-token log-probs and the loss mask. `log_rollouts` decodes them
and keeps the token arrays; the `ParquetSink` archives every one of them. Then the archive
is queried: the mean reward per step, and the log-probs of the generated tokens of one
trace, found by its id (the id a tracker shows for the same trace). Runs offline on the CPU
in seconds (needs pyarrow; the queries use DuckDB when it is installed).

    python examples/parquet_sink.py [archive-directory]
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import torch

import asynctrace as at
from asynctrace.rollouts import encode_turns, toy_tokenizer

STEPS, ROLLOUTS = 3, 16


def rollout_batch(tokenizer: Any, step: int, rng: torch.Generator) -> dict[str, Any]:
    """A right-padded batch of rollouts with rewards and per-token log-probs."""
    rows, masks, rewards = [], [], []
    for i in range(ROLLOUTS):
        a, b = 10 + i, 20 + step
        right = bool(torch.rand(1, generator=rng) < 0.6)
        answer = a * b if right else a * b + 1
        turns = [
            ("user", f"<|im_start|>user\nWhat is {a} * {b}?<|im_end|>\n"),
            ("assistant", f'<tool_call>{{"code": "print({a} * {b})"}}</tool_call>'),
            ("tool", f"<|im_start|>tool\n{a * b}\n<|im_end|>\n"),
            ("assistant", f"The answer is {answer}.<|im_end|>"),
        ]
        ids, mask = encode_turns(tokenizer, turns)
        rows.append(ids)
        masks.append(mask)
        rewards.append(float(right))
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.bool)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, mask) in enumerate(zip(rows, masks, strict=True)):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = True
        loss_mask[r, : len(ids)] = torch.tensor(mask)
    # What the policy would report: a log-prob for every generated token, 0 elsewhere.
    logprobs = -torch.rand(input_ids.shape, generator=rng) * loss_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rewards": torch.tensor(rewards),
        "logprobs": logprobs,
    }


def query(archive: str) -> None:
    pattern = f"{archive}/*.parquet"
    try:
        import duckdb
    except ImportError:
        import pyarrow.parquet as pq

        table = pq.read_table(archive)
        print(f"{table.num_rows} records archived (install duckdb for the SQL queries)")
        return
    duckdb.sql(
        f"SELECT step, count(*) AS n, avg(reward) AS mean_reward FROM '{pattern}' GROUP BY step ORDER BY step"
    ).show()
    one = duckdb.sql(f"SELECT id FROM '{pattern}' ORDER BY reward DESC, id LIMIT 1").fetchall()[0]
    print(f"log-probs of the generated tokens of {one[0]}:")
    duckdb.sql(
        f"SELECT count(*) AS generated_tokens, min(lp) AS min_logprob, avg(lp) AS mean_logprob FROM "
        f"(SELECT unnest(logprobs) AS lp, unnest(loss_mask) AS m FROM '{pattern}' WHERE id = '{one[0]}') "
        "WHERE m = 1"
    ).show()


def main() -> None:
    archive = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="asynctrace-archive-")
    tokenizer = toy_tokenizer()
    rng = torch.Generator().manual_seed(0)
    parquet = at.ParquetSink(archive)
    with at.TraceSession("parquet-example", run="toy", sinks=[parquet]) as session:
        for step in range(STEPS):
            batch = rollout_batch(tokenizer, step, rng)
            session.log_rollouts(
                batch["input_ids"],
                tokenizer=tokenizer,
                step=step,
                attention_mask=batch["attention_mask"],
                loss_mask=batch["loss_mask"],
                rewards=batch["rewards"],
                token_fields={
                    "token_ids": batch["input_ids"],
                    "loss_mask": batch["loss_mask"],
                    "logprobs": batch["logprobs"],
                },
            )
    print(f"archive: {archive} ({len(parquet.paths)} file(s)); {session.stats().summary()}")
    query(archive)


if __name__ == "__main__":
    main()
