#!/usr/bin/env bash
# Drive training on the GPU server over SSH.
#
#   scripts/remote.sh sync                      copy code and configs (what git knows) to the server
#   scripts/remote.sh run CONFIG [section.key=value ...] [--resume]
#                                               start train.py in a detached tmux session named after the
#                                               run; output also goes to runs/<run_name>/train.log there
#   scripts/remote.sh chain BOARD [chain.key=value ...] [--budget-min MINUTES]
#                                               the whole run (python -m chain run BOARD) the same way: a
#                                               tmux session named after its folder runs/<name>, whose
#                                               output also goes to runs/<name>/train.log there
#   scripts/remote.sh logs [RUN]                last lines of the log, followed while the run lives
#                                               (RUN defaults to the run whose log changed last)
#   scripts/remote.sh status                    live runs with their last log line, GPU memory
#   scripts/remote.sh attach RUN                attach to the run's tmux session (detach: Ctrl-b d)
#   scripts/remote.sh stop RUN                  SIGINT to train.py: it checkpoints and exits; waits for it
#   scripts/remote.sh fetch RUN                 metrics.jsonl, config.yaml, train.log, ckpt_*.pt -> runs/RUN/
#   scripts/remote.sh exec COMMAND [ARGS ...]   run a command in REMOTE_DIR (e.g. exec make data-smoke)
#
# Settings come from .env at the repository root (ENLACE_ENV_FILE names another file); .env.example
# documents them. The file is parsed, never sourced; a variable set in the environment wins over it.
#
# How commands reach the server: the functions named server_* below are sent with `declare -f` and run
# there by `bash -c`. Every value travels as one single-quoted word, so spaces, quotes, `;`, `$(...)` and
# backticks in a config path or an override are data on the server, never code. Runs live in tmux on a
# socket of their own (`tmux -L enlace`, REMOTE_TMUX_SOCKET), so cutting the SSH connection does not
# touch them and `status` lists exactly the runs.
set -uo pipefail
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "remote.sh: needs bash 4.4 or newer, this is $BASH_VERSION (macOS: brew install bash)" >&2
    exit 1
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ENV_FILE=${ENLACE_ENV_FILE:-$ROOT/.env}
SETTINGS=(REMOTE_HOST REMOTE_USER REMOTE_PORT REMOTE_DIR REMOTE_KEY REMOTE_PYTHON REMOTE_TMUX_SOCKET
    REMOTE_SSH_OPTS)
REQUIRED=(REMOTE_HOST REMOTE_USER REMOTE_DIR)
STOP_TIMEOUT_S=600
# A run name is a folder under runs/ (the schema's pattern for run_name) and, for runs started here, a
# tmux session name, where '.' would read as a window separator: remote.sh starts only runs without one.
RUN_NAME_PATTERN='^[A-Za-z0-9][A-Za-z0-9._-]*$'
SESSION_NAME_PATTERN='^[A-Za-z0-9][A-Za-z0-9_-]*$'

die() { printf 'remote.sh: %s\n' "$1" >&2; exit "${2:-1}"; }
usage_error() { printf 'remote.sh: %s\n' "$1" >&2; usage >&2; exit 2; }
usage() { sed -n '4,17s/^# \{0,1\}/  /p' "${BASH_SOURCE[0]}"; }

# ---------------------------------------------------------------------------------------------------------
# Settings

load_settings() {
    [[ -f $ENV_FILE ]] || die "settings file $ENV_FILE not found: copy .env.example to .env and set \
REMOTE_HOST, REMOTE_USER, REMOTE_DIR (and REMOTE_KEY)"
    local line key value
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%$'\r'}
        # Only REMOTE_* lines are ours; other keys in .env (API keys, ...) are neither read nor shown.
        [[ $line =~ ^[[:space:]]*(export[[:space:]]+)?(REMOTE_[A-Z_]+)=(.*)$ ]] || continue
        key=${BASH_REMATCH[2]}
        value=${BASH_REMATCH[3]}
        if [[ $value =~ ^\"(.*)\"[[:space:]]*$ || $value =~ ^\'(.*)\'[[:space:]]*$ ]]; then
            value=${BASH_REMATCH[1]}
        else
            value=${value%%[[:space:]]#*}
            value=${value%"${value##*[![:space:]]}"}
        fi
        is_setting "$key" || die "$ENV_FILE: unknown setting $key (known: ${SETTINGS[*]})"
        [[ -n ${!key+set} ]] || printf -v "$key" '%s' "$value"
    done <"$ENV_FILE"

    local name
    for name in "${REQUIRED[@]}"; do
        [[ -n ${!name:-} ]] || die "$name is not set in $ENV_FILE (see .env.example)"
    done
    REMOTE_PORT=${REMOTE_PORT:-22}
    REMOTE_KEY=${REMOTE_KEY:-}
    REMOTE_PYTHON=${REMOTE_PYTHON:-.venv/bin/python}
    REMOTE_TMUX_SOCKET=${REMOTE_TMUX_SOCKET:-enlace}
    REMOTE_SSH_OPTS=${REMOTE_SSH_OPTS:-}
    [[ $REMOTE_PORT =~ ^[0-9]+$ ]] || die "REMOTE_PORT in $ENV_FILE must be a port number, got '$REMOTE_PORT'"
    [[ $REMOTE_TMUX_SOCKET =~ ^[A-Za-z0-9_.-]+$ ]] ||
        die "REMOTE_TMUX_SOCKET in $ENV_FILE must be letters, digits, '.', '-' or '_'"
    if [[ -n $REMOTE_KEY ]]; then
        # shellcheck disable=SC2088  # a literal '~/' typed in .env, expanded here by hand
        [[ $REMOTE_KEY == '~/'* ]] && REMOTE_KEY=$HOME/${REMOTE_KEY#'~/'}
        [[ -r $REMOTE_KEY ]] || die "REMOTE_KEY in $ENV_FILE: key file $REMOTE_KEY not found or not readable"
    fi
    # ssh starts in the home directory, so '~/x' and 'x' are the same place; rsync wants the latter.
    # shellcheck disable=SC2088
    [[ $REMOTE_DIR == '~/'* ]] && REMOTE_DIR=${REMOTE_DIR#'~/'}
    [[ $REMOTE_DIR == '~' ]] && die "REMOTE_DIR in $ENV_FILE must be a directory for the project, not ~ itself"

    # shellcheck disable=SC2153  # REMOTE_HOST is set from .env by printf -v above
    TARGET=$REMOTE_USER@$REMOTE_HOST
    local extra_options=()
    read -r -a extra_options <<<"$REMOTE_SSH_OPTS"
    # ssh keeps the first value it sees for an option, so REMOTE_SSH_OPTS come first and win.
    SSH=(ssh "${extra_options[@]}" -p "$REMOTE_PORT"
        -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no
        -o StrictHostKeyChecking=accept-new -o ConnectTimeout=10
        -o ServerAliveInterval=15 -o ServerAliveCountMax=4)
    [[ -n $REMOTE_KEY ]] && SSH+=(-i "$REMOTE_KEY" -o IdentitiesOnly=yes)
}

is_setting() {
    local name
    for name in "${SETTINGS[@]}"; do [[ $1 == "$name" ]] && return 0; done
    return 1
}

# ---------------------------------------------------------------------------------------------------------
# Talking to the server

# POSIX single quotes: the remote login shell (bash, dash, zsh) reads the word back byte for byte.
quote() {
    local escaped_quote="'\\''"
    printf "'%s'" "${1//\'/$escaped_quote}"
}

# on_server [-t] COMMAND [ARGS...]: run server_main COMMAND ARGS in REMOTE_DIR on the server.
on_server() {
    local tty=()
    if [[ $1 == -t ]]; then
        tty=(-t)
        shift
    fi
    local functions program remote_command arg
    read -r -a functions <<<"$(compgen -A function server_ | tr '\n' ' ')"
    program="$(declare -f "${functions[@]}"); server_main \"\$@\""
    remote_command="bash -c $(quote "$program") remote.sh"
    for arg in "$REMOTE_DIR" "$REMOTE_PYTHON" "$REMOTE_TMUX_SOCKET" "$@"; do
        remote_command+=" $(quote "$arg")"
    done
    "${SSH[@]}" "${tty[@]}" "$TARGET" "$remote_command"
    check_ssh_status $?
}

# ssh answers 255 when it could not connect or log in; say which, without printing anything secret.
check_ssh_status() {
    local status=$1 probe_errors key=${REMOTE_KEY:-"none: ssh's default keys"}
    ((status == 255)) || return "$status"
    if probe_errors=$("${SSH[@]}" -o BatchMode=yes "$TARGET" true 2>&1 >/dev/null); then
        die "ssh to $TARGET port $REMOTE_PORT ended with status 255 (connection lost, or the remote command \
failed with 255)" 255
    fi
    case $probe_errors in
        *'Permission denied'*)
            die "$TARGET refused the login: the public key of REMOTE_KEY ($key) \
must be in ~$REMOTE_USER/.ssh/authorized_keys on the server" 255 ;;
        *'Host key verification failed'* | *'IDENTIFICATION HAS CHANGED'*)
            die "the host key of $REMOTE_HOST does not match the one in known_hosts: check the server before \
trusting it (ssh-keygen -R $REMOTE_HOST)" 255 ;;
        *)
            die "cannot reach $REMOTE_HOST port $REMOTE_PORT over ssh: check REMOTE_HOST and REMOTE_PORT in \
$ENV_FILE and that the server is up" 255 ;;
    esac
}

# The ssh command as one string for rsync -e, which splits on spaces and honours single quotes.
rsync_shell() {
    local word shell=''
    for word in "${SSH[@]}"; do
        [[ $word == *"'"* ]] && die "ssh argument $word contains a single quote, which rsync -e cannot carry"
        shell+="'$word' "
    done
    printf '%s' "${shell% }"
}

check_run_name() {
    [[ $1 =~ $RUN_NAME_PATTERN ]] ||
        usage_error "'$1' is not a run name (letters, digits, '.', '-' and '_'; see scripts/remote.sh status)"
}

check_session_name() {
    [[ $1 =~ $SESSION_NAME_PATTERN ]] ||
        usage_error "'$1' is not the name of a run started by remote.sh (letters, digits, '-' and '_')"
}

# ---------------------------------------------------------------------------------------------------------
# Local commands

cmd_sync() {
    (($# == 0)) || usage_error "sync takes no arguments"
    command -v rsync >/dev/null || die "rsync is not installed here (apt-get install rsync)"
    git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
        die "sync sends the files git knows: $ROOT is not a git checkout"
    on_server prepare-sync || exit
    # Code and configs: the files git tracks or would track. .gitignore keeps out .venv/, runs/, data/,
    # caches and .env; .env* is excluded here as well, so a secret never travels even if .gitignore
    # forgets it. Nothing is deleted on the server (no --delete): a wrong REMOTE_DIR must never cost data.
    git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
        rsync -az --human-readable --info=name1,stats1 -s -e "$(rsync_shell)" \
            --from0 --files-from=- --ignore-missing-args \
            --include=/.env.example --exclude='/.env*' --exclude=/.git/ \
            "$ROOT/" "$TARGET:$REMOTE_DIR/"
    local status=${PIPESTATUS[1]}
    ((status == 0)) || die "rsync to $TARGET:$REMOTE_DIR failed (status $status, rsync's message above)"
    echo "synced $ROOT -> $TARGET:$REMOTE_DIR"
}

cmd_run() {
    local resume=0 config='' overrides=() arg
    for arg in "$@"; do
        case $arg in
            --resume) resume=1 ;;
            -*) usage_error "run: unknown option $arg (the only option is --resume)" ;;
            *)
                if [[ -z $config ]]; then
                    config=$arg
                elif [[ $arg == *=* ]]; then
                    overrides+=("$arg")
                else
                    usage_error "run: override '$arg' is not of the form section.key=value"
                fi
                ;;
        esac
    done
    [[ -n $config ]] || usage_error "run: which CONFIG? (e.g. configs/smoke-2060.yaml)"
    on_server run "$resume" "$config" "${overrides[@]}"
}

cmd_chain() {
    local board='' args=() arg minutes=0
    for arg in "$@"; do
        if ((minutes)); then
            [[ $arg =~ ^[0-9]+([.][0-9]+)?$ ]] || usage_error "chain: --budget-min takes minutes, got '$arg'"
            args+=("$arg")
            minutes=0
            continue
        fi
        case $arg in
            --budget-min) args+=("$arg") minutes=1 ;;
            -*) usage_error "chain: unknown option $arg (the only option is --budget-min MINUTES)" ;;
            *)
                if [[ -z $board ]]; then
                    board=$arg
                elif [[ $arg == *=* ]]; then
                    args+=("$arg")
                else
                    usage_error "chain: override '$arg' is not of the form chain.key=value"
                fi
                ;;
        esac
    done
    ((minutes == 0)) || usage_error "chain: --budget-min needs MINUTES"
    [[ -n $board ]] || usage_error "chain: which BOARD? (a file of configs/chain/: 2060, 5090, h200, cpu)"
    [[ $board =~ $SESSION_NAME_PATTERN ]] || usage_error "chain: '$board' is not a board name (configs/chain/BOARD.yaml)"
    on_server chain "$board" "${args[@]}"
}

cmd_logs() {
    (($# <= 1)) || usage_error "logs takes at most one RUN"
    [[ -n ${1:-} ]] && check_run_name "$1"
    local tty=()
    [[ -t 0 && -t 1 ]] && tty=(-t)
    on_server "${tty[@]}" logs "${1:-}"
}

cmd_status() {
    (($# == 0)) || usage_error "status takes no arguments"
    on_server status
}

cmd_attach() {
    (($# == 1)) || usage_error "attach takes one RUN"
    check_session_name "$1"
    [[ -t 0 ]] || die "attach needs a terminal; use 'scripts/remote.sh logs $1' to read the log"
    on_server -t attach "$1"
}

cmd_stop() {
    (($# == 1)) || usage_error "stop takes one RUN"
    check_session_name "$1"
    on_server stop "$1" "$STOP_TIMEOUT_S"
}

cmd_fetch() {
    (($# == 1)) || usage_error "fetch takes one RUN"
    check_run_name "$1"
    command -v rsync >/dev/null || die "rsync is not installed here (apt-get install rsync)"
    local run=$1
    on_server check-run "$run" || exit
    mkdir -p "$ROOT/runs/$run" || die "cannot create $ROOT/runs/$run"
    # rsync writes each file under a temporary name and renames it: no half-copied checkpoint is left.
    rsync -a --human-readable --info=name1 -s -e "$(rsync_shell)" \
        --include=metrics.jsonl --include=config.yaml --include=train.log --include='ckpt_*.pt' \
        --exclude='*' \
        "$TARGET:$REMOTE_DIR/runs/$run/" "$ROOT/runs/$run/"
    local status=$?
    ((status == 0)) || die "rsync from $TARGET:$REMOTE_DIR/runs/$run failed (status $status)"
    echo "fetched run $run into $ROOT/runs/$run"
}

cmd_exec() {
    (($# >= 1)) || usage_error "exec needs a COMMAND"
    local tty=()
    [[ -t 0 && -t 1 ]] && tty=(-t)
    on_server "${tty[@]}" exec "$@"
}

# ---------------------------------------------------------------------------------------------------------
# Server side: these functions run on the server (see the header). They see only their arguments.

server_main() {
    SERVER_DIR=$1 SERVER_PYTHON=$2 SERVER_TMUX_SOCKET=$3
    local command=$4
    shift 4
    if [[ $command == prepare-sync ]]; then
        mkdir -p -- "$SERVER_DIR" || server_die "cannot create REMOTE_DIR $SERVER_DIR"
        command -v rsync >/dev/null || server_die "rsync is not installed (apt-get install rsync)"
        return 0
    fi
    cd -- "$SERVER_DIR" 2>/dev/null ||
        server_die "REMOTE_DIR $SERVER_DIR does not exist: run 'scripts/remote.sh sync' first"
    case $command in
        run) server_run "$@" ;;
        chain) server_chain "$@" ;;
        logs) server_logs "$@" ;;
        status) server_status ;;
        attach) server_attach "$@" ;;
        stop) server_stop "$@" ;;
        check-run) [[ -d runs/$1 ]] || server_die "no run $1 ($PWD/runs/$1 does not exist)" ;;
        exec)
            server_find_python optional
            exec "$@"
            ;;
        *) server_die "unknown command $command" ;;
    esac
}

server_die() {
    printf 'remote.sh: on %s: %s\n' "$(hostname)" "$1" >&2
    exit "${2:-1}"
}

server_tmux() { tmux -L "$SERVER_TMUX_SOCKET" "$@"; }

# Sets SERVER_PY to the absolute path of the server's Python and puts its directory first on PATH
# (as activating the venv would), so make and scripts started by exec find the same Python.
server_find_python() {
    local python=$SERVER_PYTHON
    if [[ $python == */* ]]; then
        [[ $python == /* ]] || python=$PWD/$python
        [[ -x $python ]] || python=''
    else
        python=$(command -v -- "$python") || python=''
    fi
    if [[ -z $python ]]; then
        [[ ${1:-} == optional ]] && return 0
        server_die "Python $SERVER_PYTHON not found in $PWD: set REMOTE_PYTHON in .env, or create the venv \
there (scripts/remote.sh exec make setup)"
    fi
    SERVER_PY=$python
    PATH=${python%/*}:$PATH
    export PATH
}

server_run() {
    local resume=$1 config=$2
    shift 2
    server_find_python
    command -v tmux >/dev/null || server_die "tmux is not installed (apt-get install tmux)"
    [[ -f config.py && -f train.py ]] || server_die "config.py or train.py missing in $PWD: run scripts/remote.sh sync"
    [[ -f $config ]] || server_die "config $config not found in $PWD (scripts/remote.sh sync copies configs/)"

    # The run name comes from the resolved config, exactly as train.py will see it on this machine.
    local resolved names run_name runs_dir
    resolved=$("$SERVER_PY" config.py "$config" "$@" --print) ||
        server_die "config $config with overrides [$*] is not valid (config.py says why, above)" 2
    names=$(printf '%s' "$resolved" | "$SERVER_PY" -c 'import sys, yaml
config = yaml.safe_load(sys.stdin)
print(config["run_name"], config["train"]["runs_dir"], sep="\n")') ||
        server_die "config.py --print gave no run_name or train.runs_dir for $config"
    run_name=${names%%$'\n'*}
    runs_dir=${names#*$'\n'}
    # logs, status, stop and fetch find a run under runs/ in REMOTE_DIR; another runs_dir would hide it.
    [[ $runs_dir == runs || $runs_dir == runs/ || $runs_dir == ./runs ]] || server_die "train.runs_dir is \
'$runs_dir'; runs started by remote.sh keep it at 'runs' (where logs, stop and fetch look)" 2
    [[ $run_name =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]] || server_die "run_name '$run_name' cannot name a tmux \
session: use letters, digits, '-' and '_' (override it with run_name=NAME)" 2
    if server_tmux has-session -t "=$run_name" 2>/dev/null; then
        server_die "run $run_name is already live: follow it with 'scripts/remote.sh logs $run_name', \
stop it with 'scripts/remote.sh stop $run_name'"
    fi

    local run_dir=$PWD/runs/$run_name train_args=("$config" "$@")
    ((resume)) && train_args+=(--resume)
    mkdir -p -- "$run_dir" || server_die "cannot create $run_dir"
    printf '[remote.sh] %s start: %s train.py%s\n' "$(date '+%F %T')" "$SERVER_PY" \
        "$(printf ' %q' "${train_args[@]}")" >>"$run_dir/train.log"
    # With more than one argument tmux executes the command directly (tmux >= 3.0): no shell reparses it.
    server_tmux new-session -d -s "$run_name" -c "$PWD" \
        bash -c "$(declare -f server_train); server_train \"\$@\"" server_train \
        "$run_dir" train.py "$SERVER_PY" train.py "${train_args[@]}" ||
        server_die "tmux could not start session $run_name"
    echo "started run $run_name on $(hostname) in tmux session $run_name (socket $SERVER_TMUX_SOCKET)"
    echo "log: $run_dir/train.log"
    echo "follow: scripts/remote.sh logs $run_name | stop: scripts/remote.sh stop $run_name"
}

# Runs inside the tmux session: the command (train.py, or the chain) with its output also appended to
# train.log, the run's log that logs, status and fetch read.
server_train() {
    local run_dir=$1 label=$2 status
    shift 2
    export PYTHONUNBUFFERED=1
    # The sh writes its own pid and then becomes train.py, so `stop` signals exactly the trainer.
    # tee -i ignores SIGINT: Ctrl-C in an attached session stops train.py, never the log writer.
    sh -c 'echo "$$" >"$0" && exec "$@"' "$run_dir/train.pid" "$@" 2>&1 | tee -i -a "$run_dir/train.log"
    status=${PIPESTATUS[0]}
    rm -f -- "$run_dir/train.pid"
    printf '[remote.sh] %s %s exited with status %s\n' "$(date '+%F %T')" "$label" "$status" |
        tee -a "$run_dir/train.log"
}

# The whole run: python -m chain run BOARD in a tmux session named after the chain's folder (runs/NAME),
# so logs, status, attach, stop and fetch treat it as they treat a training run.
server_chain() {
    local board=$1
    shift
    server_find_python
    command -v tmux >/dev/null || server_die "tmux is not installed (apt-get install tmux)"
    [[ -f configs/chain/$board.yaml ]] ||
        server_die "no chain file configs/chain/$board.yaml in $PWD (scripts/remote.sh sync copies configs/)"
    local overrides=() arg folder run_name
    for arg in "$@"; do [[ $arg == *=* ]] && overrides+=("$arg"); done
    folder=$("$SERVER_PY" -c 'import sys
from chain import runfile
print(runfile.load(sys.argv[1], sys.argv[2:])[0]["folder"])' "$board" "${overrides[@]}") ||
        server_die "chain $board with overrides [${overrides[*]}] is not valid (python says why, above)" 2
    folder=${folder#./}
    folder=${folder%/}
    run_name=${folder#runs/}
    [[ $folder == runs/* && $run_name =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]] || server_die "chain.folder is \
'$folder'; a chain started by remote.sh keeps it at runs/NAME (letters, digits, '-', '_'): where logs, stop \
and fetch look" 2
    if server_tmux has-session -t "=$run_name" 2>/dev/null; then
        server_die "run $run_name is already live: follow it with 'scripts/remote.sh logs $run_name', \
stop it with 'scripts/remote.sh stop $run_name'"
    fi
    local run_dir=$PWD/runs/$run_name
    mkdir -p -- "$run_dir" || server_die "cannot create $run_dir"
    printf '[remote.sh] %s start: %s -m chain run%s\n' "$(date '+%F %T')" "$SERVER_PY" \
        "$(printf ' %q' "$board" "$@")" >>"$run_dir/train.log"
    server_tmux new-session -d -s "$run_name" -c "$PWD" \
        bash -c "$(declare -f server_train); server_train \"\$@\"" server_train \
        "$run_dir" "the chain" "$SERVER_PY" -m chain run "$board" "$@" ||
        server_die "tmux could not start session $run_name"
    echo "started the chain of $board on $(hostname) in tmux session $run_name (socket $SERVER_TMUX_SOCKET)"
    echo "log: $run_dir/train.log"
    echo "follow: scripts/remote.sh logs $run_name | status: scripts/remote.sh status | attach: scripts/remote.sh attach $run_name"
}

server_last_line() {
    # Progress bars rewrite a line with '\r': keep what is on screen last.
    [[ -f $1 ]] && tail -c 4096 -- "$1" | tr '\r' '\n' | sed '/^[[:space:]]*$/d' | tail -n 1
}

server_logs() {
    local run=$1 log newest=''
    if [[ -z $run ]]; then
        for log in runs/*/train.log; do
            [[ -f $log && ( -z $newest || $log -nt $newest ) ]] && newest=$log
        done
        [[ -n $newest ]] || server_die "no runs/*/train.log in $PWD yet: start one with scripts/remote.sh run"
        run=${newest#runs/}
        run=${run%/train.log}
    fi
    log=runs/$run/train.log
    [[ -f $log ]] || server_die "no log for run $run ($PWD/$log does not exist)"
    local pane_pid=''
    # Only names without '.' can be sessions (in a tmux target, '.' separates window and pane).
    [[ $run == *.* ]] || pane_pid=$(server_tmux list-panes -t "=$run" -F '#{pane_pid}' 2>/dev/null | head -n 1)
    if [[ -n $pane_pid ]]; then
        echo "== $run: live; following $PWD/$log until the run ends (Ctrl-C stops watching, not the run) =="
        exec tail -n 50 -F --pid="$pane_pid" -- "$log"
    fi
    echo "== $run: not running; last lines of $PWD/$log =="
    exec tail -n 50 -- "$log"
}

server_status() {
    local sessions name pid
    sessions=$(server_tmux list-sessions -F '#{session_name}' 2>/dev/null)
    if [[ -z $sessions ]]; then
        echo "no live runs on $(hostname)"
    else
        echo "live runs on $(hostname):"
        while IFS= read -r name; do
            pid=$(cat "runs/$name/train.pid" 2>/dev/null)
            printf '  %s (pid %s): %s\n' "$name" "${pid:-?}" "$(server_last_line "runs/$name/train.log")"
        done <<<"$sessions"
    fi
    if command -v nvidia-smi >/dev/null; then
        echo "GPU memory (index, name, used, total, utilization):"
        nvidia-smi --query-gpu=index,name,memory.used,memory.total,utilization.gpu --format=csv,noheader |
            sed 's/^/  /'
    fi
}

server_attach() {
    server_tmux has-session -t "=$1" 2>/dev/null ||
        server_die "no live run $1 (scripts/remote.sh status lists them; logs $1 shows a finished one)"
    exec tmux -L "$SERVER_TMUX_SOCKET" attach-session -t "=$1"
}

server_stop() {
    local run=$1 timeout_s=$2 pid ticks=0
    server_tmux has-session -t "=$run" 2>/dev/null ||
        server_die "no live run $run (scripts/remote.sh status lists the live runs)"
    pid=$(cat "runs/$run/train.pid" 2>/dev/null)
    if [[ -n $pid ]] && kill -INT "$pid" 2>/dev/null; then
        echo "sent SIGINT to train.py of run $run (pid $pid); waiting for it to checkpoint and exit"
    else
        echo "train.py of run $run has already exited; waiting for its session to close"
    fi
    while server_tmux has-session -t "=$run" 2>/dev/null; do
        ((ticks >= timeout_s * 5)) && server_die "run $run is still running after ${timeout_s}s: \
scripts/remote.sh logs $run shows what it is doing"
        sleep 0.2
        ticks=$((ticks + 1))
    done
    echo "run $run stopped: $(server_last_line "runs/$run/train.log")"
}

# ---------------------------------------------------------------------------------------------------------

main() {
    local command=${1:-}
    case $command in
        -h | --help | help)
            usage
            exit 0
            ;;
        '') usage_error "which command?" ;;
        sync | run | chain | logs | status | attach | stop | fetch | exec) ;;
        *) usage_error "unknown command '$command'" ;;
    esac
    shift
    command -v ssh >/dev/null || die "ssh is not installed here (apt-get install openssh-client)"
    load_settings
    "cmd_$command" "$@"
}

main "$@"
