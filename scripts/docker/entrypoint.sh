#!/usr/bin/env bash
# The image's entry point, under `tini -g` (PID 1): `accelerate launch "$@"`, then wait for any
# worker the launcher leaves behind, so that a preempted run can finish its checkpoint; a preempted
# run that saved ends the container with the recipe's code 75 (EX_TEMPFAIL, "requeue me").
#
# Why not `tini -g -- accelerate launch` directly: a container ends when PID 1 exits, tini exits as
# soon as its own child does, and the kernel then SIGKILLs whatever is left. With one process,
# `accelerate launch` is a plain parent that dies at once on SIGTERM, while its worker is still
# saving: tried in a PID namespace with tini 0.19 and train.py, the worker got the signal and was
# killed before it wrote anything. With several processes torchelastic waits for its workers
# (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and this script changes nothing there.
#
# Signals: `tini -g` delivers them to this whole process group: this script (which survives them),
# the launcher and a 1-process worker. torchelastic's workers live in sessions of their own and get
# the signal from torchelastic, which forwards SIGUSR1 only when PET_SIGNALS_TO_HANDLE names it (the
# image sets it).
#
# The exit code. A preempted worker exits 75, but that code never reaches this script: a 1-process
# launcher is killed by the signal itself (status 143 for SIGTERM, 138 for SIGUSR1) and its orphaned
# worker is reaped by tini, not by us; torchelastic turns any worker failure into 1. What does
# survive is the recipe's contract with schedulers (train_extras/resume/preemption.py): rank 0 holds
# `<output_dir>/.run.lock` open while it runs and writes `<output_dir>/requeue.json` after the
# preemption checkpoint. So when a signal arrives, this script reads the run folders off the open
# `.run.lock` files of its own processes (descendants and process group, from /proc), and at the
# end: the launcher failed, and one of those folders holds a requeue.json no older than its
# .run.lock (which the run stamps when it claims the folder: both times come from the same file
# system's clock) -> exit 75. Anything else (a clean run, a crash, a signal before the run had
# claimed its folder, a run that could not save, a marker left by an earlier run) keeps the
# launcher's own status.
set -uo pipefail

# The folders of the runs this container started, found while they run.
run_dirs=()

# "pid state ppid pgrp" of every process, from /proc, into the array `table`. In this shell, not
# in a $(...) or <(...) subshell, which would itself count as a live member of the group.
read_processes() {
    local file pid stat state ppid pgrp
    table=()
    for file in /proc/[0-9]*/stat; do
        pid=${file#/proc/}
        pid=${pid%/stat}
        { read -r stat <"$file"; } 2>/dev/null || continue  # the process ended meanwhile
        read -r state ppid pgrp _ <<<"${stat##*) }"
        table+=("$pid $state $ppid $pgrp")
    done
}

find_run_dirs() {  # add the folder of every .run.lock that one of our processes holds open
    local -A ours=(["$$"]=1)
    local row pid ppid pgrp grown=1 lock dir known
    read_processes
    # Ours: this script's descendants (torchelastic's workers too, in sessions of their own) and
    # the members of its process group (a 1-process worker whose launcher died and left it to tini).
    while ((grown)); do
        grown=0
        for row in "${table[@]}"; do
            read -r pid _ ppid pgrp <<<"$row"
            if [[ -z ${ours[$pid]:-} && (-n ${ours[$ppid]:-} || ($group_led == true && $pgrp == "$group")) ]]; then
                ours[$pid]=1
                grown=1
            fi
        done
    done
    for pid in "${!ours[@]}"; do
        [[ $pid == "$$" ]] && continue
        while IFS= read -r lock; do
            dir=${lock%/.run.lock}
            for known in "${run_dirs[@]}"; do
                [[ $known == "$dir" ]] && continue 2
            done
            run_dirs+=("$dir")
        done < <(find "/proc/$pid/fd" -maxdepth 1 -lname '*/.run.lock' -printf '%l\n' 2>/dev/null)
    done
}

# Whether this script leads its process group, as tini's child does: only then are the group's
# other members ours to look at and to await.
read -r stat </proc/$$/stat
read -r _ _ group _ <<<"${stat##*) }"
if [[ $group == "$$" ]]; then group_led=true; else group_led=false; fi

# Survive the signals with a handler; `trap ''` would make the launcher inherit "ignored". The
# handler runs while the signalled workers are still finishing their step: it notes their folders.
signalled=false
trap 'signalled=true; find_run_dirs' TERM INT USR1 HUP

accelerate launch "$@" &
launcher=$!

# `wait` returns early whenever a trapped signal arrives: wait again until the launcher has ended.
while :; do
    wait "$launcher"
    status=$?
    kill -0 "$launcher" 2>/dev/null || break
done

# Then wait for the rest of this process group (a 1-process worker whose launcher died), read
# from /proc, since an orphan is no longer our child and `wait` cannot see it.
others_in_group() {
    local row pid state pgrp
    read_processes
    for row in "${table[@]}"; do
        read -r pid state _ pgrp <<<"$row"
        [[ $pid != "$$" && $pgrp == "$group" && $state != Z ]] && return 0
    done
    return 1
}
if [[ $group_led == true ]]; then
    while others_in_group; do
        if [[ $signalled == true ]]; then find_run_dirs; fi  # a worker signalled early claims late
        sleep 1
    done
fi

if ((status != 0)); then
    for dir in "${run_dirs[@]}"; do
        marker=$dir/requeue.json lock=$dir/.run.lock
        if [[ -f $marker && -f $lock && ! $lock -nt $marker ]]; then
            echo "entrypoint: preempted; $marker written, exit code 75 (the launcher's was $status)" >&2
            exit 75
        fi
    done
fi
exit "$status"
