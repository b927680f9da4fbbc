#!/bin/bash
# Install the Debian packages needed for the local test Slurm cluster (tests/slurm/start.sh), and
# Charliecloud's ch-run, the container runtime the container jobs' tests run ranks in.
# Idempotent: a fast no-op when everything is already installed. Needs root (apt-get).
set -euo pipefail
PKGS="slurmctld slurmd slurm-client munge slurmdbd mariadb-server-core mariadb-client-core charliecloud-runtime"
# binaries that must exist afterwards (checked before and after installing)
BINS="slurmctld slurmd sinfo scontrol sbatch srun squeue sacct sacctmgr scancel munged munge unmunge slurmdbd mariadbd mariadb-install-db mariadb my_print_defaults ch-run"

missing_pkgs() {
  local p out=""
  for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || out="$out $p"
  done
  echo "$out"
}
missing_bins() {
  local b out=""
  for b in $BINS; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || [ -x "/usr/bin/$b" ] || out="$out $b"
  done
  echo "$out"
}

if ! command -v dpkg-query >/dev/null 2>&1; then
  # not a Debian-like system: accept a Slurm that is already installed some other way
  m=$(missing_bins)
  [ -z "$m" ] && { echo "install.sh: no dpkg, but all needed binaries present"; exit 0; }
  echo "install.sh: ERROR: no dpkg/apt on this machine and missing binaries:$m" >&2
  exit 2
fi

need=$(missing_pkgs)
if [ -z "$need" ]; then
  echo "install.sh: slurm packages already installed"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install.sh: ERROR: packages missing:$need; installing them needs root (apt-get). Run as root or install them by hand." >&2
  exit 3
fi
command -v apt-get >/dev/null 2>&1 || { echo "install.sh: ERROR: packages missing:$need and no apt-get" >&2; exit 2; }

export DEBIAN_FRONTEND=noninteractive
echo "install.sh: installing:$need"
# The packages' maintainer scripts would start system-wide munge/slurm daemons (via invoke-rc.d)
# on a machine without a policy-rc.d; we run our own daemons, so deny that for the install only.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\n# temporary, from sailor-hpc tests/slurm/install.sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 0755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
# update only when the lists don't know the packages (or are empty)
if ! apt-get install -y --no-install-recommends --dry-run $need >/dev/null 2>&1; then
  apt-get update -q || { echo "install.sh: ERROR: apt-get update failed" >&2; exit 4; }
fi
if ! apt-get install -y -q --no-install-recommends $need; then
  echo "install.sh: apt-get install failed, retrying after apt-get update" >&2
  apt-get update -q || { echo "install.sh: ERROR: apt-get update failed" >&2; exit 4; }
  apt-get install -y -q --no-install-recommends $need || { echo "install.sh: ERROR: apt-get install failed:$need" >&2; exit 5; }
fi
m=$(missing_bins)
[ -z "$m" ] || { echo "install.sh: ERROR: installed, but binaries still missing:$m" >&2; exit 6; }
echo "install.sh: done"
