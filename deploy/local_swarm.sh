#!/usr/bin/env bash
# A coordinator and N node agents on loopback, each with its own data dir, for trying
# Tessera on one machine. Ctrl-C (or the end of this script, or SIGTERM) stops all of them:
# nodes drain first, then the coordinator.
#
#   deploy/local_swarm.sh                 3 CPU nodes, state in a new temp folder
#   deploy/local_swarm.sh -n 5 -d swarm   5 nodes, state in ./swarm (kept across runs:
#                                         same node keys, same ids, same database)
#   deploy/local_swarm.sh --mqtt mqtt://127.0.0.1:1883 -- --max-memory-gb 2
#                                         with a broker, extra flags for every node
#
# Environment: PYTHON (default: the repo's .venv, else python3), DEVICE (default cpu).
set -euo pipefail

usage() {
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

NODES=3
WORK=""
MQTT=""
NODE_EXTRA=()
while (($#)); do
    case "$1" in
        -n | --nodes) NODES="${2:?-n needs a number}"; shift 2 ;;
        -d | --dir) WORK="${2:?-d needs a folder}"; shift 2 ;;
        --mqtt) MQTT="${2:?--mqtt needs a URL}"; shift 2 ;;
        -h | --help) usage 0 ;;
        --) shift; NODE_EXTRA=("$@"); break ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$NODES" =~ ^[0-9]+$ ]] || { echo "-n must be a whole number, got $NODES" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
DEVICE="${DEVICE:-cpu}"
if [[ -z "$WORK" ]]; then
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessera-swarm.XXXXXX")"
fi
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
cd "$REPO"  # so `python -m` finds the packages even without an install

PIDS=()       # every child, in start order
NODE_PIDS=()

log() { printf '[local_swarm] %s\n' "$*"; }

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    ((${#PIDS[@]})) || exit "$status"
    log "stopping: nodes drain first, then the coordinator"
    # Nodes first, so they say goodbye to a coordinator that is still there.
    for pid in "${NODE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait_gone 20 "${NODE_PIDS[@]}"
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait_gone 10 "${PIDS[@]}"
    for pid in "${PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid ignored SIGTERM; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    wait 2>/dev/null || true
    log "all stopped; logs and state are in $WORK"
    exit "$status"
}

# Wait up to $1 seconds for the other arguments (pids) to exit.
wait_gone() {
    local deadline=$((SECONDS + $1)) pid alive
    shift
    while ((SECONDS < deadline)); do
        alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || return 0
        sleep 0.1
    done
}

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Wait up to $3 seconds until file $2 contains pattern $4; fail early if pid $1 died.
wait_for() {
    local pid=$1 file=$2 timeout=$3 pattern=$4 deadline=$((SECONDS + $3))
    while ! grep -q -- "$pattern" "$file" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "process $pid exited early; last lines of $file:"
            tail -n 20 "$file" >&2 || true
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            log "no '$pattern' in $file after ${timeout}s; last lines:"
            tail -n 20 "$file" >&2 || true
            exit 1
        fi
        sleep 0.1
    done
}

COORD_DIR="$WORK/coordinator"
mkdir -p "$COORD_DIR"
rm -f "$COORD_DIR/coordinator.addr"
coord_args=(serve --listen 127.0.0.1:0 --db "$COORD_DIR/coordinator.db" --data-dir "$COORD_DIR")
[[ -n "$MQTT" ]] && coord_args+=(--mqtt "$MQTT")
"$PYTHON" -m coordinator.cli "${coord_args[@]}" >"$COORD_DIR/coordinator.log" 2>&1 &
COORD_PID=$!
PIDS+=("$COORD_PID")
log "started the coordinator (pid $COORD_PID), log $COORD_DIR/coordinator.log"
wait_for "$COORD_PID" "$COORD_DIR/coordinator.log" 60 "serving on"
ADDR="$(cat "$COORD_DIR/coordinator.addr")"
log "coordinator serving on $ADDR"

for i in $(seq 1 "$NODES"); do
    dir="$WORK/node-$i"
    mkdir -p "$dir"
    node_args=(join --coordinator "$ADDR" --name "node-$i" --data-dir "$dir" --device "$DEVICE"
        --listen 127.0.0.1:0 --drain-timeout-s 10)
    [[ -n "$MQTT" ]] && node_args+=(--mqtt "$MQTT")
    TESSERA_BACKOFF_CAP_S="${TESSERA_BACKOFF_CAP_S:-2}" \
        "$PYTHON" -m node_agent.cli "${node_args[@]}" ${NODE_EXTRA[@]+"${NODE_EXTRA[@]}"} \
        >"$dir/node.log" 2>&1 &
    PIDS+=("$!")
    NODE_PIDS+=("$!")
    log "started node-$i (pid $!), log $dir/node.log"
done
for i in $(seq 1 "$NODES"); do
    wait_for "${NODE_PIDS[$((i - 1))]}" "$WORK/node-$i/node.log" 120 "registered as"
done

cat <<EOF

[local_swarm] the swarm is up: coordinator $ADDR, $NODES node(s), state in $WORK
  list nodes:    $PYTHON -m coordinator.cli nodes list --data-dir $COORD_DIR
  drain a node:  $PYTHON -m coordinator.cli nodes drain NODE_ID --data-dir $COORD_DIR
  follow logs:   tail -f $COORD_DIR/coordinator.log $WORK/node-*/node.log
  stop:          Ctrl-C

EOF
# Until Ctrl-C, or until every child has exited on its own.
wait
