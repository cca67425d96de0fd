#!/bin/sh
# aps-entrypoint: what a cluster engine says of a process, said the way aps reads it, then
# the command (default: `aps serve`). Only variables left unset are filled in:
#   APS_SHARD  from a StatefulSet pod's ordinal (the number ending its host name: aps-1 -> 1)
#              when the pod-index label was not passed down;
#   with APS_REPLICA_COUNT=R (> 1: every shard a replica set of R pods, docs/guide/replicas.md)
#   and APS_REPLICA_DOMAIN (the StatefulSet's service): pod ORDINAL serves shard ORDINAL / R,
#   and APS_SHARD, APS_REPLICAS (its set's pods), APS_ADVERTISE (this pod, as the others reach
#   it) and APS_REPLICA_SET (one name a shard) are said from its ordinal;
#   RANK       from an indexed Job's JOB_COMPLETION_INDEX, or from Slurm's SLURM_PROCID;
#   WORLD_SIZE from Slurm's SLURM_NTASKS.
# A command that starts with a dash is taken as flags of `aps serve`.
set -eu

if [ "${APS_REPLICA_COUNT:-1}" != 1 ] && [ -z "${APS_REPLICAS:-}" ]; then
    host="${HOSTNAME:-$(hostname)}"
    ordinal="${host##*-}"
    count="$APS_REPLICA_COUNT"
    case "$ordinal$count" in
        *[!0-9]*|"$count") echo "aps-entrypoint: APS_REPLICA_COUNT=$count needs a pod whose host name ($host) ends in its ordinal" >&2; exit 2 ;;
    esac
    if [ -z "${APS_REPLICA_DOMAIN:-}" ]; then
        echo "aps-entrypoint: APS_REPLICA_COUNT needs APS_REPLICA_DOMAIN (the StatefulSet's service: pods are POD.DOMAIN)" >&2
        exit 2
    fi
    base="${host%-*}"
    port="${APS_PORT:-7450}"
    shard=$((ordinal / count))
    replicas=""
    j=0
    while [ "$j" -lt "$count" ]; do
        replicas="${replicas:+$replicas,}$base-$((shard * count + j)).$APS_REPLICA_DOMAIN:$port"
        j=$((j + 1))
    done
    APS_SHARD="$shard"
    APS_REPLICAS="$replicas"
    APS_ADVERTISE="${APS_ADVERTISE:-$host.$APS_REPLICA_DOMAIN:$port}"
    APS_REPLICA_SET="${APS_REPLICA_SET:-$base-shard-$shard}"
    export APS_SHARD APS_REPLICAS APS_ADVERTISE APS_REPLICA_SET
fi
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
