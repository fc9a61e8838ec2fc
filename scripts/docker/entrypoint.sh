#!/usr/bin/env bash
# The image's entry point, under `tini -g` (PID 1): `accelerate launch "$@"`, then wait for any
# worker the launcher leaves behind, so that a preempted run can finish its checkpoint.
#
# Why not `tini -g -- accelerate launch` directly: a container ends when PID 1 exits, tini exits as
# soon as its own child does, and the kernel then SIGKILLs whatever is left. With one process,
# `accelerate launch` is a plain parent that dies at once on SIGTERM, while its worker is still
# saving: tried in a PID namespace with tini 0.19 and train.py, the worker got the signal and was
# killed before it wrote anything. With several processes torchelastic waits for its workers
# (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and this script changes nothing.
#
# Signals: `tini -g` delivers them to this whole process group: this script (which survives them),
# the launcher and a 1-process worker. torchelastic's workers live in sessions of their own and get
# the signal from torchelastic, which forwards SIGUSR1 only when PET_SIGNALS_TO_HANDLE names it (the
# image sets it).
set -uo pipefail

# Survive the signals with a no-op handler; `trap ''` would make the launcher inherit "ignored".
trap : TERM INT USR1 HUP

accelerate launch "$@" &
launcher=$!

# `wait` returns early whenever a trapped signal arrives: wait again until the launcher has ended.
while :; do
    wait "$launcher"
    status=$?
    kill -0 "$launcher" 2>/dev/null || break
done

# Then wait for the rest of this process group (a 1-process worker whose launcher died), read
# from /proc, since an orphan is no longer our child and `wait` cannot see it. Only when this script
# leads the group, as tini's child does: in someone else's group the others are not ours to await.
read -r stat </proc/$$/stat
read -r _ _ group _ <<<"${stat##*) }"
[[ $group == "$$" ]] || exit "$status"
others_in_group() {
    local file pid stat state pgrp
    for file in /proc/[0-9]*/stat; do
        pid=${file#/proc/}
        pid=${pid%/stat}
        [[ $pid == "$$" ]] && continue
        read -r stat <"$file" 2>/dev/null || continue  # the process ended meanwhile
        read -r state _ pgrp _ <<<"${stat##*) }"
        [[ $pgrp == "$group" && $state != Z ]] && return 0
    done
    return 1
}
while others_in_group; do
    sleep 1
done
exit "$status"
