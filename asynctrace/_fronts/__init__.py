"""What the fronts for other processes share: a Ray actor's `TraceClient` and a torch.distributed
rank's `DistributedTraceLogger` each hold one `Front` and add only where their samples go.

`selection` is the process's part of each step's selection; `front` the way in (checks and
encoding in the caller, the watch list, the part selection) and the one place each sample is
counted. How they finish is `_runtime/finishing.py`, what runs at exit `_runtime/exits.py`.
"""
