"""What a training script uses around its DistOpt: data in, numbers out.

* `data`: MNIST, CIFAR-10 and synthetic data, SINGA's fixed `partition` of a dataset among
  the ranks (`troupe.data`);
* `sampling`: `DistributedSampler` and `loader`, each rank its share reshuffled every epoch
  (re-exported by `data`);
* `metrics`: loss and correct counts summed across ranks (SINGA's ``reduce_variable``),
  accuracy, throughput and rank 0's progress line (`troupe.metrics`);
* `scalars`: `troupe.log`, the script's own scalars beside troupe's step statistics.

Scripts reach them as ``troupe.data``, ``troupe.metrics`` and ``troupe.log``. They read the
World (rank, world size, recorder) and nothing of the training machinery, which never
imports them (only the command line and the benchmark harness do). This file imports
nothing: each module loads when first used.
"""
