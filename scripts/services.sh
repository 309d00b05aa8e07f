#!/usr/bin/env bash
# Make sure RabbitMQ and Redis answer on 127.0.0.1; start them when installed but not running.
# Says plainly what is missing otherwise. Exit 1 if a service can't be brought up.
set -uo pipefail

AMQP_PORT="${SPLITMQ_AMQP_PORT:-5672}"
REDIS_PORT="${SPLITMQ_REDIS_PORT:-6379}"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # name port seconds probe...
  local name=$1 port=$2 secs=$3; shift 3
  for _ in $(seq 1 "$secs"); do
    if port_open "$port" && { [ $# -eq 0 ] || "$@" >/dev/null 2>&1; }; then
      echo "services: $name is up on 127.0.0.1:$port"; return 0
    fi
    sleep 1
  done
  echo "services: $name did not come up on 127.0.0.1:$port within ${secs}s" >&2
  return 1
}

ok=0
if port_open "$REDIS_PORT"; then
  echo "services: Redis already running on 127.0.0.1:$REDIS_PORT"
elif command -v redis-server >/dev/null; then
  echo "services: starting Redis"
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for Redis "$REDIS_PORT" 30 redis-cli -p "$REDIS_PORT" ping || ok=1
else
  echo "services: Redis is not installed and nothing listens on 127.0.0.1:$REDIS_PORT." >&2
  echo "          Install it (Debian: apt-get install redis-server) or set SPLITMQ_REDIS_URL." >&2
  ok=1
fi

if port_open "$AMQP_PORT"; then
  echo "services: RabbitMQ already running on 127.0.0.1:$AMQP_PORT"
elif command -v rabbitmq-server >/dev/null; then
  echo "services: starting RabbitMQ (this takes 10-30 s)"
  rabbitmq-server -detached
  wait_for RabbitMQ "$AMQP_PORT" 120 rabbitmq-diagnostics -q check_port_connectivity || ok=1
else
  echo "services: RabbitMQ is not installed and nothing listens on 127.0.0.1:$AMQP_PORT." >&2
  echo "          Install it (Debian: apt-get install rabbitmq-server) or set SPLITMQ_AMQP_URL." >&2
  ok=1
fi
exit $ok
