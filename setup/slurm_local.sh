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
#
# Accounting, so that `sacct` works as on a real cluster: slurmdbd over a MariaDB server (Debian's
# mariadb-server and slurmdbd, about 20 s to install; the database listens on its Unix socket
# only). Slurm 22.05 has no file-based accounting storage (accounting_storage/filetxt is gone), so
# a database server is the only way. LINGUA_SLURM_ACCOUNTING=0, or a failed install, leaves it out;
# finished jobs are then in the job completion log ($LOGS/jobcomp.log, `sacct --completion`),
# which is written either way.
#
# start is idempotent: daemons already running are left alone, unless the config changed, in
# which case they are restarted to apply it (queued and running jobs survive a restart).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
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

mariadbd_bin() { command -v mariadbd || command -v mysqld || ls /usr/sbin/mariadbd 2>/dev/null || true; }

# Sets ACCOUNTING=slurmdbd when slurmdbd and MariaDB are installed (installing them if needed),
# else ACCOUNTING=none with a warning: the cluster works without them, only sacct does not.
install_accounting() {
  ACCOUNTING=none
  if [ "${LINGUA_SLURM_ACCOUNTING:-1}" = "0" ]; then
    echo "slurm_local: LINGUA_SLURM_ACCOUNTING=0: no accounting (sacct --completion reads the job completion log)"
    return
  fi
  if ! command -v slurmdbd >/dev/null || [ -z "$(mariadbd_bin)" ]; then
    if command -v apt-get >/dev/null; then
      echo "slurm_local: installing mariadb-server, slurmdbd (Debian packages) for sacct"
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -qq --no-install-recommends mariadb-server slurmdbd >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 \
             && apt-get install -y -qq --no-install-recommends mariadb-server slurmdbd >/dev/null 2>&1; } \
        || true
    fi
  fi
  if command -v slurmdbd >/dev/null && [ -n "$(mariadbd_bin)" ]; then
    ACCOUNTING=slurmdbd
  else
    echo "slurm_local: warning: slurmdbd or mariadb-server is missing and could not be installed: \
no accounting, so plain sacct fails; sacct --completion reads the job completion log." >&2
  fi
}

refuse_foreign() {
  if [ -f "$1" ] && ! grep -qF "$MARK" "$1"; then
    die "$1 exists and was not written by this script; refusing to replace it. This machine \
already has a Slurm configuration: use that cluster, or move the file away."
  fi
}

install_file() {
  if [ -f "$1" ] && cmp -s "$1.tmp" "$1"; then rm -f "$1.tmp"; else mv "$1.tmp" "$1"; fi
}

# The config the running daemons were started with is recorded once they are up, so that a start
# that failed half-way (or an older version of this script) still gets its daemons restarted.
config_hash() { cat "$CONF" "$DBD_CONF" 2>/dev/null | sha256sum | cut -d' ' -f1; }
APPLIED=$STATE/applied-config.sha256

accounting_lines() {
  if [ "$ACCOUNTING" = slurmdbd ]; then
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=$NODE"
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi
}

# Whole CPUs of this process's cgroup CPU quota (v2 cpu.max, else v1 cfs_quota_us); nothing when
# there is no quota.
cgroup_cpu_quota() {
  local path quota="" period=""
  path=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup 2>/dev/null || true)
  if [ -r "/sys/fs/cgroup$path/cpu.max" ]; then
    read -r quota period <"/sys/fs/cgroup$path/cpu.max" || true
  else
    path=$(awk -F: '$2 ~ /(^|,)cpu(,|$)/ {print $3}' /proc/self/cgroup 2>/dev/null || true)
    quota=$(cat "/sys/fs/cgroup/cpu$path/cpu.cfs_quota_us" 2>/dev/null || true)
    period=$(cat "/sys/fs/cgroup/cpu$path/cpu.cfs_period_us" 2>/dev/null || true)
  fi
  case "$quota" in ''|*[!0-9]*) return 0 ;; esac   # "max", -1 or unreadable: no quota
  case "$period" in ''|0|*[!0-9]*) return 0 ;; esac
  echo $(( quota / period ))
}

# The CPUs this machine gives its jobs: the affinity mask (nproc, with the OpenMP variables
# unset: nproc obeys OMP_NUM_THREADS, a per-program setting, not the machine's size), or fewer
# where a cgroup quota allows less, so the node never claims CPUs its jobs cannot have.
usable_cpus() {
  local cpus quota
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  quota=$(cgroup_cpu_quota)
  if [ -n "$quota" ] && [ "$quota" -lt "$cpus" ]; then cpus=$quota; fi
  echo $(( cpus > 0 ? cpus : 1 ))
}

write_config() {
  refuse_foreign "$CONF"
  refuse_foreign "$DBD_CONF"
  local cpus mem
  # One CPU more than the machine gives: a fault-tolerant stool run's lighthouse job (one CPU,
  # asleep in a poll) runs beside its replica groups, which must all run at once or wait in
  # their first quorum; on 2 CPUs two one-CPU groups would leave it no room.
  cpus=$(( $(usable_cpus) + 1 ))
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
# The scheduler's pass every 2 s, not 60: a requeued or released job starts within seconds.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
$(accounting_lines)
# Every finished job gets a line here, with or without accounting (sacct --completion reads it).
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGS/jobcomp.log
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
  install_file "$CONF"
  [ "$ACCOUNTING" = slurmdbd ] || return 0
  # The database is MariaDB's, on its Unix socket: root connects there without a password
  # (Debian's unix_socket authentication), so this file holds no secret. slurmdbd wants it 600.
  (umask 077; cat >"$DBD_CONF.tmp" <<EOF
$MARK
AuthType=auth/munge
DbdHost=$NODE
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=lingua_slurm_acct_db
PidFile=$STATE/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
EOF
  )
  install_file "$DBD_CONF"
}

# Is the daemon of this pid file alive? (A daemon removes its pid file as it exits; a zombie left
# to an init that does not reap counts as gone.)
running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null \
    && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

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

db_alive() { { command -v mariadb-admin >/dev/null && mariadb-admin ping >/dev/null 2>&1; } \
  || { command -v mysqladmin >/dev/null && mysqladmin ping >/dev/null 2>&1; }; }

# MariaDB as installed (Debian's datadir, socket /run/mysqld/mysqld.sock), no TCP port. One that
# already answers there (started by systemd, say) is used as it is.
start_mariadb() {
  db_alive && return
  if [ ! -d /var/lib/mysql/mysql ]; then
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOGS/mariadb-install.log" 2>&1 \
      || die "could not create MariaDB's database (see $LOGS/mariadb-install.log)."
  fi
  # It runs as the mysql user: its socket, pid file and log must be that user's to write.
  mkdir -p /run/mysqld "$STATE/mariadb"
  touch "$LOGS/mariadb.log"
  chown mysql:mysql /run/mysqld "$STATE/mariadb" "$LOGS/mariadb.log" 2>/dev/null || true
  nohup "$(mariadbd_bin)" --user=mysql --skip-networking --pid-file="$STATE/mariadb/mariadb.pid" \
    --log-error="$LOGS/mariadb.log" >/dev/null 2>&1 &
  for _ in $(seq 150); do db_alive && return; sleep 0.2; done
  die "MariaDB did not start (see $LOGS/mariadb.log); LINGUA_SLURM_ACCOUNTING=0 runs without it."
}

start_slurmdbd() {
  if [ "$CHANGED" = 1 ]; then stop_daemon "$STATE/slurmdbd.pid"; fi
  running "$STATE/slurmdbd.pid" || slurmdbd
  for _ in $(seq 100); do
    sacctmgr -n show cluster >/dev/null 2>&1 && break
    sleep 0.2
  done
  sacctmgr -n show cluster >/dev/null 2>&1 || die "slurmdbd did not answer (see $LOGS/slurmdbd.log)."
  # The cluster must be known to the database before slurmctld registers with it.
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx lingua-local; then
    sacctmgr -i add cluster lingua-local >/dev/null
  fi
}

stop_daemon() {
  running "$1" || return 0
  kill "$(cat "$1" 2>/dev/null)" 2>/dev/null || true
  for _ in $(seq 100); do running "$1" || return 0; sleep 0.1; done
  die "the daemon of $1 did not stop."
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
  install_accounting
  write_config
  CHANGED=0
  [ "$(config_hash)" = "$(cat "$APPLIED" 2>/dev/null)" ] || CHANGED=1
  start_munge
  if [ "$ACCOUNTING" = slurmdbd ]; then
    start_mariadb
    start_slurmdbd
  else
    stop_daemon "$STATE/slurmdbd.pid"
  fi
  if [ "$CHANGED" = 1 ]; then  # a new config: restart what runs with the old one
    stop_daemon "$STATE/slurmd.pid"
    stop_daemon "$STATE/slurmctld.pid"
  fi
  running "$STATE/slurmctld.pid" || slurmctld
  running "$STATE/slurmd.pid" || slurmd -N "$NODE"
  wait_idle
  config_hash >"$APPLIED"
  local acct="sacct works (accounting in slurmdbd)"
  [ "$ACCOUNTING" = slurmdbd ] || acct="no accounting: finished jobs are in $LOGS/jobcomp.log (sacct --completion)"
  echo "slurm_local: up. Partition '$PARTITION' on $NODE with $(usable_cpus) CPUs (+1 declared); $acct;" \
    "config $CONF, logs $LOGS."
}

cmd_stop() {
  for pidfile in slurmd.pid slurmctld.pid slurmdbd.pid mariadb/mariadb.pid; do
    stop_daemon "$STATE/$pidfile"
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
