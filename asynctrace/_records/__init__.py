"""What a sample is, checked and encoded once: `Sample`, `TraceRecord`, token fields, group keys.

Knows nothing of caps, buffers or disks; every other private package may import from it.
"""
