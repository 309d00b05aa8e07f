#!/usr/bin/env bash
# A real cluster on one machine, for the cluster tests and for users to try (opt-in):
# three RabbitMQ nodes (splitmq-{1,2,3}@localhost, AMQP 5701-5703) joined with join_cluster,
# and a Redis primary (6390) + replica (6391) watched by three Sentinels (26390-26392, master
# name "splitmq"). Everything lives under SPLITMQ_CLUSTER_DIR (default /tmp/splitmq-cluster);
# the default RabbitMQ (rabbit@localhost, 5672) and Redis (6379) are never touched.
#
#   cluster.sh up | down | status
#   cluster.sh start-node N | kill-node N          RabbitMQ node N (1..3); kill = SIGKILL,
#                                                  prints "killed PID at EPOCH-SECONDS"
#   cluster.sh start-redis PORT | kill-redis PORT  a Redis server (6390, 6391); started as a
#                                                  replica of whatever Sentinel says is primary
#   cluster.sh pid rabbit N | pid redis PORT       the process id, exit 1 when not running
#   cluster.sh primary                             host:port of the primary, as Sentinel sees it
#   cluster.sh ctl ARGS...                         rabbitmqctl on the first live node
set -euo pipefail

SELF=$(readlink -f "$0")
DIR="${SPLITMQ_CLUSTER_DIR:-/tmp/splitmq-cluster}"
# The real scripts, not /usr/sbin's Debian wrapper: the wrapper switches to the rabbitmq user when
# run as root and then reads that user's cookie and home. Called directly, every node runs as
# whoever runs this script, with a cookie and a home of its own under $DIR.
RMQ_BIN="${SPLITMQ_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}"
TIMEOUT="${SPLITMQ_CLUSTER_TIMEOUT:-180}"
NODES=(1 2 3)
REDIS_PORTS=(6390 6391)
SENTINEL_PORTS=(26390 26391 26392)
MASTER=splitmq
MARKER="$DIR/.splitmq-cluster"

say() { echo "cluster: $*" >&2; }
die() { say "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# wait_until SECONDS WHAT COMMAND...: poll COMMAND until it succeeds.
wait_until() {
  local secs=$1 what=$2 deadline; shift 2
  deadline=$(($(date +%s) + secs))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then say "timed out after ${secs}s: $what"; return 1; fi
    sleep 0.2
  done
}

# A pid from a pid file, only if that process is still the one we started (pids get reused).
live_pid() {  # pidfile pattern
  local pid
  [ -s "$1" ] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 1
  echo "$pid"
}

# SIGKILL PID; prints "killed PID at EPOCH" (when the signal went) for whoever times recovery.
sigkill() {
  local pid=${1:-} at
  [ -n "$pid" ] || return 1
  at=$(now)
  kill -KILL "$pid"
  echo "killed $pid at $at"
  wait_until 10 "process $pid gone" bash -c "! kill -0 $pid"
}

# ---------------------------------------------------------------- RabbitMQ
node_name() { echo "splitmq-$1@localhost"; }
node_dir() { echo "$DIR/rabbit-$1"; }
# The pid file, else the node's Erlang VM by its command line: a node still booting has written
# no pid file yet, and one left behind by an interrupted run may have lost its directory, yet
# holds its ports; both must count as running (no second spawn) and be stopped by `down`.
rabbit_pid() {
  live_pid "$(node_dir "$1")/pid" "-home $(node_dir "$1") " ||
    pgrep -o -f -- "beam\.smp .* -home $(node_dir "$1") "
}

# rmq N PROGRAM ARGS...: a RabbitMQ program with node N's environment. Its own env file, config
# and plugins file, so /etc/rabbitmq's (NODENAME=rabbit@localhost, port 5672) never apply.
rmq() {
  local n=$1 prog=$2 d; shift 2
  d=$(node_dir "$n")
  HOME="$d" \
    RABBITMQ_NODENAME="$(node_name "$n")" \
    RABBITMQ_CONF_ENV_FILE="$d/rabbitmq-env.conf" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_PID_FILE="$d/pid" \
    RABBITMQ_NODE_PORT="$((5700 + n))" \
    RABBITMQ_DIST_PORT="$((25700 + n))" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
    "$RMQ_BIN/$prog" "$@"
}
ctl() { local n=$1; shift; rmq "$n" rabbitmqctl -q -n "$(node_name "$n")" "$@"; }

rabbit_prepare() {
  local n=$1 d
  d=$(node_dir "$n")
  mkdir -p "$d/log"
  [ -f "$d/rabbitmq.conf" ] || cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$((5700 + n))
loopback_users.guest = true
cluster_partition_handling = pause_minority
EOF
  [ -f "$d/enabled_plugins" ] || echo '[].' >"$d/enabled_plugins"
  [ -f "$d/rabbitmq-env.conf" ] || : >"$d/rabbitmq-env.conf"
  if [ ! -f "$d/.erlang.cookie" ]; then
    install -m 400 "$DIR/erlang.cookie" "$d/.erlang.cookie"
  fi
}

# Starts node N in the background (no wait); a no-op when it runs.
rabbit_spawn() {
  local n=$1 d
  rabbit_pid "$n" >/dev/null && return 0
  d=$(node_dir "$n")
  say "node $(node_name "$n") is not running: starting it"
  rabbit_prepare "$n"
  rm -f "$d/pid"
  # Its own session, so the caller's Ctrl-C or process-group kill does not reach the node.
  setsid nohup "$SELF" _serve "$n" </dev/null >>"$d/log/console.log" 2>&1 &
}

rabbit_wait() {  # until node N's rabbit application runs
  local n=$1
  ctl "$n" wait --timeout "$TIMEOUT" "$(node_dir "$n")/pid" >/dev/null ||
    { say "node $(node_name "$n") did not start; see $(node_dir "$n")/log"; return 1; }
}

running_nodes() {  # on node N: the running members of its cluster, one a line
  ctl "$1" cluster_status --formatter json 2>/dev/null |
    sed -n 's/.*"running_nodes":\[\([^]]*\)\].*/\1/p' | tr -d '"' | tr ',' '\n' | grep .
}

# A busy machine can make one rabbitmqctl call fail; that must not read as "not a member", which
# would stop and re-join a node of a running cluster.
joined() {
  local try
  for try in 1 2 3; do
    running_nodes "$1" | grep -qx "$(node_name 1)" && return 0
    sleep 1
  done
  return 1
}

# Joins nodes N... to node 1's cluster: their apps stop together, join one by one (each join is
# a schema change on node 1) and start together, so two joins cost about one app restart. A node
# whose idea of the cluster disagrees (left over from an earlier cluster) is reset first: this is
# a scratch cluster.
rabbit_join() {
  local n pids=() todo=() rc=0
  for n in "$@"; do joined "$n" || todo+=("$n"); done
  [ ${#todo[@]} -gt 0 ] || return 0
  say "joining ${todo[*]} to $(node_name 1)"
  for n in "${todo[@]}"; do ctl "$n" stop_app >/dev/null & pids+=($!); done
  for n in "${pids[@]}"; do wait "$n" || rc=1; done
  [ $rc -eq 0 ] || return 1
  for n in "${todo[@]}"; do
    if ! ctl "$n" join_cluster "$(node_name 1)" >/dev/null 2>&1; then
      ctl "$n" force_reset && ctl "$n" join_cluster "$(node_name 1)" || return 1
    fi
  done
  pids=()
  for n in "${todo[@]}"; do ctl "$n" start_app >/dev/null & pids+=($!); done
  for n in "${pids[@]}"; do wait "$n" || rc=1; done
  return $rc
}

cluster_whole() { [ "$(running_nodes "${1:-1}" | wc -l)" -eq ${#NODES[@]} ]; }

rabbit_start() {  # start-node N: start, wait, join; for a restart after kill-node
  local n=$1
  rabbit_spawn "$n"
  rabbit_wait "$n"
  [ "$n" -eq 1 ] || rabbit_join "$n"
}

rabbit_kill() { sigkill "$(rabbit_pid "$1")" || true; }

rabbit_stop() {
  local n=$1 pid
  pid=$(rabbit_pid "$n") || return 0
  # No pid file: booting, or left over without its directory; rabbitmqctl cannot reach it.
  if [ ! -s "$(node_dir "$n")/pid" ]; then kill -KILL "$pid" 2>/dev/null || true; return 0; fi
  ctl "$n" stop >/dev/null 2>&1 || true
  wait_until 15 "node $n stopped" bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
}

# ---------------------------------------------------------------- Redis and Sentinel
rcli() { local port=$1; shift; redis-cli -h 127.0.0.1 -p "$port" "$@"; }
redis_pid() { live_pid "$DIR/redis-$1/pid" "127.0.0.1:$1"; }
sentinel_pid() { live_pid "$DIR/sentinel-$1/pid" "127.0.0.1:$1"; }
info_field() {  # port section field
  rcli "$1" info "$2" 2>/dev/null | tr -d '\r' | sed -n "s/^$3://p"
}

# The primary's port: what the first answering Sentinel says, else a running server that says it
# is a master, else 6390 (a fresh start).
primary_port() {
  local p addr
  for p in "${SENTINEL_PORTS[@]}"; do
    addr=$(rcli "$p" sentinel get-master-addr-by-name "$MASTER" 2>/dev/null | tr -d '\r' | sed -n 2p)
    if [ -n "$addr" ]; then echo "$addr"; return 0; fi
  done
  for p in "${REDIS_PORTS[@]}"; do
    if [ "$(info_field "$p" replication role)" = master ]; then echo "$p"; return 0; fi
  done
  echo "${REDIS_PORTS[0]}"
}

# Starts the server on PORT, as a replica of the current primary unless it is the primary: an
# old primary coming back empty must never be taken for the primary.
redis_start() {
  local port=$1 primary d
  redis_pid "$port" >/dev/null && return 0
  d="$DIR/redis-$port"
  mkdir -p "$d"
  primary=$(primary_port)
  # Sentinels learn of a failover from each other within seconds: the first to answer may still
  # name this very server when another already names the promoted replica, and a server that
  # comes back as a second primary is demoted only later (the cluster test saw it come back as
  # primary under load). Any Sentinel naming another server wins.
  if [ "$primary" = "$port" ]; then
    local p addr
    for p in "${SENTINEL_PORTS[@]}"; do
      addr=$(rcli "$p" sentinel get-master-addr-by-name "$MASTER" 2>/dev/null | tr -d '\r' | sed -n 2p)
      if [ -n "$addr" ] && [ "$addr" != "$port" ]; then primary=$addr; break; fi
    done
  fi
  local role=()
  [ "$primary" = "$port" ] || role=(--replicaof 127.0.0.1 "$primary")
  redis-server --port "$port" --bind 127.0.0.1 --daemonize yes --pidfile "$d/pid" \
    --logfile "$d/redis.log" --dir "$d" --save "" --appendonly yes --appendfsync always \
    --repl-diskless-sync-delay 0 "${role[@]}"
  wait_until 10 "redis $port answers" rcli "$port" ping
  [ ${#role[@]} -eq 0 ] ||
    wait_until "$TIMEOUT" "redis $port in sync with $primary" replica_link_up "$port"
}

redis_kill() { sigkill "$(redis_pid "$1")" || true; }

sentinel_start() {
  local port=$1 d
  sentinel_pid "$port" >/dev/null && return 0
  d="$DIR/sentinel-$port"
  mkdir -p "$d"
  # Sentinel rewrites its file with what it learns (the current primary, its peers), so a
  # restarted Sentinel resumes from there; written only once.
  [ -f "$d/sentinel.conf" ] || cat >"$d/sentinel.conf" <<EOF
port $port
bind 127.0.0.1
daemonize yes
pidfile $d/pid
logfile $d/sentinel.log
dir $d
sentinel monitor $MASTER 127.0.0.1 $(primary_port) 2
sentinel down-after-milliseconds $MASTER 1000
sentinel failover-timeout $MASTER 6000
sentinel parallel-syncs $MASTER 1
EOF
  redis-server "$d/sentinel.conf" --sentinel
  wait_until 10 "sentinel $port answers" rcli "$port" ping
}

replica_link_up() { [ "$(info_field "$1" replication master_link_status)" = up ]; }

replica_synced() {  # the primary sees one online replica and that replica's link is up
  local primary replica
  primary=$(primary_port)
  for replica in "${REDIS_PORTS[@]}"; do [ "$replica" = "$primary" ] || break; done
  info_field "$primary" replication slave0 | grep -q 'state=online' &&
    replica_link_up "$replica"
}

sentinel_field() {  # port field: from SENTINEL MASTER's key/value lines
  rcli "$1" sentinel master "$MASTER" 2>/dev/null | tr -d '\r' | awk -v k="$2" 'p { print; exit } $0 == k { p = 1 }'
}

# A Sentinel can vote in a failover once it knows the primary, the replica and both peers.
sentinel_ready() {
  [ "$(sentinel_field "$1" flags)" = master ] &&
    [ "$(sentinel_field "$1" num-slaves)" = 1 ] &&
    [ "$(sentinel_field "$1" num-other-sentinels)" = $((${#SENTINEL_PORTS[@]} - 1)) ]
}

# ---------------------------------------------------------------- commands
prepare_dir() {
  mkdir -p "$DIR"
  touch "$MARKER"
  if [ ! -f "$DIR/erlang.cookie" ]; then
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -dc '0-9a-f' >"$DIR/erlang.cookie")
  fi
}

up_once() {
  local n p primary failed=0 pids=()
  prepare_dir
  for n in "${NODES[@]}"; do rabbit_spawn "$n"; done
  # Redis comes up while the Erlang nodes boot. Sentinels first: after a failover their files
  # name the primary, which must then start as the primary, the others as its replicas.
  for p in "${SENTINEL_PORTS[@]}"; do sentinel_start "$p"; done
  primary=$(primary_port)
  redis_start "$primary"
  for p in "${REDIS_PORTS[@]}"; do redis_start "$p"; done
  for n in "${NODES[@]}"; do rabbit_wait "$n" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  [ $failed -eq 0 ] || return 1
  # A whole cluster is left alone: joining stops a node's app and may reset it.
  cluster_whole || rabbit_join "${NODES[@]:1}" || return 1
  wait_until "$TIMEOUT" "3 running RabbitMQ nodes" cluster_whole || return 1
  wait_until "$TIMEOUT" "the Redis replica in sync" replica_synced || return 1
  for p in "${SENTINEL_PORTS[@]}"; do
    wait_until "$TIMEOUT" "sentinel $p ready" sentinel_ready "$p" || return 1
  done
}

cmd_up() {
  command -v redis-server >/dev/null || die "redis-server is not installed"
  [ -x "$RMQ_BIN/rabbitmq-server" ] || die "RabbitMQ not found in $RMQ_BIN (apt-get install rabbitmq-server)"
  local t0
  t0=$(now)
  if anything_running; then
    # Someone may be using it: never tear a running cluster down. A wait that timed out on a busy
    # machine gets one more try; after that, say so and leave every node as it is.
    up_once || { say "not whole yet; waiting once more"; up_once; } ||
      die "the cluster runs but is not whole; see 'cluster.sh status' and the logs in $DIR"
  elif ! up_once; then
    # Whatever was half-made from nothing (a node that cannot boot on its old data, a stuck join)
    # is not worth repairing in a scratch cluster: start over once, from nothing.
    say "not up; starting over from an empty $DIR"
    cmd_down
    up_once || die "the cluster did not come up; logs are in $DIR"
  fi
  say "up in $(since "$t0") s"
}

anything_running() {
  local n p
  [ -d "$DIR" ] || return 1
  for n in "${NODES[@]}"; do rabbit_pid "$n" >/dev/null && return 0; done
  for p in "${REDIS_PORTS[@]}"; do redis_pid "$p" >/dev/null && return 0; done
  for p in "${SENTINEL_PORTS[@]}"; do sentinel_pid "$p" >/dev/null && return 0; done
  return 1
}

cmd_down() {
  local n p pids=() t0
  t0=$(now)
  if [ -e "$DIR" ] && [ ! -f "$MARKER" ]; then die "$DIR is not a cluster directory; not touching it"; fi
  # Nodes first, even without the directory: one left from an interrupted run still holds ports.
  for n in "${NODES[@]}"; do rabbit_stop "$n" & pids+=($!); done
  if [ ! -d "$DIR" ]; then
    for p in "${pids[@]}"; do wait "$p" || true; done
    return 0
  fi
  local pid redis=()
  for p in "${SENTINEL_PORTS[@]}"; do pid=$(sentinel_pid "$p") && redis+=("$pid"); done
  for p in "${REDIS_PORTS[@]}"; do pid=$(redis_pid "$p") && redis+=("$pid"); done
  if [ ${#redis[@]} -gt 0 ]; then
    kill -TERM "${redis[@]}" 2>/dev/null || true
    wait_until 10 "Redis stopped" bash -c "! kill -0 ${redis[*]} 2>/dev/null" ||
      kill -KILL "${redis[@]}" 2>/dev/null || true
  fi
  for p in "${pids[@]}"; do wait "$p" || true; done
  rm -rf "$DIR"
  say "down in $(since "$t0") s"
}

# One line a process, "KIND NAME up|down key=value...", then "cluster ok|degraded".
cmd_status() {
  local n p pid bad=0 running="" members=0 primary
  for n in "${NODES[@]}"; do
    if rabbit_pid "$n" >/dev/null && running=$(running_nodes "$n"); then break; fi
  done
  [ -z "$running" ] || members=$(wc -l <<<"$running")
  for n in "${NODES[@]}"; do
    if pid=$(rabbit_pid "$n") && grep -qx "$(node_name "$n")" <<<"$running"; then
      echo "rabbit $(node_name "$n") up pid=$pid amqp=$((5700 + n)) members=$members"
    else
      echo "rabbit $(node_name "$n") down amqp=$((5700 + n))"; bad=1
    fi
  done
  primary=$(primary_port)
  for p in "${REDIS_PORTS[@]}"; do
    if pid=$(redis_pid "$p"); then
      local role; role=$(info_field "$p" replication role)
      if [ "$role" = slave ]; then
        local link; link=$(info_field "$p" replication master_link_status)
        echo "redis $p up pid=$pid role=replica of=$(info_field "$p" replication master_port) link=$link"
        [ "$link" = up ] || bad=1
      else
        echo "redis $p up pid=$pid role=primary"
        [ "$p" = "$primary" ] || bad=1
      fi
    else
      echo "redis $p down"; bad=1
    fi
  done
  for p in "${SENTINEL_PORTS[@]}"; do
    if pid=$(sentinel_pid "$p"); then
      echo "sentinel $p up pid=$pid master=$(sentinel_field "$p" port) flags=$(sentinel_field "$p" flags)" \
        "replicas=$(sentinel_field "$p" num-slaves) peers=$(sentinel_field "$p" num-other-sentinels)"
      sentinel_ready "$p" || bad=1
    else
      echo "sentinel $p down"; bad=1
    fi
  done
  if [ $bad -eq 0 ]; then echo "cluster ok"; else echo "cluster degraded"; fi
  return $bad
}

cmd_ctl() {
  local n
  for n in "${NODES[@]}"; do
    if rabbit_pid "$n" >/dev/null && ctl "$n" ping >/dev/null 2>&1; then ctl "$n" "$@"; return; fi
  done
  die "no RabbitMQ node is running"
}

node_arg() { case "${1:-}" in 1 | 2 | 3) echo "$1" ;; *) die "expected a node number 1-3, got '${1:-}'" ;; esac; }
redis_arg() {
  case " ${REDIS_PORTS[*]} " in *" ${1:-x} "*) echo "$1" ;; *) die "expected a Redis port (${REDIS_PORTS[*]}), got '${1:-}'" ;; esac
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  start-node) n=$(node_arg "${2:-}"); prepare_dir; rabbit_start "$n" ;;
  kill-node) rabbit_kill "$(node_arg "${2:-}")" ;;
  start-redis) p=$(redis_arg "${2:-}"); prepare_dir; redis_start "$p" ;;
  kill-redis) redis_kill "$(redis_arg "${2:-}")" ;;
  pid)
    case "${2:-}" in
      rabbit) rabbit_pid "$(node_arg "${3:-}")" ;;
      redis) redis_pid "$(redis_arg "${3:-}")" ;;
      *) die "usage: cluster.sh pid rabbit N | pid redis PORT" ;;
    esac ;;
  primary) echo "127.0.0.1:$(primary_port)" ;;
  ctl) shift; cmd_ctl "$@" ;;
  _serve) rmq "$(node_arg "${2:-}")" rabbitmq-server ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2 ;;
esac
