"""Cross-rank trace sampling for SPMD trainers on torch.distributed (any backend).

Three modes, ``"global"`` (one selection over every rank's candidates, one run), ``"per_rank"``
and ``"per_rank_stream"`` (a run per rank, in one Trackio group): see the table in
docs/distributed.md. torch is imported when a logger is created, never with this package.
"""

from __future__ import annotations

from ._logger import DistributedTraceLogger, Mode, RankStats

__all__ = ["DistributedTraceLogger", "Mode", "RankStats"]
