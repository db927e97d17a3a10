"""Caps and samplers: which records of a step are kept, per session and per `Selected` sink.

The built-in samplers, the group sampler, the gate that holds a selection per open step, the
watch list, the per-sink lanes and the merge of parts from several processes. No buffer, no I/O:
the engine, the Ray collector and torch.distributed call into it.
"""
