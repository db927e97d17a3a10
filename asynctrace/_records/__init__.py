"""What a sample is, checked and encoded once: `Sample`, `TraceRecord`, token fields, group keys.

Knows nothing of caps, buffers or disks. Every other package may import from it: `types`
(`Sample`, `SampleLike`, `TraceRecord`, `MetricsItem`), `encode` (validation and encoding),
`tokens` (per-token fields) and `groups` (`group_of`, `payload_group`, `population_spread`).
"""
