#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, on loopback, for tests and trying the batch
# templates: Debian's slurm-wlm with munge, all state under one directory, run as root.
#
# usage: cluster/slurm/testbed.sh start|stop|status|env
#   start   installs slurm-wlm and munge when missing (apt-get), writes slurm.conf for this
#           machine, starts munged, slurmctld and slurmd, and waits until the node is idle
#   stop    cancels jobs, stops the daemons it started (by their pid files), removes the dir
#   status  daemons and `sinfo`
#   env     prints the variables a shell needs to use it: eval "$(cluster/slurm/testbed.sh env)"
#
# Then, e.g.:
#   eval "$(cluster/slurm/testbed.sh env)"
#   sbatch --wait cluster/slurm/train.sbatch build/bin/train_mlp --steps=50
#
# The node is "localhost" (127.0.0.1) with this machine's CPUs (slurmd -C); one partition
# "debug"; ProctrackType=proctrack/linuxproc, TaskPlugin=task/none (no cgroups needed);
# no accounting. Ports 16817 (slurmctld) and 16818 (slurmd) unless set; munge has its own
# key and socket, so an installed Slurm or munge of the machine is not touched.
#
# Environment: DTRAIN_SLURM_DIR (default /tmp/dtrain-slurm), DTRAIN_SLURM_CTLD_PORT,
# DTRAIN_SLURM_SLURMD_PORT, DTRAIN_SLURM_NO_INSTALL=1 (never run apt-get).
# Exit status 77 means "no Slurm test bed here" with the reason printed (not root, packages
# cannot be installed, a daemon does not start); 1 for other failures.
set -uo pipefail
BASE="${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}"
CTLD_PORT="${DTRAIN_SLURM_CTLD_PORT:-16817}"
SLURMD_PORT="${DTRAIN_SLURM_SLURMD_PORT:-16818}"
CONF="$BASE/etc/slurm.conf"
MUNGE_SOCKET="$BASE/munge/munge.socket"
START_TIMEOUT_S=60

say() { echo "[slurm] $*"; }
cannot() {
  echo "[slurm] no Slurm test bed here: $*" >&2
  [[ -d $BASE/log ]] && tail -n 5 "$BASE"/log/*.log >&2 2>/dev/null
  exit 77
}

find_daemon() {  # slurmctld and slurmd live in /usr/sbin, which a non-login PATH may lack
  command -v "$1" 2>/dev/null || { [[ -x /usr/sbin/$1 ]] && echo "/usr/sbin/$1"; }
}

install_packages() {
  local missing=()
  for tool in munged slurmctld slurmd sbatch; do
    [[ -n $(find_daemon "$tool") ]] || missing+=("$tool")
  done
  ((${#missing[@]} == 0)) && return 0
  [[ ${DTRAIN_SLURM_NO_INSTALL:-0} == 1 ]] &&
    cannot "${missing[*]} not installed and DTRAIN_SLURM_NO_INSTALL=1"
  command -v apt-get >/dev/null || cannot "${missing[*]} not installed and no apt-get here"
  say "installing slurm-wlm and munge (apt-get; a minute)"
  export DEBIAN_FRONTEND=noninteractive
  # The packages' own services are not wanted: policy-rc.d stops them starting on install.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
  fi
  local ok=1
  apt-get update -qq >/dev/null 2>&1 || ok=0
  if ((ok)); then
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 || ok=0
  fi
  ((created_policy)) && rm -f "$policy"
  ((ok)) || cannot "apt-get install slurm-wlm munge failed (no network or no apt sources?)"
  for tool in munged slurmctld slurmd sbatch; do
    [[ -n $(find_daemon "$tool") ]] || cannot "$tool still missing after installing slurm-wlm"
  done
}

# "NodeName=... CPUs=... Boards=... RealMemory=..." as slurmd sees this machine.
node_line() {
  local hw
  hw="$("$(find_daemon slurmd)" -C 2>/dev/null | head -n 1)"
  [[ $hw == NodeName=* ]] || hw="NodeName=x CPUs=$(nproc)"
  # Our name and address; memory is not scheduled (CR_CPU), so leave RealMemory out.
  hw="$(sed -E 's/^NodeName=[^ ]+/NodeName=localhost NodeAddr=127.0.0.1/; s/ RealMemory=[0-9]+//' <<< "$hw")"
  echo "$hw State=UNKNOWN"
}

write_config() {
  mkdir -p "$BASE"/{etc,state,spool,log,run,munge}
  chmod 700 "$BASE/munge"
  dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$BASE/munge/munge.key"
  cat > "$CONF" <<EOF
# Written by cluster/slurm/testbed.sh for this machine; removed by 'testbed.sh stop'.
ClusterName=dtrain-testbed
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
$(node_line)
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

env_lines() {
  echo "export SLURM_CONF='$CONF'"
  # Clients find slurmctld and munge through slurm.conf; sbin for scontrol's friends.
  [[ :$PATH: == *:/usr/sbin:* ]] || echo "export PATH=\"\$PATH:/usr/sbin\""
}

wait_idle() {
  local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
  while ((SECONDS < deadline)); do
    state="$(SLURM_CONF="$CONF" sinfo -h -n localhost -o %t 2>/dev/null | head -n 1)"
    [[ $state == idle ]] && return 0
    sleep 0.5
  done
  cannot "node not idle after ${START_TIMEOUT_S}s (state '${state:-unknown}')"
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  [[ $(id -u) == 0 ]] || cannot "the test bed runs its daemons as root (running as uid $(id -u))"
  install_packages
  if pid_alive "$BASE/run/slurmctld.pid"; then
    say "already running (stop it first to restart)"
    return 0
  fi
  stop quiet
  write_config
  "$(find_daemon munged)" --key-file="$BASE/munge/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$BASE/run/munged.pid" --log-file="$BASE/log/munged.log" \
    --seed-file="$BASE/munge/munged.seed" --force >/dev/null 2>&1 ||
    cannot "munged did not start"
  for _ in $(seq 50); do [[ -S $MUNGE_SOCKET ]] && break; sleep 0.1; done
  [[ -S $MUNGE_SOCKET ]] || cannot "munged socket $MUNGE_SOCKET did not appear"
  # -c: clear any old state; -i: ignore state errors.
  "$(find_daemon slurmctld)" -f "$CONF" -c -i >/dev/null 2>&1 || cannot "slurmctld did not start"
  "$(find_daemon slurmd)" -f "$CONF" -N localhost >/dev/null 2>&1 || cannot "slurmd did not start"
  wait_idle
  say "up: node localhost idle ($(SLURM_CONF="$CONF" sinfo -h -n localhost -o '%c CPUs'))"
  say "use it with: eval \"\$($0 env)\""
}

stop() {
  if pid_alive "$BASE/run/slurmctld.pid"; then
    local jobs
    jobs="$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null)"
    if [[ -n $jobs ]]; then
      # shellcheck disable=SC2086
      SLURM_CONF="$CONF" scancel $jobs 2>/dev/null
      for _ in $(seq 50); do
        [[ -z $(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null) ]] && break
        sleep 0.2
      done
    fi
  fi
  local pids=()
  for daemon in slurmd slurmctld munged; do
    pid_alive "$BASE/run/$daemon.pid" && pids+=("$(cat "$BASE/run/$daemon.pid")")
  done
  if ((${#pids[@]})); then
    kill -TERM "${pids[@]}" 2>/dev/null
    for _ in $(seq 50); do
      local alive=0
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null
  fi
  rm -rf "$BASE"
  [[ ${1:-} == quiet ]] || say "stopped"
}

status() {
  local up=0
  for daemon in munged slurmctld slurmd; do
    if pid_alive "$BASE/run/$daemon.pid"; then
      say "$daemon: running (pid $(cat "$BASE/run/$daemon.pid"))"
      up=$((up + 1))
    else
      say "$daemon: not running"
    fi
  done
  ((up == 3)) && SLURM_CONF="$CONF" sinfo
  ((up == 3))
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) env_lines ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
