"""How a session lives: its state and finish deadlines, its loop reached from any thread, signals
and exit hooks, forks, and calls that may be abandoned.

Depends on nothing of the data path. What others import: `lifecycle` (`Lifecycle`, `State`,
`finish_bound`, `close_grace`, `STOP_GRACE`), `shutdown` (the hooks, `hand_on`), `abandon`
(threads and calls a deadline may leave running) and `forks` (`hold`, `release`).
"""
