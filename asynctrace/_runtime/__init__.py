"""How a session lives: its state and finish deadlines, its loop reached from any thread, signals
and exit hooks, forks, and calls that may be abandoned.

Depends on nothing of the data path; the engine, the session and the fronts import from it.
"""
