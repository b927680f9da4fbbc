#!/bin/bash
# Stop the local test Slurm cluster that tests/slurm/start.sh started under $LAB.
#
#   tests/slurm/stop.sh [LAB]        (LAB: argument, else $LAB, else /tmp/sailor-slurm-lab)
#
# Only processes of THIS cluster are touched, by PID (from $LAB/pids and the daemons' pid files,
# each checked against its command line) - never by name: other clusters may run beside it.
# Order matters: job steps (slurmstepd) survive a stopped slurmd, so all jobs are cancelled
# first, while slurmctld and the slurmd are still up.
set -uo pipefail
L=${1:-${LAB:-/tmp/sailor-slurm-lab}}
case "$L" in /*) ;; *) L=$(pwd)/$L;; esac
export SLURM_CONF=$L/etc/slurm.conf
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
unset SLURM_JOB_ID SLURM_JOBID SLURM_CLUSTERS
T0=$(date +%s%N)
ts() { printf '[%5dms] %s\n' $((($(date +%s%N) - T0) / 1000000)) "$*"; }

[ -d "$L" ] || { echo "stop.sh: no lab directory $L, nothing to stop"; exit 0; }

alive() { [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
# a pid is ours if its command line names the daemon AND it uses this lab (guards against a
# stale pid file whose PID was reused)
ours() {  # $1 = pid, $2 = daemon name
  local cmd; cmd=$(tr '\0' ' ' 2>/dev/null < "/proc/$1/cmdline") || return 1
  case "$cmd" in *"$2"*) ;; *) return 1;; esac
  case "$2" in
    munged|mariadbd) case "$cmd" in *"$L/"*) return 0;; *) return 1;; esac;;
    *) tr '\0' '\n' 2>/dev/null < "/proc/$1/environ" | grep -qxF "SLURM_CONF=$SLURM_CONF";;
  esac
}
stop_pid() {  # $1 = label, $2 = pid, $3 = daemon name; TERM, wait up to 15 s, then KILL
  local pid=$2 i
  alive "$pid" && ours "$pid" "$3" || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 1 300); do alive "$pid" || break; sleep 0.05; done
  if alive "$pid"; then echo "stop.sh: $1 pid=$pid alive after 15 s -> KILL"; kill -KILL "$pid" 2>/dev/null; fi
  ts "stopped $1 pid=$pid"
}
# daemons of this lab: "label pid daemon" from $LAB/pids, plus the pid files (a start.sh that
# died half-way may not have recorded everything)
declare -A PID
if [ -f "$L/pids" ]; then
  while read -r name pid; do [ -n "$name" ] && PID[$name]=$pid; done < "$L/pids"
fi
pf() { [ -s "$2" ] && [ -z "${PID[$1]:-}" ] && PID[$1]=$(cat "$2"); return 0; }
pf munged "$L/munge/munged.pid"
pf mariadbd "$L/mysql/mysqld.pid"
pf slurmdbd "$L/run/slurmdbd.pid"
pf slurmctld "$L/run/slurmctld.pid"
for f in "$L"/run/slurmd-*.pid; do [ -e "$f" ] && pf "$(basename "$f" .pid)" "$f"; done

# 1. cancel all jobs while the controller and the slurmd are up, wait for them to go
if [ -n "${PID[slurmctld]:-}" ] && alive "${PID[slurmctld]}" && [ -f "$SLURM_CONF" ]; then
  ids=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${ids// /}" ]; then
    ts "cancelling jobs: $ids"
    timeout 10 scancel $ids 2>/dev/null
    for i in $(seq 1 300); do   # up to 15 s (KillWait=5)
      [ -z "$(timeout 5 squeue -h -t all -o '%A %T' 2>/dev/null | grep -vwE 'CANCELLED|COMPLETED|FAILED|TIMEOUT|PREEMPTED|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE')" ] && break
      sleep 0.05
    done
  fi
fi

# 2. the slurmd
for name in "${!PID[@]}"; do
  case "$name" in slurmd-*) stop_pid "$name" "${PID[$name]}" slurmd;; esac
done

# 3. safety net: job steps / job processes of this cluster that are still alive (their
#    environment carries our SLURM_CONF; job processes also a SLURM_JOB_ID)
me_and_parents=" $$ "
p=$$
while [ "$p" -gt 1 ] 2>/dev/null; do
  p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null) || break
  [ -n "$p" ] || break
  me_and_parents="$me_and_parents$p "
done
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  case "$me_and_parents" in *" $p "*) continue;; esac
  env=$(tr '\0' '\n' 2>/dev/null < "$d/environ") || continue
  grep -qxF "SLURM_CONF=$SLURM_CONF" <<< "$env" || continue
  comm=$(cat "$d/comm" 2>/dev/null)
  if [ "$comm" = slurmstepd ] || grep -q '^SLURM_JOB_ID=' <<< "$env"; then
    alive "$p" || continue
    echo "stop.sh: leftover $comm pid=$p -> KILL"; kill -KILL "$p" 2>/dev/null
  fi
done

# 4. controller, accounting, database, munge
[ -n "${PID[slurmctld]:-}" ] && stop_pid slurmctld "${PID[slurmctld]}" slurmctld
[ -n "${PID[slurmdbd]:-}" ] && stop_pid slurmdbd "${PID[slurmdbd]}" slurmdbd
[ -n "${PID[mariadbd]:-}" ] && stop_pid mariadbd "${PID[mariadbd]}" mariadbd
[ -n "${PID[munged]:-}" ] && stop_pid munged "${PID[munged]}" munged

# anything left?
left=""
for name in "${!PID[@]}"; do alive "${PID[$name]}" && ours "${PID[$name]}" "${name%%-*}" && left="$left $name=${PID[$name]}"; done
rm -f "$L"/run/*.pid "$L/munge/munged.pid" "$L/mysql/mysqld.pid"
if [ -n "$left" ]; then echo "stop.sh: ERROR: still alive:$left" >&2; exit 1; fi
: > "$L/pids"
ts "stopped cluster in $L"
