#!/usr/bin/env bash
# Two simulated nodes on one machine, joined by a slow link: step times flat vs hybrid over it.
#
#   sudo RATE=100mbit bench/slow_link.sh --steps 3 [bench/hybrid.py flags]
#
# Each node is a network namespace running torchrun with 2 ranks (PROCS); the namespaces are
# joined by a veth pair whose two ends each get a token-bucket queue discipline (tbf) limited
# to RATE. Ranks of one node reach each other inside their namespace (not limited); every byte
# between the nodes crosses the limited pair, both ways. With DELAY set (e.g. 1ms) netem adds
# that one-way delay too, where the kernel has sch_netem. The node size comes from torchrun
# (LOCAL_WORLD_SIZE), checked against the hosts as on real nodes. Needs root (CAP_NET_ADMIN);
# everything it makes is removed on exit.
set -euo pipefail

RATE=${RATE:-100mbit}
DELAY=${DELAY:-}
PROCS=${PROCS:-2}
PORT=${PORT:-29577}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
NS0=zerodp_node0
NS1=zerodp_node1
LOG=""

cleanup() {
    ip netns del "$NS0" 2>/dev/null || true
    ip netns del "$NS1" 2>/dev/null || true
    if [ -n "$LOG" ]; then rm -rf "$LOG"; fi
}
trap cleanup EXIT
cleanup
LOG=$(mktemp -d)

ip netns add "$NS0"
ip netns add "$NS1"
ip link add zdp0 type veth peer name zdp1
ip link set zdp0 netns "$NS0"
ip link set zdp1 netns "$NS1"
ip -n "$NS0" addr add 10.77.0.1/24 dev zdp0
ip -n "$NS1" addr add 10.77.0.2/24 dev zdp1
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
ip -n "$NS0" link set zdp0 up
ip -n "$NS1" link set zdp1 up
for pair in "$NS0 zdp0" "$NS1 zdp1"; do
    set -- $pair "$@"
    if [ -n "$DELAY" ]; then
        ip netns exec "$1" tc qdisc add dev "$2" root netem rate "$RATE" delay "$DELAY" limit 100000
    else
        ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$RATE" burst 64kb latency 1s
    fi
    shift 2
done

node() {  # namespace, node rank, interface, flags...
    local ns=$1 rank=$2 ifname=$3
    shift 3
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$ifname" OMP_NUM_THREADS=1 \
        "$PYTHON" -m torch.distributed.run --nnodes 2 --node_rank "$rank" \
        --nproc_per_node "$PROCS" --master_addr 10.77.0.1 --master_port "$PORT" \
        "$ROOT/bench/hybrid.py" "$@"
}

echo "# two nodes of $PROCS ranks, linked at $RATE${DELAY:+ with $DELAY one way} (a veth pair)"
node "$NS1" 1 zdp1 "$@" >"$LOG/node1.out" 2>&1 &
other=$!
node "$NS0" 0 zdp0 "$@"
wait "$other" || { cat "$LOG/node1.out" >&2; exit 1; }
