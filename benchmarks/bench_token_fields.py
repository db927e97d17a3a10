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
from asynctrace._records.encode import encode_samples


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

    def json_list(with_ids: bool) -> list[bytes]:
        return [
            orjson.dumps(
                {
                    "messages": message,
                    "metadata": {"logprobs": lp.tolist(), **({"token_ids": t.tolist()} if with_ids else {})},
                }
            )
            for lp, t in zip(logprobs, ids, strict=True)
        ]

    def ours(with_ids: bool) -> list[bytes]:
        samples = [
            at.Sample(message, tokens={"logprobs": lp, **({"token_ids": t} if with_ids else {})})
            for lp, t in zip(logprobs, ids, strict=True)
        ]
        return [p for p, _ in encode_samples(samples)[0]]

    def half(with_ids: bool) -> list[bytes]:
        out = []
        for lp, t in zip(logprobs, ids, strict=True):
            tokens = {"logprobs": base64.b64encode(lp.astype("<f2").tobytes()).decode()}
            if with_ids:
                tokens["token_ids"] = base64.b64encode(t.astype("<i4").tobytes()).decode()
            out.append(orjson.dumps({"messages": message, "tokens": tokens}))
        return out

    def exact_json(payload: bytes, row: int) -> bool:
        got = np.asarray(orjson.loads(payload)["metadata"]["logprobs"], dtype=np.float32)
        return got.tobytes() == logprobs[row].tobytes()

    def exact_ours(payload: bytes, row: int) -> bool:
        record = at.TraceRecord("x-0", 0, "train", "k", payload, 0.0)
        tokens = record.sample.tokens or {}
        ok = np.asarray(tokens["logprobs"], dtype=np.float32).tobytes() == logprobs[row].tobytes()
        if "token_ids" in tokens:
            ok &= np.asarray(tokens["token_ids"], dtype=np.int32).tobytes() == ids[row].tobytes()
        return ok

    def exact_half(payload: bytes, row: int) -> bool:
        raw = base64.b64decode(orjson.loads(payload)["tokens"]["logprobs"])
        return np.frombuffer(raw, "<f2").astype(np.float32).tobytes() == logprobs[row].tobytes()

    options = [
        ("json list", json_list, exact_json),
        ("base64 <f4 (asynctrace)", ours, exact_ours),
        ("base64 <f2 (reference)", half, exact_half),
    ]
    empty = len(orjson.dumps({"messages": message}))
    print(f"{args.rows} rows of {args.tokens} tokens (float32 log-probs; int32 token ids)")
    print("| fields | option | bytes/token | bytes per row | encode ns/token | exact |")
    print("|---|---|---|---|---|---|")
    exact_ok = True
    for with_ids in (False, True):
        label = "logprobs + token_ids" if with_ids else "logprobs"
        results = []
        for name, fn, exact in options:
            payloads = fn(with_ids)
            row_bytes = sum(len(p) - empty for p in payloads) / args.rows
            seconds = _best(lambda fn=fn, with_ids=with_ids: fn(with_ids), repeat)
            ok = all(exact(p, r) for r, p in enumerate(payloads))
            results.append((name, row_bytes, seconds / (args.rows * args.tokens) * 1e9, ok))
            print(
                f"| {label} | {name} | {row_bytes / args.tokens:.2f} | {row_bytes:,.0f} | "
                f"{results[-1][2]:.1f} | {'yes' if ok else 'NO'} |"
            )
        exact_ok &= results[1][3]
        print(
            f"{label}: size json list / asynctrace = {results[0][1] / results[1][1]:.2f}x, "
            f"encode time json list / asynctrace = {results[0][2] / results[1][2]:.2f}x"
        )
    return 0 if exact_ok else 1


if __name__ == "__main__":
    sys.exit(main())
