#!/bin/sh
# mpiexec's remote-shell agent for simulated hosts (troupe.bench.netns): where mpiexec would run
# `ssh HOST COMMAND`, run COMMAND inside network namespace HOST, with HOST as its hostname.
#
#     mpiexec --hostfile F --mca plm_ssh_agent tests/dist/scripts/netns_rsh.sh ...
#
# The hostname matters: Open MPI tells hosts apart by it, and ranks on "different" hosts
# with one hostname take each other for neighbours (MPI_ERR_TRUNCATE in the first collective).
host=$1
shift
exec ip netns exec "$host" unshare --uts sh -c "hostname \"\$0\" && $*" "$host"
