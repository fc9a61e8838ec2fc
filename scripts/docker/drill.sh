#!/usr/bin/env bash
# The Docker drill (issue 29): build the project's image on one of the project's CPU build machines
# (Debian bookworm, no registry of images reachable, PyPI and Debian's archive reachable, local
# wheel indexes in the pip settings) and use it as a cluster would:
#   1. install docker.io and debootstrap if missing, start dockerd if none runs;
#   2. a Debian base: debootstrap --variant=minbase, imported (kept and reused by later drills),
#      plus this machine's pip settings and CA bundle (the egress proxy's CA: a bare base cannot
#      verify the package index), with its local indexes served by a local HTTP server;
#   3. the image, BASE_IMAGE = that base, TORCH_INDEX_URL = a local index of the CPU torch: a cold
#      build (--no-cache), then a build after a code-only change, which must reuse the torch and
#      dependency layers (both timed);
#   4. in the image, as its user (uid 1000), into mounted host folders, on CPU: an uninterrupted
#      run; the same run stopped mid-way by `docker stop` (exit code 75, checkpoint, requeue.json);
#      a new container resuming it (--resume_from_checkpoint auto; the losses must equal the
#      uninterrupted run's, metrics.jsonl must be contiguous); configs/pretrain_shakespeare.yaml and
#      configs/finetune.yaml (shortened); the memory planner (python -m tools.plan).
# Results: results.json and drill.md in benchmarks/results/docker-drill-2026-12-01/ (DRILL_RESULTS),
# container logs beside them. Exits non-zero if any check failed. Not part of CI: the cold build
# alone takes minutes (docs/clusters.md#the-docker-drill).
#
#   sudo bash scripts/docker/drill.sh        # as root: it installs packages and runs dockerd
#
# Settings (environment): DRILL_WORK (scratch, default /var/tmp/accelerate-recipes-drill),
# DRILL_RESULTS, DRILL_PORT (local index server, 8765), DRILL_IMAGE (accelerate-recipes:drill),
# DRILL_CACHED=1 (let the first build use the cache: no cold figure), DRILL_STEPS (400),
# DRILL_STOP_AT (stop the run once it has logged this step, 150), DRILL_TOLERANCE (largest loss
# difference accepted after the resume, 0: bitwise), DRILL_PYTHON (the host's python3, whose pip
# settings are copied). dockerd, once started, is left running for the next drill.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=${DRILL_WORK:-/var/tmp/accelerate-recipes-drill}
results=${DRILL_RESULTS:-$root/benchmarks/results/docker-drill-2026-12-01}
port=${DRILL_PORT:-8765}
image=${DRILL_IMAGE:-accelerate-recipes:drill}
suite=bookworm
mirror=http://deb.debian.org/debian
raw_base=accelerate-recipes-drill-debian:$suite-minbase
base=accelerate-recipes-drill-base:$suite
torch_version=2.13.0
max_steps=${DRILL_STEPS:-400}
stop_at=${DRILL_STOP_AT:-150}
tolerance=${DRILL_TOLERANCE:-0}
python=${DRILL_PYTHON:-python3}
tools=$root/scripts/docker/drill_tools.py
uid=1000  # the image's USER (Dockerfile: USER_UID)
export DOCKER_BUILDKIT=0  # docker.io 20.10 without buildx: the classic builder, whose log says what was cached

log() { printf '[drill %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
tool() { "$python" "$tools" "$@"; }

[[ $(id -u) == 0 ]] || die "run as root (it installs docker.io and debootstrap and starts dockerd)"
mkdir -p "$work/logs" "$results/logs"
steps=$work/steps.jsonl
: >"$steps"
rm -f "$results"/logs/*.log

# Bookkeeping of one drill step: record NAME COMMAND EXIT_CODE EXPECTED [--check N] [--facts_file F] [key=value...]
record() {
    local name=$1 command=$2 code=$3 expected=$4
    shift 4
    tool record --steps "$steps" --name "$name" --command "$command" --exit_code "$code" --expected "$expected" "$@"
}
quoted() { printf '%q ' "$@" | sed "s| $||; s|$work|\$WORK|g"; }

# ---------------------------------------------------------------- 1. Docker

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing docker.io and debootstrap"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap
fi
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (no iptables, no bridge: containers get --network host or none)"
    setsid dockerd --iptables=false --bridge=none >"$work/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || die "dockerd did not start: $work/dockerd.log"
fi

server=""
containers=()
cleanup() {
    local name
    for name in "${containers[@]}"; do
        docker rm -f "$name" >/dev/null 2>&1 || true
    done
    if [[ -n $server ]]; then kill "$server" 2>/dev/null || true; fi
}
trap cleanup EXIT

# ---------------------------------------------------------------- 2. the base

t0=$(now)
if docker image inspect "$raw_base" >/dev/null 2>&1; then
    base_origin="reused: $raw_base, imported earlier"
else
    log "debootstrap $suite (minbase) from $mirror"
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase "$suite" "$work/rootfs" "$mirror" >"$work/logs/debootstrap.log" 2>&1 ||
        die "debootstrap failed: $work/logs/debootstrap.log"
    tar -C "$work/rootfs" -c . | docker import -c 'CMD ["bash"]' - "$raw_base" >/dev/null
    rm -rf "$work/rootfs"
    base_origin="debootstrap --variant=minbase $suite $mirror, imported in $(since "$t0") s"
fi
log "base: $base_origin"

# This machine's pip settings for the base, its local indexes served over HTTP, the torch index.
torch_index=$(tool serve --served "$work/served" --context "$work/base-context" --port "$port" \
    --torch_version "$torch_version" --python "$python" --facts "$work/serve.json")
cat >"$work/base-context/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
cat >"$work/base-context/Dockerfile" <<EOF
FROM $raw_base
COPY sources.list /etc/apt/sources.list
COPY pip.conf /etc/pip.conf
COPY pip-drill/ /etc/pip-drill/
EOF
docker build -t "$base" "$work/base-context" >"$work/logs/build-base.log" 2>&1 ||
    die "building $base failed: $work/logs/build-base.log"
"$python" -m http.server --bind 127.0.0.1 --directory "$work/served" "$port" >"$work/logs/http.log" 2>&1 &
server=$!
for _ in $(seq 50); do
    sleep 0.2
    kill -0 "$server" 2>/dev/null || die "the index server did not start (port $port taken? set DRILL_PORT): $work/logs/http.log"
    "$python" -c "import urllib.request; urllib.request.urlopen('${torch_index}torch/')" 2>/dev/null && break
done
log "serving local indexes on 127.0.0.1:$port; torch from $torch_index"

# ---------------------------------------------------------------- 3. the image, cold and after a code change

# A snapshot of the working tree (what git tracks or would, ignored files left out), so that the
# code change of the second build never touches the checkout.
rm -rf "$work/context"
mkdir -p "$work/context"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) |
    tar -C "$work/context" -xf -
old_images=$(docker image inspect -f '{{.Id}}' "$image" "$image-codechange" 2>/dev/null || true)

build() {  # build NAME TAG [docker build options]: sets build_code, build_seconds
    local name=$1 tag=$2
    shift 2
    local t0
    t0=$(now)
    log "building $tag ($name)"
    set +e
    docker build --network host --build-arg BASE_IMAGE="$base" --build-arg TORCH_INDEX_URL="$torch_index" \
        "$@" -t "$tag" "$work/context" 2>&1 |
        while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done >"$work/logs/build-$name.log"
    build_code=${PIPESTATUS[0]}
    set -e
    build_seconds=$(since "$t0")
    log "$name: exit $build_code in $build_seconds s (log: $work/logs/build-$name.log)"
}
build_args=(--network host --build-arg "BASE_IMAGE=$base" --build-arg "TORCH_INDEX_URL=$torch_index")
cache=(--no-cache)
[[ ${DRILL_CACHED:-} == 1 ]] && cache=()
build cold "$image" "${cache[@]}"
tool build-steps --log "$work/logs/build-cold.log" --facts "$work/build-cold.json" >/dev/null || true
record build "$(quoted docker build "${build_args[@]}" "${cache[@]}" -t "$image" .)" "$build_code" 0 \
    --facts_file "$work/build-cold.json" seconds="$build_seconds" no_cache="$([[ ${#cache[@]} -gt 0 ]] && echo yes || echo no)"
if ((build_code != 0)); then
    tail -30 "$work/logs/build-cold.log" >&2
    tool report --steps "$steps" --results "$results"
    exit 1
fi

echo "# drill: a code-only change ($(date -u +%FT%TZ)), to time a rebuild" >>"$work/context/recipes/train.py"
build codechange "$image-codechange"
check=0
tool build-steps --log "$work/logs/build-codechange.log" --facts "$work/build-codechange.json" \
    --expect_cached torch deps >/dev/null || check=$?
record build-after-code-change "$(quoted docker build "${build_args[@]}" -t "$image-codechange" .) # after appending a comment to recipes/train.py" \
    "$build_code" 0 --check "$check" --facts_file "$work/build-codechange.json" seconds="$build_seconds"
docker rmi "$image-codechange" >/dev/null 2>&1 || true
for old in $old_images; do  # the images these tags named before this drill, if nothing else uses them
    docker rmi "$old" >/dev/null 2>&1 || true
done
image_size=$(docker image inspect -f '{{.Size}}' "$image")

# ---------------------------------------------------------------- 4. the drill

runs=$work/runs
rm -rf "$runs"
mkdir -p "$runs"/{reference,preempted,configs,hf_home}
chown -R "$uid:$uid" "$runs"  # the image's user must be able to write the mounted folders
run_opts=(--network none -e HF_HUB_OFFLINE=1 -e HF_DATASETS_OFFLINE=1 -e TOKENIZERS_PARALLELISM=false
    -v "$runs/hf_home:/hf_home")
train=(--config_file accelerate_configs/cpu.yaml recipes/train.py --preset debug --max_steps "$max_steps"
    --save_every 50 --output_dir outputs/run)

start() {  # start NAME [docker run options and arguments]: a detached container acr-drill-NAME
    local name=acr-drill-$1
    shift
    docker rm -f "$name" >/dev/null 2>&1 || true
    containers+=("$name")
    docker run -d --name "$name" "${run_opts[@]}" "$@" >/dev/null
    command_line=$(quoted docker run "${run_opts[@]}" "$@")
}
finish() {  # finish NAME TIMEOUT: waits; sets code (the container's exit code, or "timeout")
    local name=acr-drill-$1
    if ! code=$(timeout "$2" docker wait "$name"); then
        docker kill "$name" >/dev/null 2>&1 || true
        code=timeout
    fi
    docker logs "$name" >"$results/logs/$1.log" 2>&1 || true
    docker rm "$name" >/dev/null 2>&1 || true
}

# The image itself: its user, versions and the folders this issue added.
mapfile -t facts < <(docker run --rm --network none --entrypoint bash "$image" -c '
    echo "uid=$(id -u)"; echo "gid=$(id -g)"; echo "workdir=$PWD"
    python -c "import sys, torch, accelerate, transformers; print(f\"python={sys.version.split()[0]}\"); print(f\"torch={torch.__version__}\"); print(f\"accelerate={accelerate.__version__}\"); print(f\"transformers={transformers.__version__}\")"
    echo "configs=$(ls configs | paste -sd,)"; echo "tools=$(ls tools | paste -sd,)"' 2>&1) || true
code=0
[[ " ${facts[*]} " == *" uid=$uid "* && " ${facts[*]} " == *"configs=finetune.yaml,pretrain_shakespeare.yaml"* ]] || code=1
record image "docker run --rm --entrypoint bash $image -c 'id -u; python -c ...; ls configs tools'" "$code" 0 \
    "${facts[@]}" image_size_gb="$(awk -v s="$image_size" 'BEGIN { printf "%.2f", s / 1e9 }')"

log "uninterrupted run ($max_steps steps)"
t0=$(now)
start reference -v "$runs/reference:/workspace/outputs" "$image" "${train[@]}"
finish reference 3600
record uninterrupted-run "$command_line" "$code" 0 seconds="$(since "$t0")" \
    last_train_step="$(tool last-step "$runs/reference/run")"

log "the same run, stopped by docker stop after step $stop_at"
t0=$(now)
start preempted -v "$runs/preempted:/workspace/outputs" "$image" "${train[@]}"
preempt_command=$command_line
step=0
while ((step < stop_at)); do
    [[ $(docker inspect -f '{{.State.Running}}' acr-drill-preempted) == true ]] || break
    sleep 1
    step=$(tool last-step "$runs/preempted/run")
done
t1=$(now)
docker stop -t 120 acr-drill-preempted >/dev/null
stop_seconds=$(since "$t1")
finish preempted 60
check=0
tool preempted "$runs/preempted/run" --uid "$uid" --facts "$work/preempted.json" >/dev/null || check=$?
record docker-stop "$preempt_command; docker stop -t 120 acr-drill-preempted # once step $stop_at was logged" \
    "$code" 75 --check "$check" --facts_file "$work/preempted.json" step_logged_at_stop="$step" \
    stop_to_exit_seconds="$stop_seconds" run_seconds_before_stop="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
resumed_from=$("$python" -c "import json; print(json.load(open('$work/preempted.json')).get('marker', {}).get('step', 0))")

log "a new container resumes it"
t0=$(now)
start resumed -v "$runs/preempted:/workspace/outputs" "$image" "${train[@]}" --resume_from_checkpoint auto
finish resumed 3600
check=0
tool compare --reference "$runs/reference/run" --run "$runs/preempted/run" --max_steps "$max_steps" \
    --resumed_from "$resumed_from" --tolerance "$tolerance" --uid "$uid" --facts "$work/compare.json" >/dev/null || check=$?
record resume "$command_line" "$code" 0 --check "$check" --facts_file "$work/compare.json" seconds="$(since "$t0")"

log "configs/ in the image"
start pretrain -v "$runs/configs:/workspace/outputs" "$image" --config_file accelerate_configs/cpu.yaml \
    recipes/train.py --config configs/pretrain_shakespeare.yaml --max_steps 30 --warmup_steps 3 --eval_every 15
finish pretrain 1800
check=0
[[ -f $runs/configs/shakespeare/model/config.json ]] || check=1
record config-pretrain "$command_line" "$code" 0 --check "$check" \
    exported_model="$([[ $check == 0 ]] && echo outputs/shakespeare/model || echo missing)" \
    last_eval="$(grep -o 'final eval loss [0-9.]*' "$results/logs/pretrain.log" | tail -1)"
start finetune -v "$runs/configs:/workspace/outputs" "$image" --config_file accelerate_configs/cpu.yaml \
    recipes/train.py --config configs/finetune.yaml --max_steps 20 --eval_every 10
finish finetune 1800
check=0
[[ -f $runs/configs/shakespeare_finetune/run_summary.json ]] || check=1
record config-finetune "$command_line" "$code" 0 --check "$check" \
    last_eval="$(grep -o 'final eval loss [0-9.]*' "$results/logs/finetune.log" | tail -1)"

log "the memory planner in the image"
planner() {  # planner NAME [tools.plan options]
    local name=$1
    shift
    code=0
    docker run --rm --network none --entrypoint python "$image" -m tools.plan "$@" >"$results/logs/$name.log" 2>&1 ||
        code=$?
    record "$name" "docker run --rm --entrypoint python $image -m tools.plan $*" "$code" 0 \
        output_lines="$(wc -l <"$results/logs/$name.log")"
}
planner planner-help --help
planner planner-1b --preset 1b --gpus 8 --gpu_memory_gb 80

# ---------------------------------------------------------------- results

tool meta --out "$work/meta.json" --root "$root" --serve "$work/serve.json" image="$image" \
    base_image="$base: $raw_base ($base_origin), plus this machine's pip settings and CA bundle" \
    torch_index_url="$torch_index" image_size_bytes="$image_size" max_steps="$max_steps" stop_at="$stop_at" \
    tolerance="$tolerance"
tool report --steps "$steps" --results "$results" --meta "$work/meta.json"
