"""The write-ahead spool: segments on disk, their directory, the journal the engine tells of
records as they move, and the plan of what a new session replays.

Knows records, not the engine. What others import: `spool.Spool` and `Durability` (the engine
builds it), `journal` (`Journal`, the engine's one way in, and `ReplayPlan`, `replay_backlog`)
and `segments` (`scan_dir`, `DirScan`, for `asynctrace recover`).
"""
