#!/usr/bin/env bash
# A single-node Ray head on loopback for tether jobs, with the dashboard (job submission) and a Prometheus
# metrics endpoint.
#
#   deploy/local-cluster.sh up       start it (or, when it is already up, print its addresses)
#   deploy/local-cluster.sh down     stop it: SIGTERM to its own process group, then SIGKILL if needed
#   deploy/local-cluster.sh status   print the recorded state and whether the head is alive
#
# `up` prints
#   RAY_ADDRESS=127.0.0.1:<port>
#   DASHBOARD=http://127.0.0.1:<dashboard port>
#   METRICS=http://127.0.0.1:<metrics port>/metrics
# then submit with
#   ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- python -m learner.main ...
#
# Environment (all optional):
#   TETHER_CLUSTER_DIR       state dir (default: <repo>/.tether-cluster; keep it out of git)
#   TETHER_RAY_PORT          GCS port                     (default: a free port)
#   TETHER_DASHBOARD_PORT    dashboard / job API port     (default: a free port)
#   TETHER_METRICS_PORT      Prometheus export port       (default: a free port)
#   TETHER_RAY_CPUS          logical CPUs of the head     (default: 4)
#   TETHER_OBJECT_STORE_MIB  object store size, MiB       (default: 512)
#   TETHER_UP_TIMEOUT        seconds to wait for the head (default: 90)
#   TETHER_DOWN_TIMEOUT      seconds to wait after SIGTERM before SIGKILL (default: 30)
#
# The head runs in its own session (setsid), so `down` stops exactly the processes it started: never
# `ray stop`, which stops every Ray cluster on the machine. Every other port Ray would otherwise take at a
# fixed default (dashboard agent, runtime-env agent, client server, node and object managers) is picked
# free too, so this head can run next to another one.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_BIN="$ROOT/.venv/bin"
PYTHON="$VENV_BIN/python"
RAY="$VENV_BIN/ray"
STATE_DIR="${TETHER_CLUSTER_DIR:-$ROOT/.tether-cluster}"
STATE_FILE="$STATE_DIR/state.env"
LOG_FILE="$STATE_DIR/head.log"
HOST=127.0.0.1

# Every Ray process stays on loopback and sends nothing home.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0

die() {
    echo "local-cluster: $*" >&2
    exit 1
}

note() {
    echo "local-cluster: $*" >&2
}

usage() {
    echo "usage: $0 up|down|status" >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------- state

# Recorded state, loaded by load_state.
PID="" PGID="" RAY_PORT="" DASHBOARD_PORT="" METRICS_PORT="" TEMP_DIR="" STARTED_AT=""

load_state() {
    [[ -f "$STATE_FILE" ]] || return 1
    local key value
    while IFS='=' read -r key value; do
        case "$key" in
            PID) PID="$value" ;;
            PGID) PGID="$value" ;;
            RAY_PORT) RAY_PORT="$value" ;;
            DASHBOARD_PORT) DASHBOARD_PORT="$value" ;;
            METRICS_PORT) METRICS_PORT="$value" ;;
            TEMP_DIR) TEMP_DIR="$value" ;;
            STARTED_AT) STARTED_AT="$value" ;;
            *) ;;
        esac
    done <"$STATE_FILE"
    [[ "$PID" =~ ^[0-9]+$ && "$PGID" =~ ^[0-9]+$ && "$PGID" -gt 1 ]] || die "corrupt state file $STATE_FILE"
}

write_state() {
    local tmp="$STATE_FILE.tmp"
    {
        echo "PID=$PID"
        echo "PGID=$PGID"
        echo "RAY_PORT=$RAY_PORT"
        echo "DASHBOARD_PORT=$DASHBOARD_PORT"
        echo "METRICS_PORT=$METRICS_PORT"
        echo "TEMP_DIR=$TEMP_DIR"
        echo "STARTED_AT=$STARTED_AT"
        echo "LOG=$LOG_FILE"
    } >"$tmp"
    mv "$tmp" "$STATE_FILE"
}

clear_state() {
    rm -f "$STATE_FILE" "$STATE_FILE.tmp" "$LOG_FILE"
    rmdir "$STATE_DIR" 2>/dev/null || true
}

print_addresses() {
    echo "RAY_ADDRESS=$HOST:$RAY_PORT"
    echo "DASHBOARD=http://$HOST:$DASHBOARD_PORT"
    echo "METRICS=http://$HOST:$METRICS_PORT/metrics"
}

# ------------------------------------------------------------------------------------------- processes

# A process's command line, arguments joined by spaces (empty when it is gone). No pipe into `grep -q`:
# under pipefail, grep exiting early can SIGPIPE the writer and turn a match into a failure.
cmdline_of() {
    local text
    text="$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null)" || text=""
    printf '%s' "$text"
}

# True when the recorded head process is alive and is still the `ray start` we launched (its command line
# names our temp dir), so a reused PID is never mistaken for it.
head_alive() {
    [[ -n "$PID" && -n "$TEMP_DIR" ]] || return 1
    kill -0 "$PID" 2>/dev/null || return 1
    [[ "$(cmdline_of "$PID")" == *"--temp-dir=$TEMP_DIR"* ]]
}

# True while any process of the recorded process group exists.
group_alive() {
    [[ -n "$PGID" ]] || return 1
    kill -0 -- "-$PGID" 2>/dev/null
}

# The group is ours when its leader is our head, or (leader gone) when a member still names our temp dir:
# while any member lives, Linux does not reuse the group's id for a new process.
group_is_ours() {
    head_alive && return 0
    group_alive || return 1
    local member
    for member in $(pgrep -g "$PGID" 2>/dev/null || true); do
        if [[ "$(cmdline_of "$member")" == *"$TEMP_DIR"* ]]; then
            return 0
        fi
    done
    return 1
}

# Process groups that our processes created below the head: a job's entrypoint runs in its own session
# (Ray's job supervisor starts it with setsid), so signalling the head's group alone would leave it running.
# Only groups whose leader descends from the recorded head are listed.
child_groups() {
    ps -eo pid=,ppid=,pgid= | awk -v root="$PID" -v own="$PGID" '
        { parent[$1] = $2; group[$1] = $3; pids[NR] = $1 }
        END {
            for (i = 1; i <= NR; i++) {
                p = pids[i]; q = p; depth = 0
                while (q in parent && q != root && q > 1 && depth < 64) { q = parent[q]; depth++ }
                if (q == root && p != root) desc[p] = 1
            }
            for (p in desc) if (group[p] == p && p != own) print p
        }'
}

# True while any process of the given process groups exists.
any_group_alive() {
    local group
    for group in "$@"; do
        if kill -0 -- "-$group" 2>/dev/null; then return 0; fi
    done
    return 1
}

wait_groups_gone() {
    local deadline=$((SECONDS + $1))
    shift
    while any_group_alive "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

signal_groups() {
    local sig="$1" group
    shift
    for group in "$@"; do
        kill "-$sig" -- "-$group" 2>/dev/null || true
    done
}

stop_group() {
    if group_is_ours; then
        local groups timeout="${TETHER_DOWN_TIMEOUT:-30}"
        read -r -a groups <<<"$PGID $(child_groups | tr '\n' ' ')"
        note "stopping process group(s) ${groups[*]} (SIGTERM)"
        signal_groups TERM "${groups[@]}"
        if ! wait_groups_gone "$timeout" "${groups[@]}"; then
            note "still alive after ${timeout}s: SIGKILL to process group(s) ${groups[*]}"
            signal_groups KILL "${groups[@]}"
            wait_groups_gone 10 "${groups[@]}" || note "process group(s) ${groups[*]} survived SIGKILL"
        fi
    elif group_alive; then
        note "process group $PGID exists but is not this cluster's (its id was reused): left alone"
    fi
    if [[ -n "$TEMP_DIR" && "$TEMP_DIR" == /tmp/tc-* && -d "$TEMP_DIR" ]]; then
        rm -rf -- "$TEMP_DIR"
    fi
}

# ----------------------------------------------------------------------------------------------- ports

# N distinct free loopback ports, all bound at once so they differ from each other.
free_ports() {
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
EOF
}

port_in_use() {
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.settimeout(1)
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}

dashboard_ready() {
    curl -fsS --max-time 3 "http://$HOST:$DASHBOARD_PORT/api/version" >/dev/null 2>&1
}

metrics_ready() {
    curl -fsS --max-time 3 -o /dev/null "http://$HOST:$METRICS_PORT/metrics" 2>/dev/null
}

# -------------------------------------------------------------------------------------------- commands

cmd_up() {
    [[ -x "$RAY" ]] || die "no Ray CLI at $RAY: create the project's virtualenv first (.venv)"
    mkdir -p "$STATE_DIR"
    if load_state; then
        if head_alive; then
            note "already up (pid $PID, started $STARTED_AT)"
            print_addresses
            return 0
        fi
        note "stale state (head pid $PID is gone): cleaning up"
        stop_group
        clear_state
        mkdir -p "$STATE_DIR"
        PID="" PGID=""
    fi

    local free
    read -r -a free <<<"$(free_ports 9)"
    RAY_PORT="${TETHER_RAY_PORT:-${free[0]}}"
    DASHBOARD_PORT="${TETHER_DASHBOARD_PORT:-${free[1]}}"
    METRICS_PORT="${TETHER_METRICS_PORT:-${free[2]}}"
    local port
    for port in "$RAY_PORT" "$DASHBOARD_PORT" "$METRICS_PORT"; do
        [[ "$port" =~ ^[0-9]+$ ]] || die "not a port number: $port"
        if port_in_use "$port"; then die "port $port is already in use on $HOST"; fi
    done
    local cpus="${TETHER_RAY_CPUS:-4}" store_mib="${TETHER_OBJECT_STORE_MIB:-512}"
    TEMP_DIR="$(mktemp -d /tmp/tc-XXXXXX)" # short: Ray's socket paths must stay under 108 characters
    STARTED_AT="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

    # Jobs' entrypoints run with the head's environment: the venv's python comes first on PATH.
    export PATH="$VENV_BIN:$PATH"
    export VIRTUAL_ENV="$ROOT/.venv"
    export RAY_metrics_report_interval_ms=1000
    # workers at the priority of the user who starts the head (Ray's default, 15 steps lower, lets any busy
    # process on the machine starve a job's actors)
    export RAY_worker_niceness="${RAY_worker_niceness:-0}"
    # `down` is a SIGTERM: shut down at once instead of draining the node for up to 30 s
    export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

    nohup setsid "$RAY" start --head --block \
        --node-ip-address="$HOST" \
        --port="$RAY_PORT" \
        --dashboard-host="$HOST" \
        --dashboard-port="$DASHBOARD_PORT" \
        --metrics-export-port="$METRICS_PORT" \
        --dashboard-agent-listen-port="${free[3]}" \
        --dashboard-agent-grpc-port="${free[4]}" \
        --runtime-env-agent-port="${free[5]}" \
        --ray-client-server-port="${free[6]}" \
        --node-manager-port="${free[7]}" \
        --object-manager-port="${free[8]}" \
        --num-cpus="$cpus" \
        --object-store-memory="$((store_mib << 20))" \
        --temp-dir="$TEMP_DIR" \
        --disable-usage-stats \
        >"$LOG_FILE" 2>&1 </dev/null &
    PID=$!
    # the child becomes its own session (and group) leader once setsid has run: wait for that
    for _ in $(seq 50); do
        PGID="$(ps -o pgid= -p "$PID" | tr -d ' ' || true)"
        [[ "$PGID" == "$PID" || -z "$PGID" ]] && break
        sleep 0.1
    done
    if [[ "$PGID" != "$PID" ]]; then
        # setsid did not make it a session leader (or it died at once): stop just that pid
        kill -TERM "$PID" 2>/dev/null || true
        rm -rf -- "$TEMP_DIR"
        die "ray start (pid $PID) is not the leader of its own process group (pgid '${PGID:-none}'); log: $(tail -n 20 "$LOG_FILE" 2>/dev/null)"
    fi
    write_state

    local timeout="${TETHER_UP_TIMEOUT:-90}" deadline
    deadline=$((SECONDS + timeout))
    local ok=0
    while ((SECONDS < deadline)); do
        if ! head_alive; then
            break
        fi
        if port_in_use "$RAY_PORT" && dashboard_ready && metrics_ready; then
            ok=1
            break
        fi
        sleep 1
    done
    if ((ok == 0)); then
        if head_alive; then
            echo "local-cluster: the head did not answer within ${timeout}s; log tail:" >&2
        else
            echo "local-cluster: ray start exited; log tail:" >&2
        fi
        tail -n 40 "$LOG_FILE" >&2 || true
        stop_group
        clear_state
        exit 1
    fi
    note "up: pid $PID, process group $PGID, temp dir $TEMP_DIR, log $LOG_FILE"
    print_addresses
}

cmd_down() {
    if ! load_state; then
        note "not up (no state in $STATE_DIR): nothing to stop"
        return 0
    fi
    stop_group
    clear_state
    note "down"
}

cmd_status() {
    if ! load_state; then
        echo "status: down (no state in $STATE_DIR)"
        return 0
    fi
    if head_alive; then
        echo "status: up"
    else
        echo "status: dead (head pid $PID is gone; run '$0 down' to clean up)"
    fi
    echo "PID=$PID"
    echo "PGID=$PGID"
    echo "TEMP_DIR=$TEMP_DIR"
    echo "STARTED_AT=$STARTED_AT"
    echo "LOG=$LOG_FILE"
    print_addresses
    if head_alive; then
        dashboard_ready && echo "dashboard: answering" || echo "dashboard: not answering"
        metrics_ready && echo "metrics: answering" || echo "metrics: not answering"
    fi
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) usage ;;
esac
