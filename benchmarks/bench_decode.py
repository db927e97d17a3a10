"""Decoding rollouts: the batched path versus the per-sample loop trainers write today.

Two comparisons, each in one process run:

1. a 256 x 4096 batch of multi-turn rollouts (prompt, assistant and tool turns, right padding,
   per-token versions): `decode_rollouts` (rows selected on the device, one transfer per tensor,
   every turn decoded in one go) versus a per-sample loop (`.item()`, `.cpu().tolist()` and one
   `tokenizer.decode` per turn, per sample). The toy tokenizer is byte-level BPE, so the batched
   path decodes from its exact byte table; `[1b]` times it with the tokenizer's own
   `decode_batch` instead, to show what the table is worth;
2. a step of 1024 samples of which a cap keeps 16 (top/bottom by reward), through a
   `TraceSession` into a memory sink: `log_rollouts` (the cap picks rows from the rewards, only
   those are decoded) versus decoding all 1024 and handing them to `log_samples`.

On a GPU, [1] also says where each path's time goes: the per-sample loop's device round trips
(`.item()` and `.cpu()` per sample, each a sync) against its decoding, and the batched path's
device part (row selection, masks, the one transfer: `_tensor_layout`) against its decoding on the
CPU, so that one short run shows what limits the ratio. Goals: >= 3x on the CPU, >= 20x on a GPU.

    python benchmarks/bench_decode.py [--device cuda] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from asynctrace import Sample, TraceSession
from asynctrace.rollouts import decode_rollouts, toy_tokenizer
from asynctrace.rollouts._bytelevel import byte_table
from asynctrace.rollouts._decode import _tensor_layout
from asynctrace.rollouts._text import tokenizer_decode
from asynctrace.testing import MemorySink


class OwnDecode:
    """The tokenizer behind an object the byte table does not recognise: its own `decode_batch`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return list(self.inner.decode_batch(sequences, skip_special_tokens=skip_special_tokens))


def make_batch(
    n_rows: int, width: int, vocab: int, group: int, seed: int, device: str
) -> dict[str, torch.Tensor]:
    """Multi-turn rollouts, right-padded: a prompt shared by each group, then assistant/tool turns."""
    rng = random.Random(seed)
    input_ids = torch.zeros(n_rows, width, dtype=torch.long)
    attention_mask = torch.zeros(n_rows, width, dtype=torch.bool)
    loss_mask = torch.zeros(n_rows, width, dtype=torch.long)
    versions = torch.full((n_rows, width), -1, dtype=torch.long)
    prompt: list[int] = []
    for row in range(n_rows):
        if row % group == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(200, 600))]
        length = rng.randrange(width // 2, width + 1)
        ids = list(prompt[:length])
        mask = [0] * len(ids)
        turn = 0
        while len(ids) < length:
            generated = turn % 2 == 0
            size = min(rng.randrange(200, 600) if generated else rng.randrange(50, 200), length - len(ids))
            ids += [rng.randrange(3, vocab) for _ in range(size)]
            mask += [int(generated)] * size
            turn += 1
        input_ids[row, :length] = torch.tensor(ids)
        attention_mask[row, :length] = True
        loss_mask[row, :length] = torch.tensor(mask)
        versions[row, :length] = torch.where(torch.tensor(mask) == 1, 7, -1)
    rewards = torch.rand(n_rows)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "versions": versions,
        "rewards": rewards,
    }
    return {name: tensor.to(device) for name, tensor in batch.items()}


def per_sample_loop(batch: dict[str, torch.Tensor], tokenizer: Any, rows: list[int]) -> list[Sample]:
    """What trainers do today: per sample `.item()` / `.cpu().tolist()`, one `decode` per turn."""
    samples = []
    for i in rows:
        seqlen = int(batch["attention_mask"][i].sum().item())
        ids = batch["input_ids"][i, :seqlen].cpu().tolist()
        mask = batch["loss_mask"][i, :seqlen].cpu().tolist()
        versions = [v for v in batch["versions"][i, :seqlen].cpu().tolist() if v >= 0]
        reward = float(batch["rewards"][i].item())
        messages = []
        start = 0
        for j in range(1, seqlen + 1):
            if j == seqlen or mask[j] != mask[j - 1]:
                role = "assistant" if mask[start] else ("user" if start == 0 else "tool")
                text = tokenizer.decode(ids[start:j], skip_special_tokens=False)
                messages.append({"role": role, "content": text})
                start = j
        if not any(mask):  # the response has no tokens: an empty assistant turn (docs/rollouts.md)
            messages.append({"role": "assistant", "content": ""})
        metadata = {"sample_index": i, "reward": reward, "seq_len": seqlen}
        if versions:
            metadata["policy_version_min"] = min(versions)
            metadata["policy_version_max"] = max(versions)
        samples.append(Sample(messages=messages, metadata=metadata))
    return samples


def loop_transfers(batch: dict[str, torch.Tensor], rows: list[int]) -> None:
    """Only the per-sample loop's device round trips (what it costs before any decoding)."""
    for i in rows:
        seqlen = int(batch["attention_mask"][i].sum().item())
        batch["input_ids"][i, :seqlen].cpu().tolist()
        batch["loss_mask"][i, :seqlen].cpu().tolist()
        batch["versions"][i, :seqlen].cpu().tolist()
        float(batch["rewards"][i].item())


def device_part(batch: dict[str, torch.Tensor]) -> None:
    """Only the batched path's work on the tensors' device, up to its one transfer."""
    _tensor_layout(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["versions"], None)


GOAL_CPU, GOAL_GPU = 3.0, 20.0


def batched(batch: dict[str, torch.Tensor], tokenizer: Any, rows: list[int] | None) -> list[Sample]:
    return decode_rollouts(
        batch["input_ids"],
        tokenizer=tokenizer,
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
        versions=batch["versions"],
        rewards=batch["rewards"],
        rows=rows,
    )


def best_of(repeat: int, device: str, *fns: Callable[[], object]) -> list[float]:
    """Best wall time of each function; runs are interleaved so that load changes hit all alike."""
    best = [math.inf] * len(fns)
    for fn in fns:
        fn()  # warm-up: allocator, tokenizer caches
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def compare_batch(args: argparse.Namespace, tokenizer: Any) -> None:
    """[1] the batched path versus the per-sample loop, on the same batch; [1b] without the table."""
    batch = make_batch(args.rows, args.width, tokenizer.get_vocab_size(), args.group, 0, args.device)
    tokens = int(batch["attention_mask"].sum())
    everything = list(range(args.rows))
    own = OwnDecode(tokenizer)
    reference = [s.messages for s in per_sample_loop(batch, tokenizer, everything)]
    for variant in (tokenizer, own):
        if [s.messages for s in batched(batch, variant, None)] != reference:
            raise SystemExit("the batched path and the per-sample loop disagree; refusing to time them")
    table = byte_table(tokenizer, lambda seqs: tokenizer_decode(tokenizer, seqs)) is not None
    loop_s, batch_s, own_s = best_of(
        args.repeat,
        args.device,
        lambda: per_sample_loop(batch, tokenizer, everything),
        lambda: batched(batch, tokenizer, None),
        lambda: batched(batch, own, None),
    )
    print(
        f"[1] {args.rows} x {args.width} ({tokens} real tokens, multi-turn): "
        f"per-sample loop {loop_s * 1e3:.0f} ms, batched {batch_s * 1e3:.0f} ms, "
        f"ratio {loop_s / batch_s:.1f}x (outputs identical; byte-level table: {'yes' if table else 'no'})"
    )
    print(
        f"[1b] batched with the tokenizer's own decode_batch: {own_s * 1e3:.0f} ms, "
        f"ratio {loop_s / own_s:.1f}x"
    )
    transfers_s, device_s = best_of(
        args.repeat, args.device, lambda: loop_transfers(batch, everything), lambda: device_part(batch)
    )
    print(
        f"[1c] where the time goes: the loop's device round trips {transfers_s * 1e3:.0f} ms of its "
        f"{loop_s * 1e3:.0f} ms (the rest: slicing and one decode per turn); the batched path's "
        f"device part and transfer {device_s * 1e3:.1f} ms of its {batch_s * 1e3:.0f} ms (the rest: "
        "decoding on the CPU)"
    )
    goal = GOAL_GPU if args.device.startswith("cuda") else GOAL_CPU
    met = loop_s / batch_s >= goal
    print(f"goal on {args.device}: >= {goal:g}x, {loop_s / batch_s:.1f}x, {'met' if met else 'NOT met'}")


def compare_cap(args: argparse.Namespace, tokenizer: Any) -> None:
    """[2] `log_rollouts` under a cap versus decoding everything and logging it for the cap to drop."""
    step = make_batch(args.step_rows, args.width, tokenizer.get_vocab_size(), args.group, 1, args.device)
    tensors: dict[str, Any] = {name: step[name] for name in ("attention_mask", "loss_mask", "versions")}
    counter = iter(range(10**9))

    async def run(capped_first: bool) -> None:
        sink = MemorySink()
        async with TraceSession(
            "bench-decode", run="cap", sinks=[sink], max_traces_per_step=args.cap, sampler="top_bottom"
        ) as session:
            n = next(counter)
            if capped_first:
                await session.log_rollouts(
                    step["input_ids"], tokenizer=tokenizer, step=n, rewards=step["rewards"], **tensors
                )
            else:
                samples = batched(step, tokenizer, None)
                await session.log_samples(samples, step=n)
        if len(sink.records) != args.cap:
            raise SystemExit(f"expected {args.cap} traces, the sink got {len(sink.records)}")

    all_s, cap_s = best_of(
        args.repeat, args.device, lambda: anyio.run(run, False), lambda: anyio.run(run, True)
    )
    print(
        f"[2] cap {args.cap} of {args.step_rows} x {args.width}, through a TraceSession: "
        f"decode all then cap {all_s * 1e3:.0f} ms, log_rollouts (decode kept rows only) "
        f"{cap_s * 1e3:.1f} ms, ratio {all_s / cap_s:.0f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per variant; the best is kept")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (they share it)")
    parser.add_argument("--step-rows", type=int, default=1024, help="samples in the capped step")
    parser.add_argument("--cap", type=int, default=16)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    tokenizer = toy_tokenizer()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device={args.device} ({name}) torch={torch.__version__} threads={torch.get_num_threads()}")
    compare_batch(args, tokenizer)
    compare_cap(args, tokenizer)


if __name__ == "__main__":
    main()
