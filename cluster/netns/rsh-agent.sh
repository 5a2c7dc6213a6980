#!/bin/sh
# Stands in for ssh when Open MPI starts its daemons on the netns test bed's "hosts"
# (mpirun --mca plm_rsh_agent cluster/netns/rsh-agent.sh; see testbed.sh beside this file).
#
# usage, as Open MPI calls ssh: rsh-agent.sh [ssh options] HOST COMMAND...
# Like ssh, it joins COMMAND into one line and runs it with sh -c, here inside HOST's network
# namespace with HOST as the hostname. HOST -> namespace comes from $DTRAIN_NETNS_DIR/hosts.map
# (written by testbed.sh start; mpirun inherits DTRAIN_NETNS_DIR from testbed.sh run).
set -eu
# Open MPI may pass ssh options such as -x; skip anything option-like before the host.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "rsh-agent.sh: usage: rsh-agent.sh HOST COMMAND..." >&2; exit 255; }
host="$1"
shift
map="${DTRAIN_NETNS_DIR:?rsh-agent.sh: DTRAIN_NETNS_DIR is not set (use testbed.sh run)}/hosts.map"
ns="$(awk -v h="$host" '$1 == h { print $2 }' "$map")"
[ -n "$ns" ] || { echo "rsh-agent.sh: unknown host '$host' (not in $map)" >&2; exit 255; }
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
