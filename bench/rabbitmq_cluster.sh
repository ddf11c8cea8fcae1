#!/usr/bin/env bash
# rabbitmq_cluster.sh - a private 3-node RabbitMQ cluster with an amqp AND an amqps listener
# per node, for `broker_bench.py --cluster --rabbitmq --tls` (the shared rabbitmq_baseline.sh
# gives its nodes no TLS listener and one config file for all of them; its node handling is
# copied here: own epmd, Erlang cookie, config and data under $RMQ_TLS_BASE, stopped by pid).
#
# Usage:  bash bench/rabbitmq_cluster.sh start CERTDIR   # CERTDIR: ca.pem cert.pem key.pem
#         bash bench/rabbitmq_cluster.sh stop
# Nodes r1..r3@localhost: amqp 127.0.0.1:5701-5703, amqps 5711-5713 (RabbitMQ's ssl_options
# defaults otherwise: verify_none, no client certificates), dist port amqp + 20000, epmd on
# $EPMD_PORT (4392). Beam pids in $RMQ_TLS_BASE/rN/beam.pid. Needs Debian's rabbitmq-server
# (3.10.8; rabbitmq_baseline.sh install puts it there) and root.
set -euo pipefail

BASE=${RMQ_TLS_BASE:?set RMQ_TLS_BASE to a private directory}
EPMD_PORT=${EPMD_PORT:-4392}
SBIN=/usr/lib/rabbitmq/bin

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
amqp_port() { echo $((5700 + ${1#r})); }
tls_port() { echo $((5710 + ${1#r})); }

rmq() {
  local name=$1; shift
  local port; port=$(amqp_port "$name")
  local dir=$BASE/$name
  env HOME="$BASE/home" ERL_EPMD_PORT="$EPMD_PORT" ERL_CRASH_DUMP="$dir/erl_crash.dump" \
    RABBITMQ_CONF_ENV_FILE="$BASE/rabbitmq-env.conf" \
    RABBITMQ_CONFIG_FILE="$dir/rabbitmq" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$BASE/enabled_plugins" \
    RABBITMQ_NODENAME="$name@localhost" RABBITMQ_NODE_PORT="$port" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_DIST_PORT="$((port + 20000))" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_PID_FILE="$dir/beam.pid" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' \
    "$@"
}

prep_base() {
  mkdir -p "$BASE/home"
  : > "$BASE/rabbitmq-env.conf"
  echo '[].' > "$BASE/enabled_plugins"
  if [ ! -f "$BASE/home/.erlang.cookie" ]; then
    head -c 30 /dev/urandom | od -An -tx1 | tr -d ' \n' | head -c 20 > "$BASE/home/.erlang.cookie"
    chmod 400 "$BASE/home/.erlang.cookie"
  fi
}

ensure_epmd() {
  if [ -f "$BASE/epmd.pid" ] && kill -0 "$(cat "$BASE/epmd.pid")" 2>/dev/null; then return; fi
  epmd -port "$EPMD_PORT" -address 127.0.0.1 > "$BASE/epmd.log" 2>&1 &
  echo $! > "$BASE/epmd.pid"
  for _ in $(seq 1 50); do
    epmd -port "$EPMD_PORT" -names > /dev/null 2>&1 && return 0
    sleep 0.1
  done
  log "epmd did not come up on port $EPMD_PORT"; return 1
}

start_node() {
  local name=$1 certs=$2 dir=$BASE/$1
  rm -rf "$dir/mnesia"
  mkdir -p "$dir/mnesia" "$dir/log"
  cat > "$dir/rabbitmq.conf" <<EOF
listeners.ssl.default = $(tls_port "$name")
ssl_options.cacertfile = $certs/ca.pem
ssl_options.certfile = $certs/cert.pem
ssl_options.keyfile = $certs/key.pem
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
EOF
  ensure_epmd
  cd "$dir"
  rmq "$name" setsid "$SBIN/rabbitmq-server" > "$dir/log/stdout" 2>&1 < /dev/null &
  echo $! > "$dir/server.pid"
  rmq "$name" "$SBIN/rabbitmqctl" -n "$name@localhost" -q wait --timeout 180 "$dir/beam.pid"
  rmq "$name" "$SBIN/rabbitmqctl" -n "$name@localhost" -q await_startup --timeout 180
  log "node $name@localhost up: amqp $(amqp_port "$name") amqps $(tls_port "$name")"
}

stop_node() {
  local name=$1 dir=$BASE/$1
  [ -f "$dir/beam.pid" ] || return 0
  local pid; pid=$(cat "$dir/beam.pid")
  if kill -0 "$pid" 2>/dev/null; then
    rmq "$name" "$SBIN/rabbitmqctl" -n "$name@localhost" -q stop || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" || true; fi
  fi
  rm -f "$dir/beam.pid"
  log "node $name@localhost stopped"
}

do_stop() {
  for n in r3 r2 r1; do stop_node "$n"; done
  if [ -f "$BASE/epmd.pid" ]; then
    kill "$(cat "$BASE/epmd.pid")" 2>/dev/null || true
    rm -f "$BASE/epmd.pid"
  fi
}

do_start() {
  local certs=${1:?usage: $0 start CERTDIR}
  prep_base
  # A node that fails to come up must not stay behind.
  trap 'do_stop' ERR
  for n in r1 r2 r3; do start_node "$n" "$certs"; done
  for n in r2 r3; do
    rmq "$n" "$SBIN/rabbitmqctl" -n "$n@localhost" -q stop_app
    rmq "$n" "$SBIN/rabbitmqctl" -n "$n@localhost" -q join_cluster r1@localhost
    rmq "$n" "$SBIN/rabbitmqctl" -n "$n@localhost" -q start_app
  done
  trap - ERR
}

case "${1:-}" in
  start) do_start "${2:-}" ;;
  stop) do_stop ;;
  *) echo "usage: $0 start CERTDIR | stop" >&2; exit 2 ;;
esac
