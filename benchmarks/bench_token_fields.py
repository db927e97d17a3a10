"""Token-level fields: bytes per token and encoding time of the ways a sample could hold them.

For rows of ``--tokens`` float32 log-probs (and int token ids), each option is encoded as part
of a sample's JSON (what the byte bound counts and the spool stores) and checked for an exact
round trip:

- ``json list``: the values as a JSON list of numbers (orjson; the shortest decimal form of
  each float32 widened to a double), what a user putting ``.tolist()`` in metadata gets;
- ``base64 <f4`` (what asynctrace keeps): base64 of the little-endian array, with its dtype;
- ``base64 <f2``: half precision, for size reference only: it is NOT exact.

    python benchmarks/bench_token_fields.py
    python benchmarks/bench_token_fields.py --quick
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

import asynctrace as at
from asynctrace._record import encode_samples


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    repeat = 3 if args.quick else 15
    rng = np.random.default_rng(0)
    logprobs = [(-rng.exponential(1.0, args.tokens)).astype(np.float32) for _ in range(args.rows)]
    ids = [rng.integers(0, 150_000, args.tokens).astype(np.int32) for _ in range(args.rows)]
    message = [{"role": "user", "content": "q"}]

    def json_list() -> list[bytes]:
        return [
            orjson.dumps(
                {"messages": message, "metadata": {"logprobs": lp.tolist(), "token_ids": t.tolist()}}
            )
            for lp, t in zip(logprobs, ids, strict=True)
        ]

    def ours() -> list[bytes]:
        samples = [
            at.Sample(message, tokens={"logprobs": lp, "token_ids": t})
            for lp, t in zip(logprobs, ids, strict=True)
        ]
        return [p for p, _ in encode_samples(samples)[0]]

    def half() -> list[bytes]:
        return [
            orjson.dumps(
                {
                    "messages": message,
                    "tokens": {
                        "logprobs": base64.b64encode(lp.astype("<f2").tobytes()).decode(),
                        "token_ids": base64.b64encode(t.astype("<i4").tobytes()).decode(),
                    },
                }
            )
            for lp, t in zip(logprobs, ids, strict=True)
        ]

    def exact_json(payload: bytes, row: int) -> bool:
        got = np.asarray(orjson.loads(payload)["metadata"]["logprobs"], dtype=np.float32)
        return got.tobytes() == logprobs[row].tobytes()

    def exact_ours(payload: bytes, row: int) -> bool:
        record = at.TraceRecord("x-0", 0, "train", "k", payload, 0.0)
        tokens = record.sample.tokens or {}
        return (
            np.asarray(tokens["logprobs"], dtype=np.float32).tobytes() == logprobs[row].tobytes()
            and np.asarray(tokens["token_ids"], dtype=np.int32).tobytes() == ids[row].tobytes()
        )

    def exact_half(payload: bytes, row: int) -> bool:
        raw = base64.b64decode(orjson.loads(payload)["tokens"]["logprobs"])
        return np.frombuffer(raw, "<f2").astype(np.float32).tobytes() == logprobs[row].tobytes()

    options = [
        ("json list", json_list, exact_json),
        ("base64 <f4 (asynctrace)", ours, exact_ours),
        ("base64 <f2 (reference)", half, exact_half),
    ]
    results = []
    for name, fn, exact in options:
        payloads = fn()
        per_token = sum(len(p) for p in payloads) / (args.rows * args.tokens)
        seconds = _best(fn, repeat)
        ok = all(exact(p, r) for r, p in enumerate(payloads))
        results.append((name, per_token, seconds / (args.rows * args.tokens) * 1e9, ok))
    print(f"{args.rows} rows of {args.tokens} tokens: float32 log-probs and int32 token ids per token")
    print("| option | bytes/token (both fields) | encode ns/token | exact |")
    print("|---|---|---|---|")
    for name, size, ns, ok in results:
        print(f"| {name} | {size:.2f} | {ns:.1f} | {'yes' if ok else 'NO'} |")
    base = results[0]
    ours_row = results[1]
    print(f"size: json list / asynctrace = {base[1] / ours_row[1]:.2f}x")
    print(f"encode time: json list / asynctrace = {base[2] / ours_row[2]:.2f}x")
    return 0 if ours_row[3] else 1


if __name__ == "__main__":
    sys.exit(main())
