"""The named benchmarks, one module each; `troupe.bench.registry` lists them.

A suite module has ``run(rank, world_size, options) -> list[Record]`` (called on every
rank inside a fresh world; rank 0's records are kept) and ``table(records) -> str``,
and optionally ``plot(records, out)``. `scripts` renders the records that the scripts
left in ``benchmarks/`` write.
"""
