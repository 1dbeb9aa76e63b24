#!/usr/bin/env bash
# A multi-node lrl run without a scheduler: start this script once on every node.
#
#   # node 0 (its address is the coordinator's):
#   NUM_NODES=2 NODE_RANK=0 COORDINATOR=10.0.0.1:12355 \
#     experiments/launch/multinode.sh configs/default.py /shared/runs/exp1 --config.rl.steps=200
#   # node 1:
#   NUM_NODES=2 NODE_RANK=1 COORDINATOR=10.0.0.1:12355 \
#     experiments/launch/multinode.sh configs/default.py /shared/runs/exp1 --config.rl.steps=200
#
# Every process runs the same command; they differ only in the `--config.distributed.*`
# overrides, which this script computes:
#   --config.distributed.enabled=True
#   --config.distributed.coordinator_address=$COORDINATOR   (host:port of process 0)
#   --config.distributed.num_processes=$((NUM_NODES * PROCS_PER_NODE))
#   --config.distributed.process_id=$((NODE_RANK * PROCS_PER_NODE + local_rank))
#
# Environment:
#   NUM_NODES       nodes in the run (required)
#   NODE_RANK       this node's index, 0..NUM_NODES-1 (required; node 0 hosts the coordinator)
#   COORDINATOR     host:port of node 0, reachable from every node (required)
#   PROCS_PER_NODE  1 (default): one process drives all of the node's GPUs;
#                   N: one process per GPU, process k of the node drives GPU k
#   GPUS_PER_NODE   GPUs on a node (default: counted with nvidia-smi, else 1)
#   PYTHON          interpreter (default: python)
#   LOG_DIR         per-process logs (default: $WORKDIR/logs); process 0 also prints here
#   DRY_RUN=1       print the commands instead of running them
#
# The workdir must be on a file system every node sees (checkpoints are written collectively;
# only process 0 writes metrics, plots and the tokenizer). Extra arguments are passed to
# `python -m lrl.main` unchanged. If one process fails, the others on this node are stopped and
# the script exits with its code; processes on other nodes stop on their own (JAX's heartbeat
# timeout, or `--config.distributed.watchdog_s`).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,33p' "$0" >&2
  exit 2
fi
CONFIG=$1
WORKDIR=$2
shift 2

: "${NUM_NODES:?set NUM_NODES (nodes in the run)}"
: "${NODE_RANK:?set NODE_RANK (this node, 0..NUM_NODES-1)}"
: "${COORDINATOR:?set COORDINATOR=host:port of node 0}"
PROCS_PER_NODE=${PROCS_PER_NODE:-1}
PYTHON=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-$WORKDIR/logs}
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$GPUS_PER_NODE" -ge 1 ]] || GPUS_PER_NODE=1
fi
if (( NODE_RANK < 0 || NODE_RANK >= NUM_NODES )); then
  echo "multinode.sh: NODE_RANK=$NODE_RANK is not in [0, $NUM_NODES)" >&2; exit 2
fi
if [[ "$COORDINATOR" != *:* ]]; then
  echo "multinode.sh: COORDINATOR=$COORDINATOR must be host:port" >&2; exit 2
fi
if (( PROCS_PER_NODE > 1 && PROCS_PER_NODE != GPUS_PER_NODE )); then
  echo "multinode.sh: PROCS_PER_NODE=$PROCS_PER_NODE must be 1 or GPUS_PER_NODE=$GPUS_PER_NODE" >&2
  exit 2
fi

# NVLink SHARP (multicast) stays off: it needs fabric-manager support many hosts lack, and
# NCCL then fails at the first collective instead of falling back.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
# The address JAX would read if the flag were missing, and a guard against proxies that
# intercept the coordinator's gRPC traffic.
export JAX_COORDINATOR_ADDRESS=$COORDINATOR
export no_proxy="${no_proxy:+$no_proxy,}${COORDINATOR%:*}"

NUM_PROCESSES=$(( NUM_NODES * PROCS_PER_NODE ))
mkdir -p "$LOG_DIR" 2>/dev/null || [[ -n "${DRY_RUN:-}" ]]
pids=()
for (( local_rank = 0; local_rank < PROCS_PER_NODE; local_rank++ )); do
  process_id=$(( NODE_RANK * PROCS_PER_NODE + local_rank ))
  if (( PROCS_PER_NODE > 1 )); then
    devices=$local_rank                               # one GPU per process
  else
    devices=$(seq -s, 0 $(( GPUS_PER_NODE - 1 )))     # every GPU of the node
  fi
  cmd=("$PYTHON" -m lrl.main "--config=$CONFIG" "--workdir=$WORKDIR"
       --config.distributed.enabled=True
       "--config.distributed.coordinator_address=$COORDINATOR"
       "--config.distributed.num_processes=$NUM_PROCESSES"
       "--config.distributed.process_id=$process_id"
       "$@")
  if [[ -n "${DRY_RUN:-}" ]]; then
    echo "JAX_LOCAL_DEVICE_IDS=$devices ${cmd[*]}"
    continue
  fi
  log="$LOG_DIR/process_$process_id.log"
  JAX_LOCAL_DEVICE_IDS=$devices "${cmd[@]}" > "$log" 2>&1 &
  pids+=($!)
  echo "multinode.sh: started process $process_id of $NUM_PROCESSES (GPUs $devices), log $log" >&2
  if (( process_id == 0 )); then  # the console follows process 0 until it exits
    tail -n +1 -f --pid="$!" "$log" &
  fi
done
[[ -n "${DRY_RUN:-}" ]] && exit 0

# The first process to fail decides: this node's others get SIGTERM (they save a checkpoint
# if they still can), then SIGKILL after a grace period; the script exits with that code.
status=0
running=("${pids[@]}")
while (( ${#running[@]} )); do   # polling, not `wait -n PID...`: that needs bash >= 5.1
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then still+=("$pid"); continue; fi
    wait "$pid" || { status=$?; break 2; }
  done
  running=(${still[@]+"${still[@]}"})
  sleep 1
done
if (( status )); then
  echo "multinode.sh: a process exited with code $status; stopping the others on this node" >&2
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 30); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
fi
wait || true  # the stopped processes and the console follower
exit "$status"
