#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for workshops and for the tests: two nodes (n1, n2), two fake
# GPUs each, one partition. Needs root and Debian's Slurm packages (`install` gets them).
#
#   sudo slurm/local_cluster.sh install    # apt-get the packages (once)
#   sudo slurm/local_cluster.sh up         # start it; then: export SLURM_CONF=<the path it prints>
#   slurm/local_cluster.sh status
#   sudo slurm/local_cluster.sh down       # stop it and undo every change it made; safe to run twice
#
# What `up` changes on the machine, and `down` removes again: two lines in /etc/hosts (marked with
# "ddp-steps-local-cluster"), and the folder $DDP_STEPS_SLURM_DIR (default /tmp/ddp-steps-slurm) holding the
# configuration, state, logs, pid files and the fake GPU device files. No system-wide Slurm configuration is
# touched: clients find this cluster through SLURM_CONF.
set -euo pipefail

DIR=${DDP_STEPS_SLURM_DIR:-/tmp/ddp-steps-slurm}
CONF=$DIR/slurm.conf
TAG="# ddp-steps-local-cluster"
NODES=(n1 n2)
declare -A ADDRESS=([n1]=127.0.1.1 [n2]=127.0.1.2) PORT=([n1]=17001 [n2]=17002)
PACKAGES=(slurmctld slurmd slurm-client shellcheck)

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (it starts daemons and edits /etc/hosts): sudo $0 $1"; }

need_slurm() {
    local missing=()
    for tool in slurmctld slurmd sbatch scontrol unshare; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    [ ${#missing[@]} -eq 0 ] || die "missing ${missing[*]}: install Debian's Slurm with: sudo $0 install"
}

write_config() {
    mkdir -p "$DIR"/{state,log,dev} "${NODES[@]/#/$DIR/spool/}"
    local controller
    controller=$(hostname -s)
    cat > "$CONF" <<EOF
ClusterName=ddpsteps
SlurmctldHost=$controller(127.0.0.1)
SlurmctldPort=16817
# No munge: credentials are not checked (fine on one machine you own; never on a shared one).
AuthType=auth/none
CredType=cred/none
SlurmUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# pgid: a job's background processes end with the job (linuxproc let them outlive it)
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
# both "nodes" share this machine: trust the CPUs and memory declared below, not what slurmd detects
SlurmdParameters=config_overrides
ReturnToService=2
# fast turnaround: finished jobs leave the queue after 4 s, requeued jobs restart within seconds
MinJobAge=4
AuthInfo=cred_expire=10
SchedulerParameters=bf_interval=2,sched_interval=5
# job ids start somewhere new each time: logs in slurm/logs/ from an earlier cluster are never overwritten
FirstJobId=$(( $(date +%s) % 100000 * 10 + 1 ))
GresTypes=gpu
NodeName=n1 NodeAddr=${ADDRESS[n1]} Port=${PORT[n1]} CPUs=2 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
NodeName=n2 NodeAddr=${ADDRESS[n2]} Port=${PORT[n2]} CPUs=2 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    # Fake GPUs: Slurm only needs device files to hand out (the same device as /dev/null). Jobs get
    # CUDA_VISIBLE_DEVICES, and PyTorch, finding no real GPU, runs on the CPU.
    : > "$DIR/gres.conf"
    for node in "${NODES[@]}"; do
        for gpu in 0 1; do
            [ -e "$DIR/dev/$node-gpu$gpu" ] || mknod "$DIR/dev/$node-gpu$gpu" c 1 3
        done
        echo "NodeName=$node Name=gpu File=$DIR/dev/$node-gpu[0-1]" >> "$DIR/gres.conf"
    done
}

add_hosts() {  # node names must resolve, to addresses slurmctld and the other node can reach
    for node in "${NODES[@]}"; do
        grep -q "^${ADDRESS[$node]} $node $TAG\$" /etc/hosts || echo "${ADDRESS[$node]} $node $TAG" >> /etc/hosts
    done
}

remove_hosts() {
    # /etc/hosts may be a bind mount (containers): rewrite it in place rather than replacing the file
    if grep -q "$TAG" /etc/hosts 2>/dev/null; then
        local kept
        kept=$(grep -v "$TAG" /etc/hosts)
        printf '%s\n' "$kept" > /etc/hosts
    fi
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$(cat "$1")/status" 2>/dev/null; }

stop_pidfile() {
    local pidfile=$1 pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do running "$pidfile" || break; sleep 0.1; done  # a zombie counts as gone
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

up() {
    need_root up
    need_slurm
    running "$DIR/slurmctld.pid" && { echo "already up"; status; return 0; }
    write_config
    add_hosts
    export SLURM_CONF=$CONF
    slurmctld
    for node in "${NODES[@]}"; do
        # each slurmd in its own UTS namespace, so the jobs it runs see `hostname` = n1 or n2
        unshare --uts sh -c "hostname $node && exec slurmd -N $node"
    done
    for _ in $(seq 100); do
        [ "$(sinfo -h -o '%T' 2>/dev/null | grep -c idle)" -ge 1 ] && \
            [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle')" -eq ${#NODES[@]} ] && break
        sleep 0.2
    done
    sinfo -h -N -o '%N %T' | grep -q "n2 idle" || { tail -5 "$DIR"/log/*.log >&2; die "nodes did not come up"; }
    echo "local Slurm cluster up: nodes ${NODES[*]}, 2 fake GPUs each. Use it with:"
    echo "  export SLURM_CONF=$CONF"
}

down() {
    need_root down
    if command -v scancel >/dev/null && [ -f "$CONF" ] && running "$DIR/slurmctld.pid"; then
        SLURM_CONF=$CONF scancel --quiet --user=root 2>/dev/null || true
    fi
    for node in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$node.pid"; done
    stop_pidfile "$DIR/slurmctld.pid"
    remove_hosts
    rm -rf "$DIR"
    echo "local Slurm cluster down; nothing of it is left"
}

status() {
    if [ -f "$CONF" ] && running "$DIR/slurmctld.pid"; then
        SLURM_CONF=$CONF sinfo -N -o '%N %T %G'
        SLURM_CONF=$CONF squeue
        echo "export SLURM_CONF=$CONF"
    else
        echo "not running"
        return 3
    fi
}

install() {
    need_root install
    command -v apt-get >/dev/null || die "install needs apt-get (Debian/Ubuntu); elsewhere install Slurm yourself"
    # policy: Debian starts no daemon here, and we start ours by hand with our own configuration
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
}

case "${1:-}" in
    up|down|status|install) "$1" ;;
    *) echo "usage: $0 install|up|down|status" >&2; exit 2 ;;
esac
