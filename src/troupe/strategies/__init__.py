"""Update strategies: how gradients become a step, one class per regime.

`base` defines the `UpdateStrategy` interface DistOpt holds exactly one of; `allreduce`
(plain mean all-reduce), `compressed` (fp16/bf16/top-K/threshold), `partial` (SINGA's
partial update) implement it, and the parameter-server worker kinds live in
`troupe.cluster`. `registry` maps SINGA's dist_option names to strategies. A strategy
gets its communicator, parameters and optimizer in __init__ and never reaches back into
DistOpt.
"""
