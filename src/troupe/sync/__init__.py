"""Synchronous gradient reduction overlapped with backward.

`bucket` lays parameters out in flat, rank-independent buffers; `reducer` listens to
autograd and launches one reduce hook per full bucket; `hooks/` holds the reduce hooks,
one module per family (DDP's comm-hook shape: a small object called with a sealed bucket).
Knows nothing of optimizers or of which dist_option is in use, and imports nothing above it
(strategies/, cluster/ choose a hook and hand it down).
"""
