#!/usr/bin/env bash
# A one-node Slurm cluster on localhost, for developing and testing stool (not for real work).
#
#   bash setup/slurm_local.sh start    install Debian's munge/slurmctld/slurmd if missing, start them
#   bash setup/slurm_local.sh status   is it up? (sinfo, squeue)
#   bash setup/slurm_local.sh stop     stop the daemons (jobs still queued are lost)
#
# Needs root (the daemons run as root: SlurmUser=root) and, for the install, apt-get. The config
# goes to /etc/slurm/slurm.conf, which is where sbatch/squeue/scontrol look; a slurm.conf this
# script did not write is never touched. Process tracking is proctrack/linuxproc and task/none, so
# no cgroups or systemd are needed (containers and CI runners work).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by lingua setup/slurm_local.sh"
STATE=/var/spool/lingua-slurm
LOGS=/var/log/lingua-slurm
NODE=localhost
PARTITION=debug

die() { echo "slurm_local: $*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (the daemons run as SlurmUser=root and write /etc/slurm). \
Run it with sudo, or point the tests at an existing cluster instead."
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "slurmctld/slurmd/munge are not installed and apt-get is \
missing: install Slurm and munge with this system's package manager."
  echo "slurm_local: installing munge, slurmctld, slurmd, slurm-client (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  # The package lists may be missing on a fresh image; update once if the install fails.
  apt-get install -y -qq munge slurmctld slurmd slurm-client >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && apt-get install -y -qq munge slurmctld slurmd slurm-client >/dev/null; }
}

write_config() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to replace it. This machine \
already has a Slurm configuration: use that cluster, or move the file away."
  fi
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$LOGS"
  cat >"$CONF.tmp" <<EOF
$MARK
ClusterName=lingua-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# Quick turnaround for tests: short kill wait, finished jobs forgotten after 5 minutes.
KillWait=5
MinJobAge=300
ReturnToService=2
# The node's declared size is taken as given (containers report odd hardware).
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || \
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- munged
  else
    munged --force
  fi
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start (see /var/log/munge/munged.log)."
}

wait_idle() {
  for _ in $(seq 100); do
    local state
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|allocated*) return 0 ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  die "the node did not come up (state: ${state:-unknown}); see $LOGS/slurmd.log and $LOGS/slurmctld.log."
}

cmd_start() {
  need_root
  install_packages
  write_config
  start_munge
  running "$STATE/slurmctld.pid" || slurmctld
  running "$STATE/slurmd.pid" || slurmd -N "$NODE"
  wait_idle
  echo "slurm_local: up. Partition '$PARTITION' on $NODE with $(nproc) CPUs; config $CONF, logs $LOGS."
}

cmd_stop() {
  for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
    if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done
  for _ in $(seq 50); do
    running "$STATE/slurmd.pid" || running "$STATE/slurmctld.pid" || break
    sleep 0.1
  done
  echo "slurm_local: stopped (munged left running; it is harmless)."
}

cmd_status() {
  if ! command -v sinfo >/dev/null; then echo "slurm_local: not installed"; return 1; fi
  if ! running "$STATE/slurmctld.pid" || ! running "$STATE/slurmd.pid"; then
    echo "slurm_local: down (start it with: bash setup/slurm_local.sh start)"; return 1
  fi
  sinfo
  squeue
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: bash setup/slurm_local.sh start|stop|status" >&2; exit 2 ;;
esac
