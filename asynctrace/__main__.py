"""``python -m asynctrace``: the same command line as the ``asynctrace`` script."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main(prog_name="asynctrace")
