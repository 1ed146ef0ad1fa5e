#!/bin/sh
# Slurm TaskProlog for cudabudget: gives each task the device-memory budget its job asked
# for. In slurm.conf:
#
#   TaskProlog=/etc/slurm/cudabudget-taskprolog.sh
#
# slurmstepd runs it as the job's user, with the task's environment, before every task;
# the lines it prints change that environment ("export NAME=value", "unset NAME").
# A non-zero exit stops the task before it starts.
#
# Where the budget comes from (the first that applies):
#   1. --gres=gpumem:N (a count GRES, GPUMEM_GRES below, in GiB; slurm.conf: GresTypes=...,gpumem
#      and Gres=...,gpumem:<card GiB minus a reserve>; gres.conf: Name=gpumem Count=<same>):
#      N GiB, exported as CUDABUDGET_LIMIT with CUDABUDGET_SCOPE=job:slurm-<job>.<step>, so
#      the step's tasks on this node share the N GiB Slurm counted for it there. Slurm sets
#      no variable for a count GRES, so the prolog asks slurmctld (scontrol show step, or
#      show job for the batch script) what the step has per node (TresPerNode).
#   2. --gres=shard:N (GPU sharding, Slurm >= 22.05): N x GIB_PER_SHARD GiB, exported as
#      CUDABUDGET_LIMIT.
#      In both, the allocation is the budget: the job's own CUDABUDGET_LIMIT,
#      CUDABUDGET_LIMIT_<N> (and for gpumem CUDABUDGET_SCOPE) are replaced.
#   3. The job's own budget variables (CUDABUDGET_LIMIT, CUDABUDGET_LIMIT_<N>, or HAMi's
#      CUDA_DEVICE_MEMORY_LIMIT[_<N>]), e.g. `export CUDABUDGET_LIMIT=20Gi` before srun,
#      or `sbatch --export=ALL,CUDABUDGET_LIMIT=20Gi`: kept as they are.
#   4. DEFAULT_LIMIT below, for tasks that were given GPUs (CUDA_VISIBLE_DEVICES is set)
#      and asked for nothing.
# When one applies, the library is put in front of LD_PRELOAD. When none does, the task
# is left alone (a job with whole GPUs needs no budget).
#
# It never lets a task that asked for a budget run without one: when the library is
# missing or cannot be loaded here, or a budget value is invalid, it says why (a "print"
# line, which Slurm writes to the task's output, and stderr) and exits 1, so the task
# does not start.

# --- site settings (here, not in the job's environment, which the user controls) ---
# Where cudabudget is installed on the compute nodes.
INSTALL_DIR=/opt/cudabudget
# GPU memory one gres/shard stands for, in GiB: the GPU's memory divided by the shards
# per GPU in gres.conf (e.g. 140 GiB H200 / 16 shards -> 8).
GIB_PER_SHARD=8
# The count GRES whose units are GiB of GPU memory (gres.conf: Name=gpumem Count=<GiB>);
# empty: not used. Leave it empty where no node has it: it spares slurmctld one
# `scontrol show step` per task.
GPUMEM_GRES=gpumem
# Slurm's scontrol on the compute nodes.
SCONTROL=/usr/bin/scontrol
# Budget for GPU tasks that ask for none (a quantity such as 20Gi or 50%); empty: none.
DEFAULT_LIMIT=
# ------------------------------------------------------------------------------------

set -euf
PATH=/usr/bin:/bin
export PATH
# The task's preloads are the task's: keep them for its LD_PRELOAD, out of the tools here.
task_preload=${LD_PRELOAD:-}
unset LD_PRELOAD

lib=$INSTALL_DIR/libcudabudget.so
cli=$INSTALL_DIR/cudabudget

fail() {
    # slurmstepd does not show a TaskProlog's stderr to the user; "print" lines go to the
    # task's output, which is where the user looks.
    message=$(printf 'cudabudget TaskProlog: %s; the task was not started' "$*" | tr '\n' ' ')
    printf '%s\n' "$message" >&2
    printf 'print %s\n' "$message"
    exit 1
}

budget_names() {
    env | sed -n 's/^\(CUDABUDGET_LIMIT\(_[0-9][0-9]*\)\{0,1\}\)=.*/\1/p'
}

# The count of GPUMEM_GRES that Slurm gave this task's step on each node (the batch
# script: its job), as slurmctld tells it: TresPerNode=gres:gpumem:20 (or with a type,
# gres:gpumem:TYPE:20). Prints nothing when the step has none.
gpumem_count() {
    case ${SLURM_STEP_ID:-} in
        # The batch script (or salloc's shell): no step id, or a word, or one of Slurm's
        # reserved numbers for them (4294967290 and up).
        '' | *[!0-9]* | 429496729[0-9]) what=job; id=$SLURM_JOB_ID ;;
        *) what=step; id=$SLURM_JOB_ID.$SLURM_STEP_ID ;;
    esac
    if ! shown=$("$SCONTROL" -o show "$what" "$id" 2>&1); then
        fail "cannot ask slurmctld for the $GPUMEM_GRES of $what $id: $shown"
    fi
    words=$(printf '%s\n' "$shown" | tr ' ' '\n' | grep '^Tres' || true)
    counts=$(printf '%s\n' "$words" | sed -n 's/^TresPerNode=//p' | tr ',' '\n' |
        sed -n "s/^gres[:\/]$GPUMEM_GRES\(:[^:]*\)\{0,1\}:\([0-9][0-9]*\)\$/\2/p")
    if [ -z "$counts" ] && printf '%s\n' "$words" | grep -q "[:/]${GPUMEM_GRES}[:=]"; then
        fail "$what $id has $GPUMEM_GRES other than per node ($(printf '%s' "$words" | tr '\n' ' ')); ask for it with --gres=$GPUMEM_GRES:N"
    fi
    printf '%s' "$counts" | head -n 1
}

limit=
scope=
replace=
gpumem=
# (Its failure's "print" line comes out of the subshell in its output.)
if [ -n "$GPUMEM_GRES" ] && [ -n "${SLURM_JOB_ID:-}" ] && ! gpumem=$(gpumem_count); then
    printf '%s\n' "$gpumem"
    exit 1
fi
shards=${SLURM_SHARDS_ON_NODE:-}
if [ -n "$gpumem" ] && [ "$gpumem" != 0 ]; then
    limit="${gpumem}Gi"
    scope="job:slurm-$SLURM_JOB_ID.${SLURM_STEP_ID:-batch}"
    replace=$(budget_names)
elif [ -n "$shards" ] && [ "$shards" != 0 ]; then
    case $shards in
        *[!0-9]*) fail "SLURM_SHARDS_ON_NODE=$shards is not a number of shards" ;;
    esac
    limit="$((shards * GIB_PER_SHARD))Gi"
    replace=$(budget_names)
elif env | grep -Eq '^(CUDABUDGET_LIMIT|CUDA_DEVICE_MEMORY_LIMIT)(_[0-9]+)?='; then
    : # the job's own budget
elif [ -n "$DEFAULT_LIMIT" ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    limit=$DEFAULT_LIMIT
else
    exit 0
fi

if [ ! -f "$lib" ] || [ ! -x "$cli" ]; then
    fail "$lib or $cli is missing on $(uname -n), so the task's budget cannot be enforced"
fi

# LD_PRELOAD for the task: the library first, then whatever the task preloads already.
preload=$lib
for entry in $(printf '%s' "$task_preload" | tr ':' ' '); do
    [ "$entry" = "$lib" ] || preload="$preload:$entry"
done

# Ask the CLI with exactly the task's future environment: it validates every budget
# variable with the library's own code and refuses without a budget; then the loader
# preloads the library into `true`, which must start silently.
set --
for name in $replace; do
    set -- "$@" -u "$name"
done
if [ -n "$limit" ]; then
    set -- "$@" "CUDABUDGET_LIMIT=$limit"
fi
if [ -n "$scope" ]; then
    set -- "$@" "CUDABUDGET_SCOPE=$scope"
fi
if ! answer=$(env "$@" "$cli" run -- /usr/bin/env true 2>&1) || [ -n "$answer" ]; then
    fail "${answer:-the budget check failed}"
fi

for name in $replace; do
    echo "unset $name"
done
if [ -n "$limit" ]; then
    echo "export CUDABUDGET_LIMIT=$limit"
fi
if [ -n "$scope" ]; then
    echo "export CUDABUDGET_SCOPE=$scope"
fi
echo "export LD_PRELOAD=$preload"
