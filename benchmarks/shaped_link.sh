#!/usr/bin/env bash
# Two ranks in two network namespaces joined by a veth pair, each end limited by tc.
#
#   benchmarks/shaped_link.sh 100mbit --dist-option sparseTopK --spars 0.01
#   benchmarks/shaped_link.sh none --dist-option plain          # the veth pair, unlimited
#
# Needs root (ip netns, tc). Only addresses inside the namespaces are used; everything is
# removed on exit. Arguments after the rate go to benchmarks/time_to_accuracy.py.
set -euo pipefail
RATE=$1; shift
NS0=troupe-bench0; NS1=troupe-bench1
cleanup() { ip netns del "$NS0" 2>/dev/null || true; ip netns del "$NS1" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$NS0"; ip netns add "$NS1"
ip link add tb-veth0 type veth peer name tb-veth1
ip link set tb-veth0 netns "$NS0"; ip link set tb-veth1 netns "$NS1"
ip -n "$NS0" addr add 10.77.0.1/24 dev tb-veth0
ip -n "$NS1" addr add 10.77.0.2/24 dev tb-veth1
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
ip -n "$NS0" link set tb-veth0 up; ip -n "$NS1" link set tb-veth1 up
if [ "$RATE" != none ]; then
  ip netns exec "$NS0" tc qdisc add dev tb-veth0 root tbf rate "$RATE" burst 64kb latency 100ms
  ip netns exec "$NS1" tc qdisc add dev tb-veth1 root tbf rate "$RATE" burst 64kb latency 100ms
fi
TOKEN=$(python -c 'import secrets; print(secrets.token_hex(8))')
PORT=29611
HERE=$(cd "$(dirname "$0")" && pwd)
node() {  # node rank, namespace, interface, then the script's arguments
  local rank=$1 ns=$2 dev=$3; shift 3
  ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$dev" troupe run -n 1 --threads 1 --nnodes 2 --node-rank "$rank" \
    --master 10.77.0.1:$PORT --token "$TOKEN" "$HERE/time_to_accuracy.py" "$@"
}
node 1 "$NS1" tb-veth1 "$@" > /dev/null &
PEER=$!
node 0 "$NS0" tb-veth0 "$@"
wait "$PEER"
