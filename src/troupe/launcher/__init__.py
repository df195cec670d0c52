"""`troupe run`'s launcher: turns the command line into this node's running ranks.

`job.run` resolves what the flags, cluster block, job file and environment ask for, then starts
the ranks (`starter`), fixed (`processes`: one failure stops them all) or elastic (`elastic_groups`:
a quorum over worker groups; `elastic_servers`: parameter-server workers that rejoin alone), and
supervises them (`supervisor`). It never imports torch before a rank needs it: the CLI starts
without it. Rendezvous itself (a rank joining its world) is `troupe.runtime.launch`'s.
"""
