"""The one engine behind a session: intake → buffer (gate, queue, ledger) → writer lanes → finish,
with health and group metrics and the retry policy.

What others import, each from its module: the session `engine.Engine`, `settings.Settings`,
`queue.OnFull` and `retry.RetryPolicy`; the Ray client and the distributed logger
`ledger.Ledger`, to count as a session does. Nothing below the engine imports it.
"""
