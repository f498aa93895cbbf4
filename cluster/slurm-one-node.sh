#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for running the workflow through profiles/slurm for real
# (Debian's slurm-wlm and munge; daemons started by hand: no systemd needed). Run as root.
#
#   cluster/slurm-one-node.sh            install (apt) where missing, configure, start; idempotent
#   cluster/slurm-one-node.sh stop       stop the daemons this script started
#
# The node is declared with the sizes profiles/slurm asks of an 8-GPU node (GPUS, CPUS, MEM_MB below):
# SlurmdParameters=config_overrides makes slurmd advertise them whatever the hardware has, so every job is
# submitted and scheduled with the resources the profile declares (sbatch --gpus=8 --cpus-per-task=96
# --mem=512000 for train) and runs on the real 2 cores. GPUs are counted generic resources: SLURM 22.05's
# gres/gpu drops a GPU without File= ("Removing file-less GPU"), so each is a stand-in character device
# (the null device's numbers) under the state folder: SLURM schedules, counts and numbers them
# (CUDA_VISIBLE_DEVICES=0..N-1 in a job); nothing binds a device (no task/cgroup).
# MinJobAge keeps finished jobs visible to squeue/scontrol for an hour: there is no accounting database,
# so the executor plugin queries job states with squeue (--slurm-status-command squeue).
set -euo pipefail

GPUS="${GPUS:-8}"
CPUS="${CPUS:-128}"
MEM_MB="${MEM_MB:-1048576}"
CONF_DIR="${SLURM_CONF_DIR:-/etc/slurm}"
STATE="${SLURM_STATE_DIR:-/var/spool/slurm-one-node}"
LOGS="${SLURM_LOG_DIR:-/var/log/slurm-one-node}"
node="$(hostname -s)"
log() { echo "slurm-one-node: $*" >&2; }

stop() {
    for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$STATE/munged.pid"; do
        if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            kill "$(cat "$pidfile")" && log "stopped $(basename "$pidfile" .pid)"
        fi
        rm -f "$pidfile"
    done
}
if [ "${1:-}" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >&2
fi
mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d" "$LOGS" /run/munge

# munge: a key, and the daemon (as root, --force: /run/munge is root's when no init system set it up).
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chmod 0400 /etc/munge/munge.key
if ! munge -n </dev/null >/dev/null 2>&1; then
    chown root:root /etc/munge/munge.key /run/munge
    munged --force --pid-file="$STATE/munged.pid" 2>>"$LOGS/munged.log" || munged --force
    for _ in $(seq 25); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.2; done
fi

mem_free_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
cat > "$CONF_DIR/slurm.conf" <<CONF
# Written by cluster/slurm-one-node.sh: one node, GPUs counted without devices, sizes from profiles/slurm.
ClusterName=eagle3build
SlurmctldHost=$node
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
GresTypes=gpu
# Host memory: $mem_free_mb MB; the node advertises what the profile's largest jobs ask for.
NodeName=$node CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN
PartitionName=main Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p "$STATE/dev"
for i in $(seq 0 $((GPUS - 1))); do [ -e "$STATE/dev/gpu$i" ] || mknod "$STATE/dev/gpu$i" c 1 3; done
cat > "$CONF_DIR/gres.conf" <<CONF
# Counted GPUs on stand-in device files: scheduling only.
AutoDetect=off
NodeName=$node Name=gpu File=$STATE/dev/gpu[0-$((GPUS - 1))]
CONF

running() { [ -s "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }
if ! running slurmctld; then log "starting slurmctld"; slurmctld -f "$CONF_DIR/slurm.conf"; fi
if ! running slurmd; then log "starting slurmd"; slurmd -f "$CONF_DIR/slurm.conf"; fi
for _ in $(seq 50); do
    state="$(sinfo -h -n "$node" -o %T 2>/dev/null || true)"
    case "$state" in idle*|mixed*|allocated*) break ;; esac
    sleep 0.2
done
scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
sinfo -N -o "%N %T %C %m %G" >&2
