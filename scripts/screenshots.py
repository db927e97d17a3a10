"""Screenshots of Trackio's dashboard after `asynctrace demo`, for the docs.

Runs the demo into a temporary TRACKIO_DIR, starts Trackio's dashboard on it, opens the Metrics
and Traces tabs in headless Chromium and saves PNGs into docs/images/. It also checks what the
docs claim of the Traces tab: every row's id chip is distinct, and the status and latency
columns are filled.

Needs a Chromium on the machine (Debian: `apt-get install -y chromium`) and Playwright's Python
package (`pip install -e ".[screenshots]"`); no browser is downloaded.

    python scripts/screenshots.py [--chromium /usr/bin/chromium] [--out docs/images]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "asynctrace-demo"
RUN = "grpo-demo"
# Flags that keep a headless Chromium from reaching out or reusing any profile.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1440, "height": 900}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_demo(env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "asynctrace", "demo", "--project", PROJECT, "--run", RUN]
    # The archive goes beside Trackio's data, into the temporary directory.
    cmd += ["--steps", "12", "--no-progress", "--archive", os.path.join(env["TRACKIO_DIR"], "archive")]
    subprocess.run(cmd, env=env, check=True, timeout=300)


@contextlib.contextmanager
def _dashboard(env: dict[str, str]) -> Iterator[str]:
    port = _free_port()
    code = (
        f"import trackio; trackio.show(project={PROJECT!r}, open_browser=False, block_thread=True, "
        f"server_port={port})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("Trackio's dashboard did not start") from None
                time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def headless_chromium(chromium: str) -> Iterator[Any]:
    """A browser context of the machine's own Chromium (never a download), headless, with a
    throwaway profile; scripts/view_screenshots.py uses it too."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="asynctrace-chromium-") as profile, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            profile, executable_path=chromium, args=CHROMIUM_ARGS, headless=True, viewport=VIEWPORT
        )
        try:
            yield browser
        finally:
            browser.close()


def _shoot(url: str, chromium: str, out: Path) -> None:
    with headless_chromium(chromium) as browser:
        page = browser.new_page()
        page.goto(f"{url}/?project={PROJECT}", wait_until="networkidle")
        page.wait_for_selector("canvas, svg", timeout=30_000)
        page.wait_for_timeout(1500)  # plots animate in
        page.screenshot(path=str(out / "trackio-metrics.png"))

        page.goto(f"{url}/traces?project={PROJECT}", wait_until="networkidle")
        page.wait_for_selector(".trace-row", timeout=30_000)
        chips = page.locator(".trace-id-chip").all_inner_texts()
        statuses = page.locator(".trace-row .status-pill").all_inner_texts()
        if len(set(chips)) != len(chips):
            raise SystemExit(f"id chips repeat on the Traces tab: {chips}")
        if not statuses:
            raise SystemExit("no status shown on the Traces tab")
        print(f"{len(chips)} rows, distinct chips, statuses {sorted(set(statuses))}")
        page.screenshot(path=str(out / "trackio-traces.png"))
        # One trace opened, to show its id, status, latency and metadata.
        row = page.locator(".trace-row", has_text="truncated").first
        if not row.count():
            row = page.locator(".trace-row").first
        row.click()
        page.wait_for_selector(".trace-detail", timeout=10_000)
        page.locator(".trace-detail").first.scroll_into_view_if_needed()
        page.screenshot(path=str(out / "trackio-trace-detail.png"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="asynctrace-screenshots-") as trackio_dir:
        env = dict(os.environ, TRACKIO_DIR=trackio_dir)
        _run_demo(env)
        with _dashboard(env) as url:
            _shoot(url, args.chromium, args.out)
    for name in ("trackio-metrics.png", "trackio-traces.png", "trackio-trace-detail.png"):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
