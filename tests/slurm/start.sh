#!/bin/bash
# Start a local single-host Slurm 22.05 test cluster with fake GPU nodes under $LAB.
#
#   tests/slurm/start.sh [LAB]          (LAB: argument, else $LAB, else /tmp/sailor-slurm-lab)
#   then:  source $LAB/env.sh           (exports SLURM_CONF; every Slurm client needs it)
#
# Cluster "lab": partitions a100 (a100-[1-2], 4 x gpu:a100, 4 CPUs, 4000 MB, default) and
# v100 (v100-[1-2], 8 x gpu:v100, 8 CPUs, 8000 MB); one slurmd per fake node; own munged;
# MariaDB + slurmdbd so that sacct works. Needs root and the packages of tests/slurm/install.sh.
#
# Ports (change them to run a second cluster beside this one):
#   SAILOR_SLURM_PORT_BASE (default 16800) -> slurmctld BASE+17, slurmdbd BASE+19,
#   mariadbd BASE+6, slurmd a100-1/a100-2/v100-1/v100-2 BASE+101..BASE+104.
#   Each can be overridden: SAILOR_SLURMCTLD_PORT, SAILOR_SLURMDBD_PORT, SAILOR_MYSQL_PORT,
#   SAILOR_SLURMD_PORT0 (first slurmd port; the four slurmd use PORT0..PORT0+3).
# Job ids: SAILOR_SLURM_FIRST_JOB_ID (default 1) -> FirstJobId. A job's rendezvous port is base + id % 20000,
#   so a cluster beside this one needs other ids too (tests/slurm/cluster.py gives each lab its own range).
# Stop with tests/slurm/stop.sh LAB (stops only what this script started, by PID).
#
# A second cluster beside a running one (Slurm multi-cluster: one slurmdbd knows both):
#   SAILOR_SLURM_JOIN=FIRST_LAB SAILOR_SLURM_CLUSTER_NAME=lab2 SAILOR_SLURM_PORT_BASE=... start.sh LAB2
# starts only slurmctld and the slurmd of LAB2, using FIRST_LAB's munged and slurmdbd (stop LAB2 first);
# SAILOR_SLURM_PARTITION_SUFFIX=_lab2 names its partitions a100_lab2 and v100_lab2; its job ids start where
# FIRST_LAB's do (ids are per cluster: both clusters' first job has the same id).
set -euo pipefail
L=${1:-${LAB:-/tmp/sailor-slurm-lab}}
case "$L" in /*) ;; *) L=$(pwd)/$L;; esac
case "$L" in *[[:space:]]*) echo "start.sh: ERROR: LAB path must not contain spaces: '$L'" >&2; exit 2;; esac
BASE=${SAILOR_SLURM_PORT_BASE:-16800}
FIRST_JOB_ID=${SAILOR_SLURM_FIRST_JOB_ID:-1}
CTLD_PORT=${SAILOR_SLURMCTLD_PORT:-$((BASE + 17))}
DBD_PORT=${SAILOR_SLURMDBD_PORT:-$((BASE + 19))}
MYSQL_PORT=${SAILOR_MYSQL_PORT:-$((BASE + 6))}
SLURMD_PORT0=${SAILOR_SLURMD_PORT0:-$((BASE + 101))}
CNAME=${SAILOR_SLURM_CLUSTER_NAME:-lab}
PSUF=${SAILOR_SLURM_PARTITION_SUFFIX:-}   # partition names a100$PSUF, v100$PSUF (a site names each once)
JOIN=${SAILOR_SLURM_JOIN:-}
NODES="a100-1 a100-2 v100-1 v100-2"
export SLURM_CONF=$L/etc/slurm.conf
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
unset SLURM_JOB_ID SLURM_JOBID SLURM_CLUSTERS   # when run from inside another job

T0=$(date +%s%N)
ts() { printf '[%5dms] %s\n' $((($(date +%s%N) - T0) / 1000000)) "$*"; }
die() { echo "start.sh: ERROR: $*" >&2; exit 1; }
alive() { [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
dump_logs() {
  for f in "$L"/log/*.log "$L"/mysql/err.log "$L"/munge/munged.log; do
    [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 15 "$f" >&2; }
  done
  return 0
}
STARTED=0
on_exit() {
  local rc=$?
  [ $STARTED = 1 ] && return 0
  [ "$rc" = 0 ] && rc=1
  echo "start.sh: failed (rc=$rc); logs:" >&2; dump_logs
  if [ "${SAILOR_SLURM_KEEP_ON_FAIL:-0}" != 1 ]; then
    echo "start.sh: stopping what was started" >&2
    bash "$(dirname "$0")/stop.sh" "$L" >&2 || true
  fi
  exit $rc
}

[ "$(id -u)" = 0 ] || die "must run as root (mknod of fake GPU devices, daemons running as root)"
for b in munged munge unmunge slurmctld slurmd slurmdbd mariadbd mariadb-install-db mariadb sinfo scontrol sacct sacctmgr; do
  command -v $b >/dev/null 2>&1 || die "'$b' not found; run tests/slurm/install.sh first"
done

# refuse to start twice in the same LAB
if [ -f "$L/pids" ]; then
  while read -r name pid; do
    alive "$pid" && die "cluster in $L already running ($name pid $pid); stop it with tests/slurm/stop.sh $L"
  done < "$L/pids"
fi
# refuse to start on ports that are taken (another cluster?)
port_used() {  # $1 = tcp port; listening sockets from /proc/net/tcp{,6}
  local hex; hex=$(printf '%04X' "$1")
  awk -v h="$hex" 'NR > 1 && $4 == "0A" { split($2, a, ":"); if (a[2] == h) f = 1 } END { exit !f }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
if [ -n "$JOIN" ]; then
  [ -s "$JOIN/etc/slurmdbd.conf" ] && [ -S "$JOIN/munge/munge.socket.2" ] || die "SAILOR_SLURM_JOIN=$JOIN: no running first cluster there"
  DBD_PORT=$(sed -n 's/^DbdPort=//p' "$JOIN/etc/slurmdbd.conf")
  MUNGE_SOCK=$JOIN/munge/munge.socket.2
  FIRST_JOB_ID=$(sed -n 's/^FirstJobId=//p' "$JOIN/etc/slurm.conf")
  FIRST_JOB_ID=${FIRST_JOB_ID:-1}
  OWN_PORTS=""
else
  MUNGE_SOCK=$L/munge/munge.socket.2
  OWN_PORTS="$DBD_PORT $MYSQL_PORT"
fi
case "$FIRST_JOB_ID" in ''|*[!0-9]*|0) die "FirstJobId must be a positive integer, not '$FIRST_JOB_ID'";; esac
for p in $CTLD_PORT $OWN_PORTS $SLURMD_PORT0 $((SLURMD_PORT0 + 1)) $((SLURMD_PORT0 + 2)) $((SLURMD_PORT0 + 3)); do
  port_used $p && die "TCP port $p is already in use (another cluster?); set SAILOR_SLURM_PORT_BASE"
done

trap on_exit EXIT
# empty state every time: a kept StateSaveLocation brings back old jobs/node states,
# a kept MariaDB datadir old accounting rows under the restarted job ids
rm -rf "$L/state" "$L/spool" "$L/log" "$L/run" "$L/mysql" "$L/pids" "$L/env.sh"
# munged wants every directory above its socket searchable by all (e.g. mktemp -d makes 0700)
mkdir -p "$L"; chmod go+rx "$L"
d=$(dirname "$L")
while [ "$d" != / ]; do
  [ "$(( 0$(stat -c %a "$d") & 01 ))" = 1 ] || die "directory $d is not searchable by others (o+x); munged refuses a socket below it: choose another LAB"
  d=$(dirname "$d")
done
mkdir -p "$L/etc" "$L/state" "$L/log" "$L/run" "$L/dev" "$L/shared" "$L/mysql"
for n in $NODES; do mkdir -p "$L/spool/$n"; done
: > "$L/pids"
record() {  # $1 = name, $2 = pid file of a daemon just started: wait for it, note the pid
  local i
  for i in $(seq 1 100); do
    [ -s "$2" ] && { echo "$1 $(cat "$2")" >> "$L/pids"; return 0; }
    sleep 0.05
  done
  die "$1 wrote no pid file $2"
}

# fake GPUs: gres.conf File= must name character devices (no File=: GPUs dropped, node INVAL;
# plain files: no CUDA_VISIBLE_DEVICES)
for i in 0 1 2 3 4 5 6 7; do
  if [ ! -c "$L/dev/nvidia$i" ]; then rm -f "$L/dev/nvidia$i"; mknod "$L/dev/nvidia$i" c 195 $i; fi
done

cat > "$L/etc/slurm.conf" <<CONF
# generated by sailor-hpc tests/slurm/start.sh
ClusterName=$CNAME
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# own munge socket; cred_expire is also the hold time (+1 s) of a requeued job (default 120)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
StateSaveLocation=$L/state
SlurmdSpoolDir=$L/spool/%n
SlurmctldPidFile=$L/run/slurmctld.pid
SlurmdPidFile=$L/run/slurmd-%n.pid
SlurmctldLogFile=$L/log/slurmctld.log
SlurmdLogFile=$L/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# with slurmdbd, AccountingStoragePass names the munge socket used to reach slurmdbd
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu,gres/gpu:a100,gres/gpu:v100
JobCompType=jobcomp/filetxt
JobCompLoc=$L/log/jobcomp.txt
SchedulerType=sched/backfill
# het jobs are only started by the backfill scheduler
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# the fake nodes declare more CPUs/memory than the host has
SlurmdParameters=config_overrides
# a node set DOWN by hand stays DOWN until state=resume
ReturnToService=1
MpiDefault=none
GresTypes=gpu
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
FirstJobId=$FIRST_JOB_ID
Waittime=0
NodeName=a100-[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$((SLURMD_PORT0 + 1))] CPUs=4 RealMemory=4000 Gres=gpu:a100:4 State=UNKNOWN
NodeName=v100-[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((SLURMD_PORT0 + 2))-$((SLURMD_PORT0 + 3))] CPUs=8 RealMemory=8000 Gres=gpu:v100:8 State=UNKNOWN
PartitionName=a100$PSUF Nodes=a100-[1-2] Default=YES MaxTime=INFINITE State=UP
PartitionName=v100$PSUF Nodes=v100-[1-2] MaxTime=INFINITE State=UP
CONF

cat > "$L/etc/gres.conf" <<CONF
NodeName=a100-[1-2] Name=gpu Type=a100 File=$L/dev/nvidia[0-3]
NodeName=v100-[1-2] Name=gpu Type=v100 File=$L/dev/nvidia[0-7]
CONF

cat > "$L/etc/cgroup.conf" <<CONF
CgroupPlugin=autodetect
IgnoreSystemd=yes
CONF

if [ -z "$JOIN" ]; then
# --- munged: own key and socket; the socket dir needs o+x
mkdir -p "$L/munge"; chmod 0755 "$L/munge"
if [ ! -s "$L/munge/munge.key" ]; then
  dd if=/dev/urandom of="$L/munge/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$L/munge/munge.key"
fi
rm -f "$L/munge/munged.pid" "$L/munge/munge.socket.2" "$L/munge/munge.socket.2.lock"
munged --socket="$L/munge/munge.socket.2" --key-file="$L/munge/munge.key" \
       --log-file="$L/munge/munged.log" --pid-file="$L/munge/munged.pid" --seed-file="$L/munge/munged.seed"
record munged "$L/munge/munged.pid"
munge -n --socket="$L/munge/munge.socket.2" | unmunge --socket="$L/munge/munge.socket.2" >/dev/null
ts "munged pid=$(cat "$L/munge/munged.pid")"

# --- MariaDB (no full mariadb-server package: started by hand, does not daemonize)
M=$L/mysql
MYOPTS="--no-defaults --user=root --datadir=$M/data --innodb-log-file-size=8M"
mariadb-install-db $MYOPTS --auth-root-authentication-method=normal --skip-test-db > "$M/install.log" 2>&1 \
  || { tail "$M/install.log" >&2; die "mariadb-install-db failed"; }
ts "mariadb datadir initialised"
setsid -f mariadbd $MYOPTS --socket="$M/mysqld.sock" --pid-file="$M/mysqld.pid" \
    --bind-address=127.0.0.1 --port=$MYSQL_PORT --log-error="$M/err.log" \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 --skip-name-resolve </dev/null >/dev/null 2>&1
ok=0
for i in $(seq 1 200); do
  if [ -s "$M/mysqld.pid" ] && mariadb -S "$M/mysqld.sock" -u root -e 'select 1' >/dev/null 2>&1; then ok=1; break; fi
  sleep 0.05
done
[ $ok = 1 ] || die "mariadbd did not come up"
record mariadbd "$M/mysqld.pid"
mariadb -S "$M/mysqld.sock" -u root -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
ts "mariadbd pid=$(cat "$M/mysqld.pid") port=$MYSQL_PORT"

# --- slurmdbd
cat > "$L/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$L/munge/munge.socket.2
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$L/log/slurmdbd.log
PidFile=$L/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
CONF
chmod 600 "$L/etc/slurmdbd.conf"    # slurmdbd refuses a slurmdbd.conf readable by others
slurmdbd
record slurmdbd "$L/run/slurmdbd.pid"
ok=0
for i in $(seq 1 200); do sacctmgr -n show cluster >/dev/null 2>&1 && { ok=1; break; }; sleep 0.05; done
[ $ok = 1 ] || die "slurmdbd did not answer"
ts "slurmdbd pid=$(cat "$L/run/slurmdbd.pid") port=$DBD_PORT"

fi

# --- slurmctld (registers cluster "lab" with slurmdbd on its first start)
slurmctld
record slurmctld "$L/run/slurmctld.pid"
ok=0
for i in $(seq 1 200); do scontrol ping 2>/dev/null | grep -q 'is UP' && { ok=1; break; }; sleep 0.05; done
[ $ok = 1 ] || die "slurmctld did not come up"
ts "slurmctld pid=$(cat "$L/run/slurmctld.pid") port=$CTLD_PORT"

# --- one slurmd per fake node (-N picks the NodeName; Port/spool/pid/log follow from %n)
for n in $NODES; do
  slurmd -N $n
  record "slurmd-$n" "$L/run/slurmd-$n.pid"
done
ok=0
for i in $(seq 1 300); do
  st=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
  if [ "$(echo "$st" | grep -c -w idle)" = 4 ]; then ok=1; break; fi
  sleep 0.05
done
[ $ok = 1 ] || { sinfo -N -l >&2 || true; sinfo -R >&2 || true; die "nodes not idle"; }
ts "slurmd up: $(echo $NODES)"

# --- accounting reachable (cluster registered, sacct answers)
ok=0
for i in $(seq 1 300); do
  if sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx "$CNAME" && sacct -n -X -j 1 >/dev/null 2>&1; then ok=1; break; fi
  sleep 0.05
done
[ $ok = 1 ] || die "sacct does not answer"
STARTED=1

cat > "$L/env.sh" <<ENV
# generated by sailor-hpc tests/slurm/start.sh; source it to use the cluster in $L
export SLURM_CONF=$L/etc/slurm.conf
export SAILOR_SLURM_LAB=$L
case ":\$PATH:" in *:/usr/sbin:*) ;; *) export PATH=/usr/sbin:\$PATH;; esac
ENV
ts "cluster up in $L: $(sinfo -h -o '%P:%D:%G' | tr '\n' ' ')"
