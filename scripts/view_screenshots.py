"""Screenshots of `asynctrace view` for docs/view.md.

Writes a small simulated GRPO run (groups of 8 completions of a few prompts over 24 steps, with
policy-version lag, truncations, zero-signal groups, token-level fields, and two prompts solved
with a calculator tool: multi-turn rollouts with tool calls) to a Parquet archive through a real
`TraceSession` and `ParquetSink`, serves it with `asynctrace view`, opens each view in headless
Chromium and saves PNGs into docs/images/.

Needs a Chromium on the machine (Debian: `apt-get install -y chromium`) and Playwright's Python
package (`pip install -e ".[screenshots,view]"`); no browser is downloaded.

    python scripts/view_screenshots.py [--chromium /usr/bin/chromium] [--out docs/images]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from screenshots import headless_chromium  # this folder's sibling script: one browser launch

ROOT = Path(__file__).resolve().parents[1]
# Prompts whose rollouts call a calculator tool before they answer.
AGENTIC = {"gsm8k-0002": "0.15 * 240", "gsm8k-0005": "23 * 6"}
SYSTEM = "You may call calculator(expression) for arithmetic; then give the answer."
QUESTIONS = [
    ("gsm8k-0001", "A farmer has 12 cows and buys 7 more. How many cows does he have?", 19),
    ("gsm8k-0002", "What is 15% of 240?", 36),
    ("gsm8k-0003", "A train travels 180 km in 3 hours. What is its speed in km/h?", 60),
    ("gsm8k-0004", "What is the perimeter of a square with sides of length 13?", 52),
    ("gsm8k-0005", "Tom reads 23 pages a day. How many pages does he read in 6 days?", 138),
    ("gsm8k-0006", "What is 144 divided by 12, plus 9?", 21),
]


def _samples(step: int, rng: random.Random) -> list[Any]:
    import asynctrace as at

    out = []
    for prompt_id, question, answer in QUESTIONS:
        version = step - rng.choice((0, 0, 1, 2))
        skill = 1 / (1 + math.exp(-(0.35 * version - 2 + rng.uniform(-1, 1))))
        rewards = []
        for i in range(8):
            solved = rng.random() < skill
            given = answer if solved else answer + rng.choice((-10, -1, 1, 2))
            ramble = rng.random() < max(0.03, 0.25 - 0.01 * step)
            text = f"Let me work through it. {'First, restate the problem. ' * (6 if ramble else 0)}"
            text += f"The answer is {given}." if not ramble else "So"
            stop = "length" if ramble else "stop"
            reward = (1.0 if solved and not ramble else 0.0) + (0.1 if not ramble else -0.2)
            rewards.append(reward)
            # 12 prompt tokens (masked out) and a response of 60 to 200 tokens, with a few
            # unlikely tokens where sampling drifted.
            n = 12 + rng.randint(60, 200)
            logprobs = [
                -rng.uniform(2.0, 6.0)
                if rng.random() < 0.03
                else -abs(rng.gauss(0.05 if solved else 0.4, 0.3))
                for _ in range(n)
            ]
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
            if prompt_id in AGENTIC:
                messages = (
                    [{"role": "system", "content": SYSTEM}, *messages]
                    if ramble
                    else _agentic(question, AGENTIC[prompt_id], given, answer, i)
                )
            out.append((prompt_id, messages, reward, stop, version, n, logprobs, i))
    samples = []
    for k in range(0, len(out), 8):
        group = out[k : k + 8]
        rewards = [g[2] for g in group]
        mean = sum(rewards) / 8
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 8)
        for prompt_id, messages, reward, stop, version, n, logprobs, i in group:
            advantage = round((reward - mean) / (std + 1e-4), 4)
            samples.append(
                at.Sample(
                    messages=messages,
                    metadata={
                        "prompt_id": prompt_id,
                        "group_uid": f"{step}-{prompt_id}",
                        "reward": reward,
                        "advantage": advantage,
                        "policy_version": version,
                        "stop_reason": stop,
                        "sample_index": i,
                    },
                    tokens={
                        "token_ids": list(range(1000, 1000 + n)),
                        "loss_mask": [0] * 12 + [1] * (n - 12),
                        "logprobs": [0.0] * 12 + logprobs[12:],
                        "advantages": [0.0] * 12 + [advantage] * (n - 12),
                    },
                )
            )
    return samples


def _agentic(question: str, expression: str, given: int, answer: int, i: int) -> list[dict[str, Any]]:
    """A rollout that calls the calculator (with a line of text beside the call, or none), reads
    its result and answers: `given`, right or wrong."""
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "Let me compute it." if i % 2 == 0 else None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "name": "calculator", "content": str(answer)},
        {"role": "assistant", "content": f"The calculator says {answer}, so the answer is {given}."},
    ]


def write_archive(directory: Path, steps: int = 24) -> None:
    import anyio

    import asynctrace as at

    async def main() -> None:
        rng = random.Random(7)
        async with at.TraceSession("view-docs", run="grpo", sinks=[at.ParquetSink(directory)]) as session:
            for step in range(steps):
                await session.log_samples(_samples(step, rng), step=step)

    anyio.run(main)


def _shoot(url: str, chromium: str, out: Path) -> list[Path]:
    shots = []
    with headless_chromium(chromium) as browser:
        page = browser.new_page()

        def shot(name: str) -> None:
            path = out / f"view-{name}.png"
            page.screenshot(path=str(path))
            shots.append(path)

        page.goto(url)
        page.wait_for_selector("table.steps")
        shot("overview")
        # A step with a zero-signal group, to show how it is marked.
        page.locator("table.steps tr:has(td.warn) td[data-k=step] a").last.click()
        page.wait_for_selector("table.groups")
        shot("step")
        # A group of rollouts that call a tool, the latest with some reward spread: its strip, its
        # shared prompt, each member's turns.
        page.goto(url + "/prompt?id=gsm8k-0005")
        rows = page.locator("table.history tr[data-step]")
        spread = [rows.nth(i).locator("td[data-k=spread]").inner_text() for i in range(rows.count())]
        latest = max(i for i, s in enumerate(spread) if s != "0.0000")
        rows.nth(latest).locator("a.group").first.click()
        page.wait_for_selector("article.completion")
        shot("group")
        page.locator("article.completion header a", has_text="record").first.click()
        page.wait_for_selector("section.completion-turns")
        shot("record")
        page.go_back()
        page.wait_for_selector("article.completion")
        page.click("a.history")
        page.wait_for_selector("section.diff")
        shot("prompt")
        page.go_back()
        page.wait_for_selector("article.completion")
        page.locator("a.tokens-link").first.click()
        page.wait_for_selector("svg.heat")
        shot("tokens")
    return shots


def _wait_indexed(url: str) -> None:
    """Until the viewer has indexed its archive (it answers 503 meanwhile)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=5).close()
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="asynctrace-view-") as tmp:
        archive = Path(tmp) / "archive"
        write_archive(archive)
        cmd = [sys.executable, "-m", "asynctrace", "view", str(archive), "--port", "0", "--no-cache"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            found = re.search(r"http://\S+?(?=/?\s)", line)
            if not found:
                raise SystemExit(f"asynctrace view did not start: {line!r}")
            started = time.monotonic()
            _wait_indexed(found.group(0))
            for path in _shoot(found.group(0), args.chromium, args.out):
                print(path)
            print(f"shot in {time.monotonic() - started:.1f} s")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
