"""The distributed integrations are optional: nothing heavy is imported until it is used."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_asynctrace_imports_neither_ray_nor_torch() -> None:
    """`import asynctrace` and `import asynctrace.distributed` leave ray and torch unimported."""
    done = _run(
        "import sys, asynctrace, asynctrace.distributed\n"
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_missing_ray_names_the_extra() -> None:
    """Without Ray, `import asynctrace.ray` fails with an ImportError naming the asynctrace[ray] extra."""
    done = _run(
        "import sys\n"
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "try:\n"
        "    import asynctrace.ray\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'asynctrace[ray]'" in done.stdout


def test_importing_the_adapters_imports_no_framework() -> None:
    """`import asynctrace.adapters` imports none of the frameworks it reads, nor their engines."""
    frameworks = (
        "openrlhf",
        "slime",
        "verl",
        "areal",
        "trl",
        "skyrl",
        "vllm",
        "sglang",
        "deepspeed",
        "megatron",
        "flash_attn",
    )
    done = _run(
        "import sys, asynctrace, asynctrace.adapters\n"
        f"print(sorted(m for m in {frameworks!r} if m in sys.modules))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
