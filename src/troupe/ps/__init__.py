"""Parameter servers: slices of the parameters held by server ranks (SINGA 0.x's ParamShard).

`shard` is the pure state (slices, server-side optimizer, versions), `messages` the
wire format, `server` the loop a server rank runs, `client` the worker side.
"""
