"""The write-ahead spool: segments on disk, their directory, the journal the engine tells of
records as they move, and the plan of what a new session replays.

Knows records, not the engine: the engine talks to it through `Journal` only.
"""
