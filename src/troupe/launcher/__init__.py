"""`troupe run`'s launcher: from the command line to this node's running ranks, and their supervision.

    flags.py       Flags: the command line as typed, frozen values (read once from argparse)
    resolve.py     prepared() + plan_from(): flags, cluster block, job file, environment -> LaunchPlan
    checks.py      the refusals, one line each (paths, recovery, elastic flags)
    plan.py        LaunchPlan: mode (fixed, quorum, rejoin), place, rank env, servers, elastic, outputs
    ports.py       Ports: the job's ticket and the ports held until rank 0 listens
    starter.py     Starter: a rank started in the first way that can (warm spare, zygote fork, fresh)
    processes.py   a fixed job: one failure stops every rank
    supervisor.py  an elastic job's restarts (budget, back-off, worker groups), asking a policy
    policies.py    RestartPolicy: QuorumPolicy (worker groups), ServerFailover (parameter servers)
    elastic*.py    the two elastic kinds, with what they share
    job.py         run(args): the above, in order; machine.py: `troupe info`

It never imports torch before a rank needs it: the CLI starts without it. A rank joining its world
(rendezvous) is `troupe.runtime.launch`'s business, not this package's.
"""
