"""SINGA compatibility: SINGA's names over troupe's machinery, for scripts written against SINGA.

* `methods`: `SingaMethods`, SINGA's DistOpt methods (``backward_and_update``,
  ``update(loss, dist_option, spars)``, ``all_reduce``/``wait``, ``sync_parameters``), which
  `troupe.DistOpt` inherits;
* `model`: `troupe.Model`, a torch module with SINGA's ``set_optimizer``, ``train_one_batch``
  and ``compile(inputs, is_train, use_graph, sequential)``;
* `jobfile`: the ``cluster { }`` block of SINGA's job.conf, read as plain text (it imports
  nothing of troupe's, so `troupe.cluster`'s configuration reads job files through it).

Nothing here holds state or decides how a step runs: every name hands over to the
DistOpt, its strategies or graph mode. This file imports nothing, so reading a job file
(which `troupe run` does without torch) does not load the rest.
"""
