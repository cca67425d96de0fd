#!/bin/sh
# aps-entrypoint: what a cluster engine says of a process, said the way aps reads it, then
# the command (default: `aps serve`). Only variables left unset are filled in:
#   APS_SHARD  from a StatefulSet pod's ordinal (the number ending its host name: aps-1 -> 1)
#              when the pod-index label was not passed down;
#   RANK       from an indexed Job's JOB_COMPLETION_INDEX, or from Slurm's SLURM_PROCID;
#   WORLD_SIZE from Slurm's SLURM_NTASKS.
# A command that starts with a dash is taken as flags of `aps serve`.
set -eu

if [ -z "${APS_SHARD:-}" ] && [ -n "${APS_SHARDS:-}" ]; then
    host="${HOSTNAME:-$(hostname)}"
    ordinal="${host##*-}"
    case "$ordinal" in
        ''|*[!0-9]*) echo "aps-entrypoint: APS_SHARDS is set but APS_SHARD is not, and host name $host ends in no ordinal" >&2; exit 2 ;;
    esac
    APS_SHARD="$ordinal"
    export APS_SHARD
fi
if [ -z "${RANK:-}" ]; then
    if [ -n "${JOB_COMPLETION_INDEX:-}" ]; then
        RANK="$JOB_COMPLETION_INDEX"; export RANK
    elif [ -n "${SLURM_PROCID:-}" ]; then
        RANK="$SLURM_PROCID"; export RANK
    fi
fi
if [ -z "${WORLD_SIZE:-}" ] && [ -n "${SLURM_NTASKS:-}" ]; then
    WORLD_SIZE="$SLURM_NTASKS"; export WORLD_SIZE
fi

if [ "$#" -eq 0 ]; then
    set -- aps serve
elif [ "${1#-}" != "$1" ]; then
    set -- aps serve "$@"
fi
exec "$@"
