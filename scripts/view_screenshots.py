"""Screenshots of `asynctrace view` for docs/view.md.

Runs `asynctrace demo` (a simulated asynchronous GRPO run: groups of 8, policy-version lag,
truncations, zero-signal groups, tool calls, and token fields with two log-prob series) into a
temporary archive, its Trackio project into a temporary TRACKIO_DIR; serves the archive with
`asynctrace view`, opens each view in headless Chromium and saves PNGs into docs/images/.

Needs a Chromium on the machine (Debian: `apt-get install -y chromium`) and Playwright's Python
package (`pip install -e ".[screenshots,view,parquet]"`); no browser is downloaded.

    python scripts/view_screenshots.py [--chromium /usr/bin/chromium] [--out docs/images]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from screenshots import headless_chromium  # this folder's sibling script: one browser launch

ROOT = Path(__file__).resolve().parents[1]
WATCHED = "math-05"  # the demo's watched prompt: the policy calls a tool for it


def write_archive(directory: Path, steps: int = 24) -> Path:
    """Run the demo into `directory` (its Trackio project in a folder of its own there); returns
    the archive of the run."""
    env = dict(os.environ, TRACKIO_DIR=str(directory / "trackio"))
    command = [sys.executable, "-m", "asynctrace", "demo", "--archive", str(directory), "--run", "grpo"]
    subprocess.run(
        [*command, "--steps", str(steps), "--no-progress"], env=env, check=True, capture_output=True
    )
    return directory / "grpo"


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
        flat = page.locator("table.steps tr:has(td.warn) td[data-k=step] a")
        flat.nth(flat.count() // 2).click()
        page.wait_for_selector("table.groups")
        shot("step")
        # A group of the watched prompt, whose rollouts call a tool, the latest with some reward
        # spread: its strip, its shared prompt, each member's turns.
        page.goto(f"{url}/prompt?id={WATCHED}")
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
        # The watched prompt: a tool call, then the answer; the tokens of the oldest policy's worst.
        page.goto(f"{url}/prompt?id={WATCHED}")
        page.wait_for_selector("section.version")
        page.locator("section.version").last.locator("a.tokens-link").last.click()
        page.wait_for_selector("div.tk")
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
        archive = write_archive(Path(tmp))
        # Served by its path relative to the temporary directory, so the header the pages show
        # names the run, not this machine's temporary path.
        relative = str(archive.relative_to(tmp))
        cmd = [sys.executable, "-m", "asynctrace", "view", relative, "--port", "0", "--no-cache"]
        cmd += ["--watch", WATCHED]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=tmp)
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
