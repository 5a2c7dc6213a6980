#!/usr/bin/env bash
# Two "hosts" on this one machine, for testing multi-node launches without a cluster.
#
# usage: cluster/netns/testbed.sh start|stop|status
#        cluster/netns/testbed.sh run [--] COMMAND [ARGS...]   (runs COMMAND on host 1)
#
# Each host is a network namespace plus its own UTS namespace (its own hostname):
#   host dtrain-h1: namespace dtrain-<ID>-h1, eth0 = 10.77.0.1/24, hostname dtrain-h1
#   host dtrain-h2: namespace dtrain-<ID>-h2, eth0 = 10.77.0.2/24, hostname dtrain-h2
# joined by a veth pair that exists only between the two namespaces (the machine's own
# network is not touched, so several test beds with different IDs can run at once).
# `ip netns exec` bind-mounts /etc/netns/<namespace>/hosts over /etc/hosts, so inside a host
# both names resolve to their 10.77.0.x addresses.
#
# Open MPI starts its remote daemons through rsh-agent.sh (beside this file) instead of ssh:
# mpirun --mca plm_rsh_agent cluster/netns/rsh-agent.sh. `start` writes for dtrain-run:
#   $DIR/hostfile      "dtrain-h1 slots=1" and "dtrain-h2 slots=1"
#   $DIR/mpirun-args   one mpirun argument per line: the agent, and TCP on 10.77.0.0/24 only
# where DIR=/tmp/dtrain-netns-<ID>. Example (what tests/cluster/netns_test.sh runs):
#   cluster/netns/testbed.sh start
#   args=(); while read -r a; do args+=(--mpirun-arg "$a"); done < /tmp/dtrain-netns-0/mpirun-args
#   cluster/netns/testbed.sh run build/bin/dtrain-run --hostfile /tmp/dtrain-netns-0/hostfile \
#       "${args[@]}" -- build/bin/dtrain-bench allreduce --max_bytes=4096
#   cluster/netns/testbed.sh stop
#
# Environment: DTRAIN_NETNS_ID (default 0) names this test bed. Needs root, iproute2 and
# util-linux's unshare. Exit status 77 means "cannot be made here" (the reason is printed):
# not root, a missing tool, or namespaces not permitted.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ID="${DTRAIN_NETNS_ID:-0}"
DIR="/tmp/dtrain-netns-${ID}"
SUBNET="10.77.0.0/24"
HOSTS=(dtrain-h1 dtrain-h2)
ADDRS=(10.77.0.1 10.77.0.2)
ns_of() { echo "dtrain-${ID}-${1#dtrain-}"; }  # dtrain-h1 -> dtrain-<ID>-h1

say() { echo "[netns] $*"; }
cannot() {
  echo "[netns] cannot make the test bed here: $*" >&2
  exit 77
}

check_prerequisites() {
  [[ $ID =~ ^[A-Za-z0-9_]+$ ]] || { echo "[netns] DTRAIN_NETNS_ID='$ID': letters, digits, _ only" >&2; exit 2; }
  [[ $(id -u) == 0 ]] || cannot "network namespaces need root (running as uid $(id -u))"
  command -v ip >/dev/null || cannot "'ip' not found; install iproute2"
  command -v unshare >/dev/null || cannot "'unshare' not found; install util-linux"
}

stop() {
  for host in "${HOSTS[@]}"; do
    local ns
    ns="$(ns_of "$host")"
    if ip netns list 2>/dev/null | grep -qw "^$ns"; then
      # Processes still inside (a job that outlived its test) end with the namespace.
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null || say "could not delete namespace $ns"
    fi
    rm -rf "/etc/netns/$ns"
  done
  rmdir /etc/netns 2>/dev/null
  rm -rf "$DIR"
}

start() {
  stop  # a leftover of an interrupted run with the same ID
  local ns1 ns2
  ns1="$(ns_of "${HOSTS[0]}")"
  ns2="$(ns_of "${HOSTS[1]}")"
  ip netns add "$ns1" 2>/dev/null || cannot "'ip netns add' is not permitted (no CAP_SYS_ADMIN?)"
  if ! ip netns add "$ns2" || ! ip link add eth0 netns "$ns1" type veth peer name eth0 netns "$ns2"; then
    stop
    cannot "could not create a veth pair between namespaces"
  fi
  mkdir -p "$DIR"
  for i in 0 1; do
    local ns
    ns="$(ns_of "${HOSTS[$i]}")"
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "${ADDRS[$i]}/24" dev eth0
    ip -n "$ns" link set eth0 up
    mkdir -p "/etc/netns/$ns"
    {
      echo "127.0.0.1 localhost"
      for j in 0 1; do echo "${ADDRS[$j]} ${HOSTS[$j]}"; done
    } > "/etc/netns/$ns/hosts"
    echo "${HOSTS[$i]} $ns" >> "$DIR/hosts.map"
    echo "${HOSTS[$i]} slots=1" >> "$DIR/hostfile"
  done
  printf '%s\n' --mca plm_rsh_agent "$HERE/rsh-agent.sh" --mca btl self,tcp \
    --mca btl_tcp_if_include "$SUBNET" --mca oob_tcp_if_include "$SUBNET" > "$DIR/mpirun-args"
  # The link works: host 1 reaches host 2 by name.
  if ! ip netns exec "$ns1" ping -c 1 -W 2 "${HOSTS[1]}" >/dev/null 2>&1; then
    if command -v ping >/dev/null; then
      stop
      cannot "host 1 cannot reach host 2 over the veth link"
    fi
  fi
  say "up: ${HOSTS[0]} (${ADDRS[0]}, namespace $ns1) <-> ${HOSTS[1]} (${ADDRS[1]}, namespace $ns2)"
  say "hostfile: $DIR/hostfile; mpirun arguments: $DIR/mpirun-args"
}

status() {
  local up=0
  for host in "${HOSTS[@]}"; do
    local ns
    ns="$(ns_of "$host")"
    if ip netns list 2>/dev/null | grep -qw "^$ns"; then
      say "$host: namespace $ns: $(ip -n "$ns" -br addr show eth0 2>/dev/null)"
      up=$((up + 1))
    else
      say "$host: down"
    fi
  done
  [[ $up == 2 ]]
}

# Runs a command as host 1: in its namespace, with its hostname, and with DTRAIN_NETNS_DIR
# set for rsh-agent.sh.
run_on_host1() {
  [[ ${1:-} == "--" ]] && shift
  [[ $# -gt 0 ]] || { echo "usage: $0 run [--] COMMAND [ARGS...]" >&2; exit 2; }
  [[ -f $DIR/hosts.map ]] || { echo "[netns] test bed $ID is not started; run '$0 start'" >&2; exit 2; }
  export DTRAIN_NETNS_DIR="$DIR"
  exec ip netns exec "$(ns_of "${HOSTS[0]}")" unshare --uts -- \
    sh -c 'hostname "$0" && exec "$@"' "${HOSTS[0]}" "$@"
}

case "${1:-}" in
  start) check_prerequisites; start ;;
  stop) check_prerequisites; stop; say "stopped" ;;
  status) check_prerequisites; status ;;
  run) check_prerequisites; shift; run_on_host1 "$@" ;;
  *) echo "usage: $0 start|stop|status|run [--] COMMAND [ARGS...]" >&2; exit 2 ;;
esac
