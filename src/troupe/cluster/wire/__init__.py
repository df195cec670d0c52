"""What crosses the wire between workers and servers: message headers, frames, sparse (top-K) payloads.

Owns the encoding only: `messages` (an int64 header and its checks), `frames` (the messages a
worker posts to one server in a step, packed into one payload) and `sparse` (an update as
(index, value) pairs, `ClusterConfig.wire_topk`).

Must not touch: sending or receiving (the servers and workers call the `Communicator`), the
parameters' values, or any state that outlives one message.
"""
