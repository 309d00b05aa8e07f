#!/usr/bin/env bash
# compose/smoke.sh: the Docker deployment end to end, from nothing, on a Debian 12 host (root)
# that reaches Debian's and PyPI's package archives but no image registry.
#
#   1. installs docker.io, docker-compose (1.29) and debootstrap if missing, and starts dockerd
#      (--iptables=false --bridge=none) if none answers;
#   2. makes a base image: debootstrap --variant=minbase bookworm + Python, `docker import`;
#   3. serves the wheels (the CPU torch wheel of the local package index, every dependency)
#      on 127.0.0.1 as a package index for the image build;
#   4. builds stand-ins for the rabbitmq and redis images from Debian's packages
#      (compose/local-images/) and the SplitMQ image (compose/Dockerfile);
#   5. brings the stack up (compose/docker-compose.yml + docker-compose.hostnet.yml: host
#      networking, RabbitMQ on 5673, Redis on 6380, beside the host's own) with 2 workers and
#      3 clients on compose/smoke.toml, waits for 2 versions, scales the workers to 3 (until
#      each holds a shard, for 2 more versions) and back to 1 (until it holds them all, for 2
#      more) while training runs;
#   6. starts the autoscaler (the `autoscaler` service of --profile autoscale: `splitmq
#      autoscale` with the Docker backend, the Docker socket mounted) and waits until, under
#      the clients' load, it has grown the pool to its maximum of 3 worker containers, each
#      holding a shard; waits for the job to finish and the clients to leave, and then for
#      the autoscaler to bring the idle pool back to its minimum of 1, and stops it;
#   7. checks that no batch was lost over the whole run (the clients' sent batches = the shard
#      checkpoints' applied counts), that accuracy rose and that every worker, the ones the
#      autoscaler started and stopped included, stopped with exit code 0, and reports the
#      dead letters with their logged reasons and the autoscaler's decisions;
#   8. tears the stack down (volumes included), also on failure.
#
# --cluster: steps 1-4, then the cluster of compose/docker-compose.cluster.yml instead (with
#   docker-compose.cluster-hostnet.yml: three RabbitMQ nodes on 5711-5713, Redis primary 6480
#   and replica 6481, Sentinels 26480-26482) with 3 workers and 3 clients on
#   compose/cluster-smoke.toml: checks that the nodes formed one cluster and that the shard
#   queues are quorum queues on all three and that the roles' store goes through the Sentinels
#   (`splitmq doctor`), waits for 2 versions, SIGKILLs (docker kill) the
#   node that leads most shard queues, waits for 2 versions trained without it, starts it
#   again and waits until it is back in the cluster, and checks that the job finished with no
#   batch lost and no dead letter; reports the longest time without a new version.
# --images-only: steps 1-4 and the SplitMQ image, then stop (to warm the caches).
#
# Every step skips what is already there (the base image, the rootfs, downloaded wheels,
# cached image layers), so a rerun takes minutes. Settings (environment):
#   SPLITMQ_SMOKE_CACHE      rootfs, wheels, logs       (/var/cache/splitmq-smoke)
#   SPLITMQ_SMOKE_TIMEOUT_S  the whole run's deadline   (3600)
#   SPLITMQ_SMOKE_WHEEL_PORT the local package index    (8765)
#   SPLITMQ_SMOKE_KEEP=1     leave the stack running (no teardown) to look around
#   SPLITMQ_SMOKE_KEEP_DOCKERD=1  leave a dockerd this script started running
# Exit code 0 only when every check passed; the last lines are the summary.
set -Eeuo pipefail

MODE=single
IMAGES_ONLY=""
for arg in "$@"; do
    case $arg in
        --cluster) MODE=cluster ;;
        --images-only) IMAGES_ONLY=1 ;;
        *) echo "usage: $0 [--cluster] [--images-only]" >&2; exit 2 ;;
    esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
CACHE=${SPLITMQ_SMOKE_CACHE:-/var/cache/splitmq-smoke}
TIMEOUT_S=${SPLITMQ_SMOKE_TIMEOUT_S:-3600}
WHEEL_PORT=${SPLITMQ_SMOKE_WHEEL_PORT:-8765}
PROJECT=splitmq-smoke
SUITE=bookworm
BASE_IMAGE=splitmq-local/debian:$SUITE-python3.11
RABBITMQ_IMAGE=splitmq-local/rabbitmq:3-management
REDIS_IMAGE=splitmq-local/redis:7
TAG=smoke
WORKERS=2
WORKERS_UP=3
WORKERS_DOWN=1
CLIENTS=3
# The autoscaler's bounds: [autoscaler] min_workers and max_workers of compose/smoke.toml.
AUTOSCALE_MIN=1
AUTOSCALE_MAX=3
# The autoscaler image has the Docker SDK: the project with this extra.
EXTRAS=docker
# Must match compose/smoke.toml and compose/docker-compose.hostnet.yml.
JOB=compose-smoke
JOB_FILE=smoke.toml
REDIS_PORT=6380
FILES=(docker-compose.yml docker-compose.hostnet.yml)
if [ "$MODE" = cluster ]; then
    PROJECT=splitmq-cluster-smoke
    WORKERS=3
    # Must match compose/cluster-smoke.toml and compose/docker-compose.cluster-hostnet.yml.
    JOB=compose-cluster-smoke
    JOB_FILE=cluster-smoke.toml
    REDIS_PORT=6480
    FILES+=(docker-compose.cluster.yml docker-compose.cluster-hostnet.yml)
fi

START=$(date +%s)
RUN_DIR=$CACHE/runs/$(date -u +%Y%m%dT%H%M%SZ)${MODE/single/}
mkdir -p "$RUN_DIR"
STARTED_DOCKERD=""
WHEEL_SERVER_PID=""
EVENTS_PID=""
FOLLOW_PID=""
SAMPLER_PID=""
STACK_UP=""
declare -a SUMMARY=()
declare -a FAILURES=()

elapsed() { echo $(($(date +%s) - START)); }
step() { printf '\n== [%5ss] %s\n' "$(elapsed)" "$*"; }
note() { printf '   [%5ss] %s\n' "$(elapsed)" "$*"; }
die() {
    FAILURES+=("$*")
    printf 'FAILED: %s\n' "$*" >&2
    exit 1
}
check() { # check NAME CONDITION-EXIT-CODE DETAIL
    if [ "$2" -eq 0 ]; then
        SUMMARY+=("PASS  $1: $3")
    else
        SUMMARY+=("FAIL  $1: $3")
        FAILURES+=("$1")
    fi
}
deadline_left() { echo $((TIMEOUT_S - $(elapsed))); }

COMPOSE=(docker-compose -p "$PROJECT")
for file in "${FILES[@]}"; do COMPOSE+=(-f "$HERE/$file"); done
compose() { "${COMPOSE[@]}" "$@"; }
# The autoscaler service is in the `autoscale` profile: commands that touch it enable it.
compose_all() { "${COMPOSE[@]}" --profile autoscale "$@"; }

# The two compose files merged into one: Compose v1 (docker-py) refuses a service with both
# network_mode: host and ports (v2 only warns), and an override cannot remove the base file's
# `ports:`. So the merged file, with the ports of host-network services dropped, is what runs.
write_stack_file() {
    local stack=$RUN_DIR/stack.yml
    compose config >"$stack.merged" || die "docker-compose config failed"
    /usr/bin/python3 -c 'import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for service in doc["services"].values():
    if service.get("network_mode") == "host":
        service.pop("ports", None)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)' "$stack.merged" "$stack" \
        || die "could not write $stack"
    COMPOSE=(docker-compose -p "$PROJECT" --project-directory "$HERE" -f "$stack")
}
rcli() { redis-cli -p "$REDIS_PORT" --raw "$@"; }
smoke_job() { # smoke_job SECTION KEY: a value of the job file (compose/smoke.toml)
    python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))[sys.argv[2]][sys.argv[3]])' \
        "$HERE/$JOB_FILE" "$1" "$2"
}
SHARDS=$(smoke_job algorithm shards)
ROUNDS=$(smoke_job job rounds)

# poll TIMEOUT_S COMMAND...: runs COMMAND every 5 s until it succeeds (0) or time is up (1).
poll() {
    local until=$(($(date +%s) + $1))
    shift
    while ! "$@"; do
        if [ "$(date +%s)" -ge "$until" ] || [ "$(deadline_left)" -le 0 ]; then
            return 1
        fi
        sleep 5
    done
}
# wait_for DESCRIPTION TIMEOUT_S COMMAND...: poll, and fail the run on a timeout.
wait_for() {
    local what=$1 limit=$2
    shift 2
    poll "$limit" "$@" || die "timed out after ${limit}s waiting for $what"
}

# Every container's log into $RUN_DIR/logs/, also of those that a scale-down removes: a
# background loop follows each new container (`docker logs -f` ends with its container).
follow_logs() {
    local id name
    declare -A followed=()
    mkdir -p "$RUN_DIR/logs"
    while true; do
        for id in $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"); do
            [ -n "${followed[$id]:-}" ] && continue
            name=$(docker inspect -f '{{.Name}}' "$id" 2>/dev/null) || continue
            docker logs -f --timestamps "$id" >"$RUN_DIR/logs/${name#/}.log" 2>&1 &
            followed[$id]=1
        done
        sleep 5
    done
}

# --- teardown -----------------------------------------------------------------------------
finish() {
    local code=$?
    set +e
    trap - EXIT INT TERM
    if [ -n "$STACK_UP" ]; then
        compose_all ps >"$RUN_DIR/ps.txt" 2>&1
        compose_all logs --no-color --timestamps >"$RUN_DIR/compose.log" 2>&1
        if [ "${SPLITMQ_SMOKE_KEEP:-}" = 1 ]; then
            note "SPLITMQ_SMOKE_KEEP=1: the stack stays up (compose -p $PROJECT ... down -v)"
        else
            step "teardown: compose down -v"
            timeout 300 "${COMPOSE[@]}" --profile autoscale down -v --remove-orphans -t 60 \
                >>"$RUN_DIR/teardown.log" 2>&1 || note "compose down failed (see teardown.log)"
        fi
    fi
    [ -n "$WHEEL_SERVER_PID" ] && kill "$WHEEL_SERVER_PID" 2>/dev/null
    [ -n "$EVENTS_PID" ] && kill "$EVENTS_PID" 2>/dev/null
    [ -n "$FOLLOW_PID" ] && kill "$FOLLOW_PID" 2>/dev/null
    [ -n "$SAMPLER_PID" ] && kill "$SAMPLER_PID" 2>/dev/null
    if [ -n "$STARTED_DOCKERD" ] && [ "${SPLITMQ_SMOKE_KEEP_DOCKERD:-}" != 1 ] \
        && [ "${SPLITMQ_SMOKE_KEEP:-}" != 1 ]; then
        kill "$STARTED_DOCKERD" 2>/dev/null
        wait "$STARTED_DOCKERD" 2>/dev/null
    fi
    [ "$code" -ne 0 ] && [ ${#FAILURES[@]} -eq 0 ] && FAILURES+=("exit code $code")
    printf '\n==================== compose/smoke.sh summary ====================\n'
    printf 'date      %s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
    printf 'duration  %ss\n' "$(elapsed)"
    printf 'logs      %s\n' "$RUN_DIR"
    local line
    for line in "${SUMMARY[@]}"; do printf '%s\n' "$line"; done
    if [ ${#FAILURES[@]} -eq 0 ]; then
        printf 'RESULT    PASS\n'
        exit 0
    fi
    printf 'RESULT    FAIL (%s)\n' "${FAILURES[*]}"
    exit 1
}

# The wheels of the image, into $wheels: the host's pip fetches (its configuration knows the
# local index with the CPU torch build), the image's own Python resolves.
applied_total() { # the shards' checkpoints' `applied`, summed
    local s total=0 n
    for ((s = 0; s < SHARDS; s++)); do
        n=$(rcli HGET "splitmq:$JOB:ckpt:$s" applied)
        total=$((total + ${n:-0}))
    done
    echo "$total"
}
check_batches_accounted() { # the clients' `batches sent` against the shards' checkpoints
    sent=0
    local id n client_codes="" applied per_shard s
    for id in $(compose ps -q client); do
        n=$(docker logs "$id" 2>&1 | sed -nE 's/.* ([0-9]+) batches sent.*/\1/p' | tail -1)
        [ -n "$n" ] || die "client container $id logged no batch count"
        sent=$((sent + n))
        client_codes+="$(docker inspect -f '{{.State.ExitCode}}' "$id") "
    done
    # The workers checkpoint every 2 s; stopping them checkpoints once more.
    applied_covers_sent() { [ "$(applied_total)" -ge "$sent" ]; }
    poll 120 applied_covers_sent || note "checkpoints still short of $sent: stopping the workers"
    compose stop -t 60 worker >>"$RUN_DIR/up.log" 2>&1
    applied=$(applied_total)
    per_shard=$(for ((s = 0; s < SHARDS; s++)); do printf '%s ' "$(rcli HGET "splitmq:$JOB:ckpt:$s" applied)"; done)
    check "no batch lost" "$([ "$sent" -gt 0 ] && [ "$applied" -eq "$sent" ]; echo $?)" \
        "clients sent $sent batches (exit codes ${client_codes% }), shard checkpoints applied $applied (per shard: ${per_shard% })"
}
fetch_wheels() {
    # pip skips what is already in $wheels; the host's pip configuration brings the CPU build.
    python3 -m pip download --quiet --only-binary=:all: -d "$wheels" \
        "torch==2.13.0" "setuptools>=68" wheel "$ROOT[$EXTRAS]" >"$RUN_DIR/pip-download.log" 2>&1 \
        || die "pip download failed (see $RUN_DIR/pip-download.log)"
    compgen -G "$wheels/torch-2.13.0+cpu-*.whl" >/dev/null || die "no CPU torch wheel in $wheels"
    # The image's Python may need more than the host's: markers such as python_full_version <
    # "3.11.3" (redis wants async-timeout on Debian's 3.11.2). So resolve with the image's own
    # interpreter against these wheels alone, offline, fetch what it misses with the host's pip
    # (which knows this host's package index), and repeat.
    project=$CACHE/project
    rm -rf "$project" && mkdir -p "$project"
    cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$project/"
    for attempt in 1 2 3 4 5 6; do
        if out=$(docker run --rm --network none -v "$wheels:/wheels:ro" -v "$project:/project" \
            "$BASE_IMAGE" python3 -m pip download --no-index --find-links /wheels \
            --only-binary=:all: -d /tmp/resolved "torch==2.13.0" "/project[$EXTRAS]" 2>&1); then
            break
        fi
        wanted=$(sed -nE 's/^ERROR: Could not find a version that satisfies the requirement ([^;( ]+).*/\1/p' \
            <<<"$out" | head -1)
        [ -n "$wanted" ] && [ "$attempt" -lt 6 ] || die "the image's Python cannot resolve the wheels: $out"
        note "the image's Python also needs $wanted"
        python3 -m pip download --quiet --only-binary=:all: -d "$wheels" "$wanted" \
            >>"$RUN_DIR/pip-download.log" 2>&1 || die "pip download $wanted failed"
    done
}

# --cluster: the stack of docker-compose.cluster.yml, one RabbitMQ node SIGKILLed mid-run.
NODES=(rabbitmq rabbitmq-2 rabbitmq-3)
KILLED=""
cluster_stack() {
    step "cluster up: 3 RabbitMQ nodes, Redis primary + replica + 3 Sentinels, $WORKERS workers, $CLIENTS clients (project $PROJECT)"
    STACK_UP=1
    compose_all down -v --remove-orphans >"$RUN_DIR/predown.log" 2>&1 || true
    docker events --filter "label=com.docker.compose.project=$PROJECT" --filter event=die \
        --format '{{.Actor.Attributes.name}} exitCode={{.Actor.Attributes.exitCode}}' \
        >"$RUN_DIR/exits.log" 2>&1 &
    EVENTS_PID=$!
    follow_logs >/dev/null 2>&1 &
    FOLLOW_PID=$!
    timeout 900 "${COMPOSE[@]}" up -d --no-build \
        --scale worker=$WORKERS --scale client=$CLIENTS >"$RUN_DIR/up.log" 2>&1 \
        || die "compose up failed (see $RUN_DIR/up.log)"
    note "$(docker ps --filter "label=com.docker.compose.project=$PROJECT" --format '{{.Names}}' | sort | tr '\n' ' ')"

    version() { local v; v=$(rcli GET "splitmq:$JOB:version" 2>/dev/null); echo "${v:-0}"; }
    version_at_least() { [ "$(version)" -ge "$1" ]; }
    container() { compose ps -q "$1"; }
    # rabbitmqctl in the first node's container that answers, the killed one left out.
    rmq() {
        local node out
        for node in "${NODES[@]}"; do
            [ "$node" = "$KILLED" ] && continue
            if out=$(compose exec -T "$node" rabbitmqctl -q "$@" 2>/dev/null); then
                printf '%s\n' "$out"
                return 0
            fi
        done
        return 1
    }
    running_nodes() {
        rmq cluster_status --formatter json | python3 -c 'import json, sys
print(" ".join(sorted(json.load(sys.stdin)["running_nodes"])))'
    }
    nodes_running_are() { [ "$(running_nodes | wc -w)" -eq "$1" ]; }
    # "name type leader members" of the shard queues, one line each.
    shard_queues() {
        rmq list_queues name type leader members --formatter json | python3 -c 'import json, sys
job = sys.argv[1]
for q in sorted(json.load(sys.stdin), key=lambda q: q["name"]):
    if q["name"].startswith(job + ".smashed."):
        print(q["name"], q["type"], q.get("leader", "-"), len(q.get("members") or []))' "$JOB"
    }
    shard_queues_declared() { [ "$(shard_queues | wc -l)" -eq "$SHARDS" ]; }
    aggregator_exited() {
        [ "$(docker inspect -f '{{.State.Status}}' "$(container aggregator)")" = exited ]
    }
    # The version every 2 s, for the longest time without a new one (the stall).
    (while true; do echo "$(date +%s) $(version)"; sleep 2; done) >"$RUN_DIR/versions.log" 2>/dev/null &
    SAMPLER_PID=$!

    wait_for "3 running RabbitMQ nodes in one cluster" 300 nodes_running_are 3
    check "cluster formed" 0 "running nodes: $(running_nodes)"
    replication=$(redis-cli -p 6481 --raw INFO replication | tr -d '\r' | grep -E '^(role|master_link_status):' | tr '\n' ' ')
    master=$(redis-cli -p 26480 --raw SENTINEL get-master-addr-by-name splitmq | tr '\n' ' ')
    sentinels=$(redis-cli -p 26480 --raw SENTINEL sentinels splitmq | grep -c '^name$' || true)
    check "redis sentinel" "$([[ "$replication" == *"master_link_status:up"* ]] && [ "${master% }" = "127.0.0.1 6480" ] && [ "$sentinels" -eq 2 ]; echo $?)" \
        "replica: ${replication% }; master by Sentinel: ${master% }; Sentinel 1 sees $sentinels others"

    wait_for "the initial version" 900 version_at_least 1
    # What the roles' store is connected to, as `splitmq doctor` in a worker sees it.
    doctor=$(compose exec -T worker splitmq --config /etc/splitmq/job.toml doctor 2>&1 \
        | grep -m 1 "Sentinel master" | sed -E 's/^[[:space:]]+//' || true)
    check "store via Sentinel" "$([[ "$doctor" == *"Sentinel master"* ]]; echo $?)" \
        "${doctor:-splitmq doctor in a worker names no Sentinel master}"
    wait_for "the $SHARDS shard queues" 300 shard_queues_declared
    queues=$(shard_queues)
    check "quorum shard queues" "$(! awk '$2 != "quorum" || $4 != 3' <<<"$queues" | grep -q .; echo $?)" \
        "$(tr '\n' ';' <<<"$queues" | sed 's/;$//; s/;/; /g')"
    wait_for "2 trained versions" 1200 version_at_least 3

    # The node that leads most shard queues: its loss moves their leadership.
    leader=$(awk '{print $3}' <<<"$(shard_queues)" | sort | uniq -c | sort -rn | awk 'NR == 1 {print $2}')
    case $leader in
        smq-1@*) KILLED=rabbitmq ;;
        smq-2@*) KILLED=rabbitmq-2 ;;
        smq-3@*) KILLED=rabbitmq-3 ;;
        *) die "no leader of the shard queues: $leader" ;;
    esac
    step "docker kill $KILLED ($leader, leading most shard queues) while training runs"
    v_kill=$(version)
    t_kill=$(date +%s)
    docker kill "$(container "$KILLED")" >/dev/null || die "docker kill $KILLED failed"
    wait_for "2 running nodes" 120 nodes_running_are 2
    note "running nodes: $(running_nodes); shard queues: $(shard_queues | tr '\n' ';')"
    wait_for "2 versions trained without $KILLED" 1200 version_at_least $((v_kill + 2))
    t_two=$(($(date +%s) - t_kill))
    v_back=$(version)

    step "docker start $KILLED: it rejoins from its data"
    docker start "$(container "$KILLED")" >/dev/null || die "docker start $KILLED failed"
    killed=$KILLED
    KILLED=""
    wait_for "$killed back in the cluster" 300 nodes_running_are 3
    note "running nodes: $(running_nodes); shard queues: $(shard_queues | tr '\n' ';')"
    check "node killed and back" 0 \
        "$killed killed at v$v_kill, 2 versions without it ${t_two}s later, started again at v$v_back"

    step "wait for the job to finish"
    wait_for "the aggregator to finish the job" "$(deadline_left)" aggregator_exited
    clients_done() {
        local id
        for id in $(compose ps -q client); do
            [ "$(docker inspect -f '{{.State.Status}}' "$id")" = exited ] || return 1
        done
    }
    wait_for "the clients to leave" 300 clients_done
    kill "$SAMPLER_PID" 2>/dev/null

    step "checks"
    agg_code=$(docker inspect -f '{{.State.ExitCode}}' "$(container aggregator)")
    final=$(version)
    check "job finished" "$([ "$agg_code" -eq 0 ] && [ "$final" -ge $((ROUNDS + 1)) ]; echo $?)" \
        "aggregator exit $agg_code, version $final after $ROUNDS rounds"
    check_batches_accounted
    dead=$(rmq list_queues name messages | awk -v q="$JOB.dead" '$1 == q {print $2}')
    reasons=$(cat "$RUN_DIR"/logs/*.log 2>/dev/null | sed -nE 's/.*dead-lettered a message from [^:]+: ([a-z_]+).*/\1/p' \
        | sort | uniq -c | awk '{printf "%s x%s ", $2, $1}')
    check "no dead letters" "$([ "${dead:-0}" -eq 0 ]; echo $?)" \
        "${dead:-0} in $JOB.dead${reasons:+ (logged reasons: ${reasons% })}"
    # The longest time without a new version, and the one around the kill (a round takes
    # seconds to tens of seconds here, so this is an upper bound on the stall).
    stalls=$(python3 -c 'import sys
t_kill = int(sys.argv[2])
rows = [tuple(map(int, line.split())) for line in open(sys.argv[1]) if len(line.split()) == 2]
changes = [t for (t, v), (_, w) in zip(rows[1:], rows) if v != w]
gaps = [(b - a, a) for a, b in zip(changes, changes[1:])]
longest = max(gaps)[0] if gaps else 0
kill = [g for g, a in gaps if a <= t_kill < a + g]
print(longest, kill[0] if kill else 0)' "$RUN_DIR/versions.log" "$t_kill")
    read -r longest around_kill <<<"$stalls"
    SUMMARY+=("info  versions: longest gap ${longest}s over the run, ${around_kill}s across the kill of $killed")
    docker cp "$(container aggregator):/var/lib/splitmq/runs" "$RUN_DIR/report" >/dev/null
    metrics=$(find "$RUN_DIR/report" -name metrics.json | head -1)
    [ -n "$metrics" ] || die "no metrics.json in the aggregator's report"
    accuracy=$(python3 -c 'import json, sys
acc = [r["global_accuracy"] for r in json.load(open(sys.argv[1]))["records"]]
print(f"{acc[0]:.3f} {acc[-1]:.3f} {len(acc)}")' "$metrics")
    read -r acc_first acc_last n_records <<<"$accuracy"
    check "accuracy rose" "$(python3 -c "import sys; sys.exit(not $acc_last > $acc_first)"; echo $?)" \
        "global accuracy $acc_first after round 1 -> $acc_last after round $n_records"
    restarts=""
    for service in coordinator aggregator worker client; do
        for id in $(compose ps -q "$service"); do
            restarts+="$(docker inspect -f '{{.Name}}={{.RestartCount}}' "$id" | sed 's#^/##') "
        done
    done
    SUMMARY+=("info  restarts: ${restarts% }")
    SUMMARY+=("info  report: $(dirname "$metrics")")
}

# Bash reads a script as it runs it: with the work in a function, called on the file's last
# line together with `exit`, the whole file is read before anything starts, so editing it
# during a run cannot derail that run.
main() {
    trap finish EXIT
    trap 'exit 130' INT TERM

    # --- 1. tools and the Docker engine -----------------------------------------------------------
    [ "$(id -u)" -eq 0 ] || die "run as root (apt-get, dockerd, debootstrap)"
    step "tools: docker.io, docker-compose, debootstrap, redis-tools"
    missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v redis-cli >/dev/null || missing+=(redis-tools)
    if [ ${#missing[@]} -gt 0 ]; then
        note "installing ${missing[*]}"
        apt-get update -q >"$RUN_DIR/apt.log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$RUN_DIR/apt.log" 2>&1 \
            || die "apt-get install ${missing[*]} failed (see $RUN_DIR/apt.log)"
    else
        note "already installed"
    fi

    step "docker engine"
    if docker info >/dev/null 2>&1; then
        note "a Docker engine answers already: using it"
    else
        # No bridge and no iptables: this host's containers share its network (network_mode: host).
        dockerd --iptables=false --bridge=none >"$CACHE/dockerd.log" 2>&1 &
        STARTED_DOCKERD=$!
        docker_answers() { docker info >/dev/null 2>&1; }
        wait_for "dockerd to answer" 120 docker_answers
        note "started dockerd (pid $STARTED_DOCKERD, log $CACHE/dockerd.log)"
    fi
    SUMMARY+=("info  docker engine $(docker version -f '{{.Server.Version}}'), $(docker-compose version --short 2>/dev/null | head -1 | sed 's/^/compose /')")

    # --- 2. base image --------------------------------------------------------------------------
    step "base image $BASE_IMAGE"
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        note "exists: skipped"
    else
        rootfs=$CACHE/rootfs-$SUITE
        if [ ! -d "$rootfs" ]; then
            note "debootstrap --variant=minbase $SUITE (a few minutes)"
            rm -rf "$rootfs.partial"
            debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
                "$SUITE" "$rootfs.partial" http://deb.debian.org/debian >"$RUN_DIR/debootstrap.log" 2>&1 \
                || die "debootstrap failed (see $RUN_DIR/debootstrap.log)"
            rm -f "$rootfs.partial"/var/cache/apt/archives/*.deb
            mv "$rootfs.partial" "$rootfs"
        fi
        tar -C "$rootfs" -c . | docker import \
            -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
        note "imported from $rootfs"
    fi

    # --- 3. wheels ------------------------------------------------------------------------------
    step "wheels: torch==2.13.0 (CPU, local package index) and the dependencies of $ROOT[$EXTRAS]"
    wheels=$CACHE/wheels
    index=$CACHE/simple
    mkdir -p "$wheels"
    # Done once per pyproject.toml, extras and base image: the stamp names them.
    stamp=$wheels/.resolved-$(cat "$ROOT/pyproject.toml" <(echo "$EXTRAS") <(docker image inspect \
        -f '{{.Id}}' "$BASE_IMAGE") | sha256sum | cut -c1-16)
    if [ -e "$stamp" ]; then
        note "resolved before for this pyproject.toml and base image: skipped"
    else
        fetch_wheels
        touch "$stamp"
    fi
    # A PEP 503 index: one directory per normalised project name, listed by http.server.
    rm -rf "$index" && mkdir -p "$index"
    for whl in "$wheels"/*.whl; do
        file=$(basename "$whl")
        project=$(echo "${file%%-*}" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g')
        mkdir -p "$index/$project"
        ln -sf "$whl" "$index/$project/$file"
    done
    python3 -m http.server --bind 127.0.0.1 --directory "$index" "$WHEEL_PORT" \
        >"$RUN_DIR/wheel-server.log" 2>&1 &
    WHEEL_SERVER_PID=$!
    index_answers() {
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$WHEEL_PORT/torch/')" \
            2>/dev/null
    }
    wait_for "the package index on 127.0.0.1:$WHEEL_PORT" 30 index_answers
    note "$(ls "$wheels" | wc -l) wheels served on http://127.0.0.1:$WHEEL_PORT/"

    # --- 4. images ------------------------------------------------------------------------------
    export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
    step "stand-in images $RABBITMQ_IMAGE, $REDIS_IMAGE (Debian packages)"
    for pair in "rabbitmq:$RABBITMQ_IMAGE" "redis:$REDIS_IMAGE"; do
        name=${pair%%:*}
        docker build --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
            -f "$HERE/local-images/$name.Dockerfile" -t "${pair#*:}" "$HERE/local-images" \
            >"$RUN_DIR/build-$name.log" 2>&1 || die "building $name failed (see build-$name.log)"
    done
    note "built (cached layers reused)"

    export SPLITMQ_TAG=$TAG
    export SPLITMQ_BASE_IMAGE=$BASE_IMAGE
    export SPLITMQ_TORCH_INDEX_URL=http://127.0.0.1:$WHEEL_PORT/
    export SPLITMQ_PIP_INDEX_URL=http://127.0.0.1:$WHEEL_PORT/
    export SPLITMQ_RABBITMQ_IMAGE=$RABBITMQ_IMAGE
    export SPLITMQ_REDIS_IMAGE=$REDIS_IMAGE
    export SPLITMQ_JOB_FILE=./$JOB_FILE
    export SPLITMQ_CLIENTS=$CLIENTS
    # This host is shared and loaded: a check (a Python start that imports torch) may take
    # minutes, and a check that times out counts as failed.
    export SPLITMQ_HEALTH_INTERVAL=20s SPLITMQ_HEALTH_TIMEOUT=300s
    export SPLITMQ_CLIENT_HEALTH_INTERVAL=120s
    # The autoscaler service names its workers' project by COMPOSE_PROJECT_NAME, and runs as the
    # image's own uid with the group of the Docker socket (root-equivalent either way).
    export COMPOSE_PROJECT_NAME=$PROJECT
    socket_gid=$(stat -c %g /var/run/docker.sock 2>/dev/null) && \
        export SPLITMQ_AUTOSCALER_USER=10001:$socket_gid
    # The cluster's nodes share it; a fresh one each run.
    [ "$MODE" = cluster ] && export SPLITMQ_ERLANG_COOKIE=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
    write_stack_file

    step "image splitmq:$TAG (compose/Dockerfile, BASE_IMAGE=$BASE_IMAGE)"
    # Every role service shares this one image; building one of them builds it.
    compose build coordinator >"$RUN_DIR/build-splitmq.log" 2>&1 \
        || die "building splitmq:$TAG failed (see $RUN_DIR/build-splitmq.log)"
    # Earlier builds of the tag, left untagged: only SplitMQ's own (its image label).
    docker image prune -f --filter "label=org.opencontainers.image.title=splitmq" >/dev/null
    user=$(docker image inspect -f '{{.Config.User}}' "splitmq:$TAG")
    tools=$(docker run --rm --network none --entrypoint sh "splitmq:$TAG" -c \
        'for t in gcc cc c++ make ld; do command -v $t; done; ls /opt/venv/bin | grep "^pip"' \
        2>/dev/null || true)
    size=$(docker image inspect -f '{{.Size}}' "splitmq:$TAG")
    check "image" "$([ "$user" != "" ] && [ "$user" != root ] && [ "${user%%:*}" != 0 ] && [ -z "$tools" ]; echo $?)" \
        "splitmq:$TAG, user $user, $((size / 1048576)) MiB, build tools: ${tools:-none}"

    if [ -n "$IMAGES_ONLY" ]; then
        SUMMARY+=("info  --images-only: images built, no stack started")
        return 0
    fi
    if [ "$MODE" = cluster ]; then
        cluster_stack
        [ ${#FAILURES[@]} -eq 0 ] || exit 1
        return 0
    fi

    # The same Dockerfile with EXTRAS=docker: the torch layers come from the cache above.
    step "image splitmq:$TAG-autoscaler (EXTRAS=$EXTRAS)"
    built_at=$(elapsed)
    compose_all build autoscaler >"$RUN_DIR/build-autoscaler.log" 2>&1 \
        || die "building splitmq:$TAG-autoscaler failed (see $RUN_DIR/build-autoscaler.log)"
    built_in=$(($(elapsed) - built_at))
    docker image prune -f --filter "label=org.opencontainers.image.title=splitmq" >/dev/null
    sdk=$(docker run --rm --network none --entrypoint python "splitmq:$TAG-autoscaler" -c \
        'import docker; print(docker.__version__)' 2>&1) || sdk="missing: $sdk"
    user=$(docker image inspect -f '{{.Config.User}}' "splitmq:$TAG-autoscaler")
    check "autoscaler image" "$([[ "$sdk" =~ ^[0-9] ]] && [ "${user%%:*}" = 10001 ]; echo $?)" \
        "splitmq:$TAG-autoscaler, user $user, docker SDK $sdk, built in ${built_in}s (torch layers cached)"

    # --- 5. the stack ---------------------------------------------------------------------------
    step "stack up: $WORKERS workers, $CLIENTS clients (project $PROJECT)"
    STACK_UP=1
    compose_all down -v --remove-orphans >"$RUN_DIR/predown.log" 2>&1 || true
    # Exit codes of every container, also of the workers a scale-down removes.
    docker events --filter "label=com.docker.compose.project=$PROJECT" --filter event=die \
        --format '{{.Actor.Attributes.name}} exitCode={{.Actor.Attributes.exitCode}}' \
        >"$RUN_DIR/exits.log" 2>&1 &
    EVENTS_PID=$!
    follow_logs >/dev/null 2>&1 &
    FOLLOW_PID=$!
    # Compose waits for the health of each dependency (rabbitmq, redis, then the coordinator for
    # the clients) before starting its dependants.
    timeout 900 "${COMPOSE[@]}" up -d --no-build \
        --scale worker=$WORKERS --scale client=$CLIENTS >"$RUN_DIR/up.log" 2>&1 \
        || die "compose up failed (see $RUN_DIR/up.log)"
    note "$(docker ps --filter "label=com.docker.compose.project=$PROJECT" --format '{{.Names}}' | sort | tr '\n' ' ')"

    version() { local v; v=$(rcli GET "splitmq:$JOB:version" 2>/dev/null); echo "${v:-0}"; }
    live() { # live KIND: how many members of that kind (worker, client) are live
        local n; n=$(rcli ZCOUNT "splitmq:$JOB:members:$1" "$(date +%s)" +inf 2>/dev/null); echo "${n:-0}"
    }
    version_at_least() { [ "$(version)" -ge "$1" ]; }
    live_workers_are() { [ "$(live worker)" -eq "$1" ]; }
    aggregator_exited() {
        [ "$(docker inspect -f '{{.State.Status}}' "$(compose ps -q aggregator)")" = exited ]
    }
    holders() { # holders of the shard leases, one line each; "-" for a shard nobody holds
        local s
        for ((s = 0; s < SHARDS; s++)); do
            h=$(rcli GET "splitmq:$JOB:lease:shard:$s" 2>/dev/null)
            echo "${h:--}"
        done
    }
    # Every shard held, by exactly N distinct workers.
    lease_holders_are() {
        local all
        all=$(holders)
        ! grep -qx -- - <<<"$all" && [ "$(sort -u <<<"$all" | grep -c .)" -eq "$1" ]
    }
    progress() {
        note "version $(version), live workers $(live worker), live clients $(live client), shard holders: $(holders | tr '\n' ' ')"
    }

    # The aggregator publishes version 1 (the initial model) and one version per round.
    wait_for "the initial version" 900 version_at_least 1
    progress
    wait_for "2 trained versions" 1200 version_at_least 3
    progress
    v_scale=$(version)

    step "scale workers to $WORKERS_UP while training runs"
    compose up -d --no-build --no-recreate --no-deps --scale worker=$WORKERS_UP worker \
        >>"$RUN_DIR/up.log" 2>&1 || die "scaling up failed"
    wait_for "$WORKERS_UP live workers" 900 live_workers_are $WORKERS_UP
    # Each worker holds at most ceil(S/W) shards: the old ones hand shards to the new one.
    wait_for "the shards spread over $WORKERS_UP workers" 600 lease_holders_are $WORKERS_UP
    v_up=$(version)
    progress
    # Two versions later, one whole round has trained with every worker.
    wait_for "a round trained by $WORKERS_UP workers" 1200 version_at_least $((v_up + 2))
    progress

    step "scale workers back to $WORKERS_DOWN while training runs"
    compose up -d --no-build --no-recreate --no-deps --scale worker=$WORKERS_DOWN worker \
        >>"$RUN_DIR/up.log" 2>&1 || die "scaling down failed"
    wait_for "$WORKERS_DOWN live worker" 300 live_workers_are $WORKERS_DOWN
    wait_for "every shard held by the remaining worker" 300 lease_holders_are $WORKERS_DOWN
    v_down=$(version)
    progress
    wait_for "a round trained by $WORKERS_DOWN worker" 1200 version_at_least $((v_down + 2))
    progress
    SUMMARY+=("info  scaling: $WORKERS workers until v$v_scale, $WORKERS_UP holding a shard each from v$v_up, $WORKERS_DOWN holding all from v$v_down")

    # --- 6. the autoscaler ----------------------------------------------------------------------
    step "autoscaler: $AUTOSCALE_MIN to $AUTOSCALE_MAX workers by load (docker backend) while training runs"
    v_auto=$(version)
    t_auto=$(elapsed)
    compose_all up -d --no-build --no-recreate --no-deps autoscaler >>"$RUN_DIR/up.log" 2>&1 \
        || die "starting the autoscaler failed (see $RUN_DIR/up.log)"
    autoscaler=$(compose_all ps -q autoscaler)
    [ -n "$autoscaler" ] || die "no autoscaler container"
    running_workers() {
        docker ps -q --filter "label=com.docker.compose.project=$PROJECT" \
            --filter "label=com.docker.compose.service=worker" --filter status=running | grep -c . || true
    }
    # N worker containers running, N live in the store, and every shard held by one of them.
    scaled_to() { [ "$(running_workers)" -eq "$1" ] && live_workers_are "$1" && lease_holders_are "$1"; }
    autoscaler_alive() {
        local state
        state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$autoscaler")
        [ "${state% *}" = running ] || die "the autoscaler container is $state (see $RUN_DIR/logs)"
    }
    # Its decisions, from its log: "autoscaler: start|stop|exited WORKER (REASON); N workers".
    autoscaler_count() { docker logs "$autoscaler" 2>&1 | grep -c "autoscaler: $1 " || true; }
    at_max_while_training() {
        autoscaler_alive
        ! aggregator_exited || die "the job finished before the autoscaler reached $AUTOSCALE_MAX workers"
        scaled_to $AUTOSCALE_MAX
    }
    wait_for "the autoscaler to grow the pool to $AUTOSCALE_MAX workers" 900 at_max_while_training
    v_auto_up=$(version)
    t_auto_up=$(elapsed)
    progress
    wait_for "a round trained by the autoscaled workers" 1200 version_at_least $((v_auto_up + 1))
    progress

    step "wait for the job to finish"
    wait_for "the aggregator to finish the job" "$(deadline_left)" aggregator_exited
    progress
    # Clients log "... N batches sent" as they leave; they leave when the job is over.
    clients_done() {
        local id
        for id in $(compose ps -q client); do
            [ "$(docker inspect -f '{{.State.Status}}' "$id")" = exited ] || return 1
        done
    }
    wait_for "the clients to leave" 300 clients_done
    t_idle=$(elapsed)

    step "autoscaler: back to $AUTOSCALE_MIN worker once idle"
    # ... and every worker it asked to stop has exited (and was removed).
    at_min() {
        autoscaler_alive
        scaled_to $AUTOSCALE_MIN && [ "$(autoscaler_count stop)" -eq "$(autoscaler_count exited)" ]
    }
    wait_for "the autoscaler to shrink the pool to $AUTOSCALE_MIN worker" 600 at_min
    t_auto_down=$(elapsed)
    progress
    # Stopped before the last worker, which it would otherwise replace (below its minimum).
    compose_all stop -t 30 autoscaler >>"$RUN_DIR/up.log" 2>&1 || die "stopping the autoscaler failed"
    starts=$(autoscaler_count start)
    stops=$(autoscaler_count stop)
    exit_codes=$(docker logs "$autoscaler" 2>&1 | sed -nE 's/.*autoscaler: exited [^ ]+ \(exit code ([^)]*)\).*/\1/p' | tr '\n' ' ')
    check "autoscaler scaled up" "$([ "$starts" -ge $((AUTOSCALE_MAX - AUTOSCALE_MIN)) ]; echo $?)" \
        "$AUTOSCALE_MIN -> $AUTOSCALE_MAX worker containers, each holding a shard, $((t_auto_up - t_auto))s after it started at v$v_auto (at v$v_auto_up; $starts started)"
    check "autoscaler scaled down" "$([ "$stops" -ge $((AUTOSCALE_MAX - AUTOSCALE_MIN)) ] && ! grep -qv '^0$' <(tr ' ' '\n' <<<"${exit_codes% }"); echo $?)" \
        "$AUTOSCALE_MAX -> $AUTOSCALE_MIN $((t_auto_down - t_idle))s after the clients left ($stops stopped, exit codes ${exit_codes% })"
    # Each decision with its time on this run's clock.
    while IFS= read -r line; do SUMMARY+=("info  autoscaler $line"); done < <(docker logs --timestamps "$autoscaler" 2>&1 \
        | python3 -c 'import datetime, re, sys
start = int(sys.argv[1])
for line in sys.stdin:
    m = re.match(r"(\S{19})\S* .*autoscaler: (start|stop|exited) (\S+) \((.*)\); (\d+) workers", line)
    if m:
        at = datetime.datetime.fromisoformat(m[1]).replace(tzinfo=datetime.timezone.utc)
        print(f"{int(at.timestamp()) - start:5d}s {m[2]:<6} {m[3]} -> {m[5]} ({m[4]})")' "$START")

    # --- 7. checks ------------------------------------------------------------------------------
    step "checks"
    agg=$(compose ps -q aggregator)
    agg_code=$(docker inspect -f '{{.State.ExitCode}}' "$agg")
    final=$(version)
    check "job finished" "$([ "$agg_code" -eq 0 ] && [ "$final" -ge $((ROUNDS + 1)) ]; echo $?)" \
        "aggregator exit $agg_code, version $final after $ROUNDS rounds (scaled up after v$v_scale, down after v$v_down, autoscaled from v$v_auto)"
    check_batches_accounted

    # Reported, not a failure: a message a role refused is dead-lettered by design, and which
    # ones and why is what a reader of this run wants to know.
    dead=$(compose exec -T rabbitmq rabbitmqctl -q list_queues name messages 2>/dev/null \
        | awk -v q="$JOB.dead" '$1 == q {print $2}')
    reasons=$(cat "$RUN_DIR"/logs/*.log 2>/dev/null | sed -nE 's/.*dead-lettered a message from [^:]+: ([a-z_]+).*/\1/p' \
        | sort | uniq -c | awk '{printf "%s x%s ", $2, $1}')
    SUMMARY+=("info  dead letters: ${dead:-0} in $JOB.dead${reasons:+ (logged reasons: ${reasons% })}")
    # Leases that expired under a worker (late renewals on a loaded host) rather than being
    # handed over: the lease-fenced checkpoints must keep the count above exact regardless.
    ttl=$(smoke_job workers lease_ttl_s)
    lost=$(cat "$RUN_DIR"/logs/*worker*.log 2>/dev/null | grep -c "lost the lease" || true)
    handed=$(cat "$RUN_DIR"/logs/*worker*.log 2>/dev/null | grep -c "handed over job" || true)
    SUMMARY+=("info  shard leases (TTL ${ttl}s): $handed handed over, $lost expired under their holder")

    docker cp "$agg:/var/lib/splitmq/runs" "$RUN_DIR/report" >/dev/null
    metrics=$(find "$RUN_DIR/report" -name metrics.json | head -1)
    [ -n "$metrics" ] || die "no metrics.json in the aggregator's report"
    accuracy=$(python3 -c 'import json, sys
acc = [r["global_accuracy"] for r in json.load(open(sys.argv[1]))["records"]]
print(f"{acc[0]:.3f} {acc[-1]:.3f} {len(acc)} " + ",".join(f"{a:.2f}" for a in acc))' "$metrics")
    read -r acc_first acc_last n_records acc_curve <<<"$accuracy"
    check "accuracy rose" "$(python3 -c "import sys; sys.exit(not $acc_last > $acc_first)"; echo $?)" \
        "global accuracy $acc_first after round 1 -> $acc_last after round $n_records ($acc_curve)"

    restarts=""
    for service in coordinator aggregator worker client autoscaler; do
        for id in $(compose_all ps -q "$service"); do
            restarts+="$(docker inspect -f '{{.Name}}={{.RestartCount}}' "$id" | sed 's#^/##') "
        done
    done
    SUMMARY+=("info  restarts: ${restarts% }")
    sleep 2 # the last die events
    # Compose v1 names containers project_worker_N, v2 project-worker-N.
    worker_exits=$(grep -E "[-_]worker[-_][0-9]+ " "$RUN_DIR/exits.log" | sed -E "s/^${PROJECT}[-_]//" | tr '\n' ' ')
    bad_exits=$(grep -E "[-_]worker[-_][0-9]+ " "$RUN_DIR/exits.log" | grep -vc 'exitCode=0$' || true)
    check "workers stopped gracefully" "$([ "$bad_exits" -eq 0 ]; echo $?)" "${worker_exits% }"
    SUMMARY+=("info  report: $(dirname "$metrics")")
    [ ${#FAILURES[@]} -eq 0 ] || exit 1
}

main "$@"; exit
