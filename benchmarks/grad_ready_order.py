"""Do gradients become ready in troupe's bucket order? (issue 29: "bucket order from the first backward").

DDP rebuilds its buckets after the first step in the order the gradients became ready. troupe
plans its buckets once, in reverse parameter order (`troupe.sync.bucket.plan_buckets`), and
launches a bucket when it is complete and every bucket before it has been launched. If the
gradients arrive in another order, a bucket can sit complete behind an earlier one that is not
(its all-reduce starts late) -- which a rebuild would fix. This script measures, for each
workload, one backward's ready order against the plan, and how long each bucket waited, complete,
for the buckets before it (the time a rebuilt order could give back to overlap):

    python benchmarks/grad_ready_order.py [--workloads cnn resnet18] [--batch 16]

No process group: the plan and the order do not depend on the world (DistOpt's default bucket
size and first bucket size).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from troupe.bench.workloads import WORKLOADS
from troupe.distopt import DEFAULT_BUCKET_SIZE
from troupe.sync.bucket import FIRST_BUCKET_SIZE, plan_buckets


def measure(name: str, batch: int, bucket_size: int) -> dict:
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    model = workload.build()
    params = [p for p in model.parameters() if p.requires_grad]
    plan = plan_buckets(params, bucket_size, FIRST_BUCKET_SIZE)
    bucket_of = {j: b for b, members in enumerate(plan) for j in members}
    ready: list[tuple[int, float]] = []
    index = {id(p): j for j, p in enumerate(params)}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: ready.append((index[id(p)], time.perf_counter())))
    x = torch.randn(batch, *workload.shape)
    y = torch.randint(0, 10, (batch,))
    for _ in range(2):  # the second backward is the one measured (the first allocates)
        ready.clear()
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        end = time.perf_counter()
    order = [j for j, _ in ready]
    complete: dict[int, float] = {}
    left = {b: set(members) for b, members in enumerate(plan)}
    for j, t in ready:
        left[bucket_of[j]].discard(j)
        if not left[bucket_of[j]]:
            complete[bucket_of[j]] = t
    launch, waited = {}, []
    last = t0
    for b in range(len(plan)):  # a bucket leaves once it and every bucket before it are complete
        launch[b] = max(complete[b], last)
        waited.append(launch[b] - complete[b])
        last = launch[b]
    expected = [j for members in plan for j in members]
    inversions = sum(1 for a, b in zip(order, order[1:]) if bucket_of[a] > bucket_of[b])
    return {"workload": name, "params": len(params), "buckets": len(plan),
            "ready_order_is_plan_order": order == expected,
            "bucket_order_inversions": inversions,
            "backward_ms": round((end - t0) * 1e3, 2),
            "max_wait_ms": round(max(waited) * 1e3, 3), "total_wait_ms": round(sum(waited) * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["cnn", "resnet18"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE, help="elements (DistOpt default)")
    a = p.parse_args()
    torch.set_num_threads(1)
    for name in a.workloads:
        print(json.dumps(measure(name, a.batch, a.bucket_size)))


if __name__ == "__main__":
    main()
