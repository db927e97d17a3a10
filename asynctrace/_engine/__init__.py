"""The one engine behind a session: intake → buffer (gate, queue, ledger) → writer lanes → finish,
with health and group metrics and the retry policy.

The session and the fronts (Ray, torch.distributed) import `Engine`, `RetryPolicy` and `Ledger`
from here; nothing below the engine imports it.
"""
