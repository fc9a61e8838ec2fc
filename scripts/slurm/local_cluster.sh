#!/usr/bin/env bash
# A real SLURM cluster of two nodes on this one machine, to drill scripts/slurm/train.sbatch as a
# cluster runs it (tests/test_slurm.py; docs/clusters.md#the-slurm-drill). Debian's slurm-wlm and
# munge; one slurmctld and two slurmd, node1 and node2, both on 127.0.0.1 with their own ports.
# Run as root: it installs the packages when missing, starts munged as the munge user, and adds
# node1 and node2 to /etc/hosts (the job script hands the first node's name to the rendezvous).
#   sudo bash scripts/slurm/local_cluster.sh start     # install if needed, configure, start, wait for 2 idle nodes
#   export SLURM_CONF=/tmp/accelerate-recipes-slurm/slurm.conf   # for sbatch, squeue, scontrol, sinfo
#   sudo bash scripts/slurm/local_cluster.sh stop      # stop the daemons, remove the /etc/hosts line
#   bash scripts/slurm/local_cluster.sh status         # exit 0 when both nodes answer
# Everything it writes (slurm.conf, state, spool, logs) is under $LOCAL_SLURM_DIR; it never touches
# /etc/slurm, so a machine's own SLURM configuration is left alone.
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/accelerate-recipes-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${LOCAL_SLURM_PORT:-16817}   # slurmctld; the nodes take the two ports after 17000
HOSTS_MARK="# accelerate-recipes local SLURM cluster"
# SLURM holds a requeued job until the previous run's credentials expire: AuthInfo's cred_expire,
# 120 s by default; the drill's cluster waits 5 s (the least SLURM accepts), and schedules every
# second instead of every minute, so a requeued job starts again within seconds.
CRED_EXPIRE=${LOCAL_SLURM_CRED_EXPIRE:-5}

say() { echo "local_cluster: $*"; }
die() { echo "local_cluster: error: $*" >&2; exit 1; }
# exit code 3: SLURM cannot be had on this machine (the drill's tests skip, saying why)
unavailable() { echo "local_cluster: unavailable: $*" >&2; exit 3; }

install_packages() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    [[ $(id -u) == 0 ]] || unavailable "slurm-wlm and munge are not installed, and installing them needs root"
    command -v apt-get >/dev/null || unavailable "slurm-wlm and munge are not installed, and there is no apt-get"
    say "installing slurm-wlm and munge (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; } \
        || unavailable "apt-get could not install slurm-wlm and munge"
}

start_munge() {
    if munge -n </dev/null >/dev/null 2>&1; then return 0; fi   # a munged answers already
    [[ -s /etc/munge/munge.key ]] || /usr/sbin/mungekey --create >/dev/null   # the package makes one
    mkdir -p /run/munge
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
    die "munged did not start (see /var/log/munge/munged.log)"
}

write_conf() {
    local host
    host=$(hostname -s)
    mkdir -p "$DIR/state" "$DIR/log" "$DIR/spool-node1" "$DIR/spool-node2"
    cat >"$CONF" <<EOF
# Written by scripts/slurm/local_cluster.sh: two nodes on one host, for drills only.
ClusterName=accelerate-recipes-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MailProg=/bin/true
MinJobAge=600
KillWait=30
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
}

add_hosts() {
    grep -qF "$HOSTS_MARK" /etc/hosts || echo "127.0.0.1 node1 node2 $HOSTS_MARK" >>/etc/hosts
}

remove_hosts() {
    if grep -qF "$HOSTS_MARK" /etc/hosts; then
        # /etc/hosts can be a bind mount (containers): rewrite it in place, never replace the file
        local kept
        kept=$(grep -vF "$HOSTS_MARK" /etc/hosts)
        printf '%s\n' "$kept" >/etc/hosts
    fi
}

idle_nodes() { SLURM_CONF=$CONF sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l; }

cmd_start() {
    install_packages
    [[ $(id -u) == 0 ]] || unavailable "starting the cluster needs root (munged runs as the munge user, the daemons as root)"
    if [[ -f $CONF ]] && [[ $(idle_nodes) == 2 ]]; then say "already running; export SLURM_CONF=$CONF"; return 0; fi
    cmd_stop >/dev/null 2>&1 || true
    start_munge
    write_conf
    add_hosts
    rm -rf "$DIR/state"/* "$DIR"/spool-* "$DIR/log"/*   # a fresh cluster: no jobs from an earlier start
    slurmctld -f "$CONF"
    slurmd -f "$CONF" -N node1
    slurmd -f "$CONF" -N node2
    for _ in $(seq 60); do
        if [[ $(idle_nodes) == 2 ]]; then
            say "2 idle nodes (node1, node2); export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    SLURM_CONF=$CONF sinfo -N >&2 || true
    die "the nodes did not come up idle in 30 s; logs in $DIR/log"
}

cmd_stop() {
    local pidfile pid pids=()
    for pidfile in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
        pid=$(cat "$pidfile" 2>/dev/null) || continue   # none, or the daemon removed it meanwhile
        kill "$pid" 2>/dev/null && pids+=("$pid")
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
    rm -f "$DIR"/*.pid
    remove_hosts
    say "stopped (munged left running: other programs may use it)"
}

cmd_status() {
    [[ -f $CONF ]] || die "not configured ($CONF missing): run '$0 start'"
    SLURM_CONF=$CONF sinfo -N
    [[ $(SLURM_CONF=$CONF sinfo -h -N -o %N 2>/dev/null | sort -u | wc -l) == 2 ]]
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
