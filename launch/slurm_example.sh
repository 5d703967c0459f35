#!/usr/bin/env bash
# EXAMPLE ONLY (not used by the tests): a two-node SLURM job, targets on one node, trainer on the other.
# Adapt the #SBATCH lines, CONFIG, the GPU count and the port range to your cluster.
#
#   node 0: one producer per GPU (srun), each serving tcp://0.0.0.0:PORT with the run's CURVE keys
#   node 1: the trainer, one rank per GPU (torchrun), connecting to them as launch.remote_producers
#
# RUN_DIR must be on a file system both nodes see (the producers read config.toml and
# secrets/curve.json from it). Without one, copy those two files to the same path on node 0 first,
# keeping the key file's mode 0600 (see docs/operations.md "Multi-host").
#
#SBATCH --job-name=dflash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${DFLASH_PYTHON:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CONFIG="${CONFIG:?set CONFIG to the TOML of the run: target.path, data, training.max_steps above 0 ...}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/slurm-$SLURM_JOB_ID}"
GPUS=8
BASE_PORT=29600

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
PRODUCER_NODE="${NODES[0]}"
TRAINER_NODE="${NODES[1]}"

# The producers' endpoints, as the trainer reaches them: ids 0..GPUS-1 (no local producers).
ENDPOINTS=""
for ((i = 0; i < GPUS; i++)); do ENDPOINTS+="${ENDPOINTS:+, }\"tcp://$PRODUCER_NODE:$((BASE_PORT + i))\""; done

# 1. The run directory: resolved config.toml, secrets/curve.json (0600) and the folders.
"$PY" - "$CONFIG" "$RUN_DIR" "launch.num_producers=0" "launch.remote_producers=[$ENDPOINTS]" <<'EOF'
import sys
from common.config import load_config, save_config
from launch.rundir import RunDir

config, run_dir, *overrides = sys.argv[1:]
run = RunDir(run_dir)
run.create()
if not run.config.is_file():  # a resubmitted job resumes the run as it was configured
    save_config(load_config(config, overrides), run.config)
EOF

# 2. One producer per GPU of node 0; each loads its target once and serves its ring over tcp.
srun --nodes=1 --ntasks="$GPUS" --gpus-per-task=1 --nodelist="$PRODUCER_NODE" --kill-on-bad-exit=0 \
  --output="$RUN_DIR/logs/producer-%t.log" \
  bash -c "exec '$PY' -m producer.server --run-dir '$RUN_DIR' --producer-id \$SLURM_LOCALID --device cuda:0 \
           --listen tcp://0.0.0.0:\$(($BASE_PORT + SLURM_LOCALID))" &
PRODUCERS=$!

# 3. The trainer on node 1, one rank per GPU. It waits for the producers (HELLO until WELCOME)
#    and trains on those that are up; kill it and run this step again to resume from its checkpoint.
srun --nodes=1 --ntasks=1 --gpus-per-task="$GPUS" --nodelist="$TRAINER_NODE" \
  --output="$RUN_DIR/logs/trainer.log" \
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m trainer.train --run-dir "$RUN_DIR"

# 4. Training finished: stop the producers (SIGTERM: they release their rings and exit).
kill -TERM "$PRODUCERS"
wait "$PRODUCERS" || true
