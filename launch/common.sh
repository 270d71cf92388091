# shellcheck shell=bash
# Helpers shared by the launch scripts, which source this file after setting NAME (the
# script's name in error messages). The sbatch scripts find the checkout first (Slurm runs
# a copy of them from its spool directory) and source "$REPO/launch/common.sh".

# Stop with "<script>: error: ..." and exit status 2.
die() {
    # shellcheck disable=SC2154  # NAME is set by the sourcing script
    echo "$NAME: error: $*" >&2
    exit 2
}
is_posint() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
# Whether an override of `key` (key=, +key=, ++key=) is among the remaining arguments.
has_override() {
    local key=$1 a
    shift
    for a in "$@"; do
        if [[ $a == "$key="* || $a == "+$key="* || $a == "++$key="* ]]; then return 0; fi
    done
    return 1
}
# Append key=value to the array `overrides`, unless value is empty or the trainer's
# arguments (the rest) set key themselves.
add_override() {
    local key=$1 value=$2
    shift 2
    if [[ -n $value ]] && ! has_override "$key" "$@"; then overrides+=("$key=$value"); fi
}
# Set the array `overrides` to the trainer settings every launch script passes: ranks per
# node ($1), device ($2), MODEL, STRATEGY and COMM; each unless empty or set by the
# trainer's arguments (the rest).
trainer_overrides() {
    local per_node=$1 device=$2
    shift 2
    overrides=()
    add_override comm.ranks_per_node "$per_node" "$@"
    add_override train.device "$device" "$@"
    add_override model "$MODEL" "$@"
    add_override strategy "$STRATEGY" "$@"
    add_override comm "$COMM" "$@"
}
# With RESTARTS > 0, every attempt must find the same checkpoints: train.out_dir fixed to
# $1 (unless the trainer's arguments, the rest, set it) and train.resume=auto (which they
# must leave out), appended to `overrides`.
restart_overrides() {
    local out_dir=$1
    shift
    (( RESTARTS > 0 )) || return 0
    [[ -n $out_dir ]] || has_override train.out_dir "$@" ||
        die "RESTARTS needs one output directory for every attempt: give train.out_dir"
    add_override train.out_dir "$out_dir" "$@"
    has_override train.resume "$@" && die "RESTARTS sets train.resume=auto itself; leave train.resume out"
    overrides+=(train.resume=auto)
}
# A Slurm job's overrides: train.out_dir fixed per job (runs/slurm-<job id>: the same when
# Slurm requeues the job, as `sbatch --requeue` lets it after a node failure) and
# train.resume=auto, so a requeued job continues from its newest intact checkpoint and a
# new job starts fresh; each unless the trainer's arguments (the rest) set it. With RESTARTS
# > 0 as restart_overrides.
slurm_overrides() {
    local out_dir="runs/slurm-${SLURM_JOB_ID:-$(date -u +%Y-%m-%d_%H-%M-%S)}"
    restart_overrides "$out_dir" "$@"
    (( RESTARTS > 0 )) && return 0
    add_override train.out_dir "$out_dir" "$@"
    has_override train.resume "$@" || overrides+=(train.resume=auto)
}
# Run the array `cmd`, relaunching it after a failure up to RESTARTS times (restart_overrides
# made every attempt resume); exits with the last attempt's status. Not relaunched: a run
# stopped by Ctrl-C or a TERM (the user's, or the scheduler's at the time limit), and exit
# status 2, shard-train's for a setting it refuses, which would fail the same way again.
run_restarting() {
    local attempt status again stopped=0 child=
    (( RESTARTS > 0 )) || exec "${cmd[@]}"
    # the run in the background, waited for: a trap runs only once the foreground command
    # ends, so a TERM to this script waited for the whole run; now it is passed on at once
    # (|| true: the run may be gone already, and errexit would end this script on kill's status)
    trap 'stopped=1; [[ -z $child ]] || kill -TERM "$child" 2>/dev/null || true' INT TERM
    for (( attempt = 0; ; attempt++ )); do
        status=0
        "${cmd[@]}" &
        child=$!
        wait "$child" || status=$?
        if (( stopped )); then   # the signal may have ended the wait first: the run's own status, where
            again=0               # bash still has it (not for a run it reaped already: 127, or -1)
            wait "$child" 2> /dev/null || again=$?
            (( again == 127 || again < 0 || again > 255 )) || status=$again
        fi
        child=
        (( status == 0 )) && exit 0
        if (( stopped )); then
            echo "$NAME: stopped by a signal (exit $status); not restarting" >&2
            exit "$status"
        fi
        if (( status == 2 )); then
            echo "$NAME: the run refused its settings (exit 2); not restarting" >&2
            exit 2
        fi
        if (( attempt >= RESTARTS )); then
            echo "$NAME: the run failed (exit $status) after $RESTARTS restart(s); giving up" >&2
            exit "$status"
        fi
        echo "$NAME: the run failed (exit $status); restart $((attempt + 1)) of $RESTARTS with train.resume=auto" >&2
    done
}
# A command line that a shell (or Python's shlex.split) reads back as the same words.
quote_words() {
    local re='^[A-Za-z0-9_./:=,+@%-]+$' out=() a
    for a in "$@"; do
        if [[ $a =~ $re ]]; then out+=("$a"); else out+=("${a@Q}"); fi
    done
    printf '%s\n' "${out[*]}"
}
# PYTHON, unless already set: the checkout's .venv/bin/python (checkout: $1, may be
# empty), else python3.
default_python() {
    if [[ -z ${PYTHON:-} ]]; then
        if [[ -n $1 && -x $1/.venv/bin/python ]]; then PYTHON=$1/.venv/bin/python; else PYTHON=python3; fi
    fi
}
# Load MODULES (sbatch scripts): shown, not loaded, when DRY_RUN=1; skipped with a note
# when there is no `module` command.
load_modules() {
    [[ -n $MODULES ]] || return 0
    if [[ $DRY_RUN == 1 ]]; then echo "# module load $MODULES"; return 0; fi
    if ! type module >/dev/null 2>&1; then
        echo "$NAME: no 'module' command, not loading: $MODULES" >&2
        return 0
    fi
    set +u  # module scripts read unset variables
    # shellcheck disable=SC2086
    module load $MODULES || die "module load $MODULES failed"
    set -u
}

# bash 4.4 expands an empty array under `set -u` and has ${a@Q}; 4.3 (RHEL 7) would stop
# with "unbound variable" at a launch with no extra arguments
(( BASH_VERSINFO[0] > 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] >= 4) )) ||
    die "needs bash 4.4 or newer, this is $BASH_VERSION"
DRY_RUN=${DRY_RUN:-0}
[[ $DRY_RUN == 0 || $DRY_RUN == 1 ]] || die "DRY_RUN must be 0 or 1, got '$DRY_RUN'"
RESTARTS=${RESTARTS:-0}
# no leading zero: bash reads 010 as octal 8, and 08 not at all
[[ $RESTARTS =~ ^(0|[1-9][0-9]*)$ ]] || die "RESTARTS must be an integer >= 0, got '$RESTARTS'"
