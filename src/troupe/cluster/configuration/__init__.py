"""What a cluster job is, as data: `ClusterConfig` and where it comes from, each rank's role, what a server learns.

Owns the cluster description (SINGA's ClusterProto: `config`, with every field's command-line
flag declared beside it and turned into `troupe run`'s options by `flags`), the reference's
four frameworks (`presets`), every rank's role (`roles`), reading a cluster from a file, the
environment or `troupe run`'s flags (`sources`), and the `TrainingSpec` worker 0 hands the
servers (`spec`: parameter sizes and the optimizer, as JSON).

Must not touch: processes, process groups or messages (this package is read by `troupe run`
before any rank exists; only `spec` imports torch, and nothing here imports it at package
import). The other sub-packages read the configuration; it reads none of them.
"""
