"""troupe's benchmark harness: workloads, contestants, one A/B engine, one result format.

`troupe bench list | run NAME | table FILE | plot FILE OUT` drives it (see `command`; its flags are
in `arguments`).

* `workloads`   the WORKLOADS registry: a model, its data and its loss, by name;
* `contestants` the CONTESTANTS registry: ways to train one step (DistOpt per dist_option,
                DDP, one flat all-reduce, no communication);
* `registry`    the BENCHMARKS registry: every `troupe bench run NAME`, its defaults and options;
* the A/B engine lives in `troupe.observe.turns` (the planner's in-step calibration uses it too):
                contestants take turns step by step in the same processes, order alternated,
                burn-in then measured repetitions, slowest rank counted;
* `records`     the JSON-lines format: one record per measurement;
* `stats`       medians, spreads, ratios of medians;
* `render`      markdown tables and matplotlib plots from records;
* `suites/`     the named benchmarks (collectives, ddp, accumulate, compression) and the
                tables of the records that the scripts in ``benchmarks/`` write.

Not imported by ``import troupe``; nothing in troupe imports it but the CLI.
"""
