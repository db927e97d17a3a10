"""Caps and samplers: which records of a step are kept, per session and per `Selected` sink.

No buffer, no I/O. What others import: `base` (`Sampler`, `StepSelection`, `Entry` and its
states), `samplers` (the built-ins and `resolve_sampler`), `groups` (`GroupSampler`), `gate`
(`Gate`, for the buffer), `window` (`StepWindow`, the one rule of when a step closes), `watch`
(`Watch`, `WatchCounter`), `lane` (a `Selected` sink's selection, for the writer) and `parts`
(one step's parts from several processes, for the Ray and torch.distributed fronts).
"""
