#!/usr/bin/env bash
# The project's GPU suite: the tests marked gpu and the benchmarks that only mean something on a GPU, one named
# step each, run in order on one machine; each step's log goes to $OUT (default ./gpu-out) and a summary of the
# steps' exit codes is printed last. Each step has its own time limit so that one slow step cannot eat the others.
#   bash launch/tools/gpu_suite.sh [STEP ...]      (default: tests ring producer step restart)
# Steps: tests (CUDA ring, target capture, pipeline, tensor parallel, FSDP), gpu_tests_all (every test marked gpu),
# ring, producer, step (the draft step, eager and compiled), restart, evals, pauses, hybrid (Qwen3.6-27B shapes),
# scaling (DDP / FSDP over 2 GPUs), pipeline, mps, mps_share, shared_fsdp, stalls, checkpoint, checkpoint_fsdp,
# generate, data, masks, dflash2 (the DFlash 2 step against the eager one, and both kinds' step cost), quality,
# collect_quality, recipes, collect_recipes, kinds, collect_kinds (DFlash against DFlash 2 at equal GPU time), busy
# (the trainer's busy share by producers), small_shapes (every kind's step at the SmolLM2 preset's and the Qwen3-8B
# shapes, compiled layers against their replay as CUDA graphs), optimizer (the optimizer step alone, and the step with
# Muon), real_step (the trainer's step in a real run of the SmolLM2 preset, profiled), peers, collect_peers (ours
# beside SpecForge and speculators).
# The full pipeline benchmark runs for up to 50 minutes: where commands are cut off sooner, start it in
# the background with setsid (it writes its JSON after every run) and collect the results later.
# The machine may start bare and keep nothing between runs: install what the image lacks from wheels carried in
# .whl first, e.g.
#   python3 -m pip install -q --no-index --find-links .whl pyzmq wandb accelerate transformers==5.24.0
# (accelerate: transformers needs it for device_map and tensor-parallel loading).
set -u
cd "$(dirname "$0")/../.."  # the repository root (this file is launch/tools/)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DFLASH_PYTHON=${DFLASH_PYTHON:-python3} WANDB_MODE=offline PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=$DFLASH_PYTHON
PEERS_OUT=${PEERS_OUT:-/tmp/peers}
steps=${*:-tests ring producer step restart}
summary=()
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 8 "$OUT/$name.log" | cut -c1-300
  summary+=("$name rc=$rc")
}
wait_while_running() {  # module, seconds: wait (up to the seconds) for a background benchmark's process to end
  local waited=0
  while pgrep -f "$1" > /dev/null && [ $waited -lt "$2" ]; do sleep 10; waited=$((waited + 10)); done
}
keep_run_logs() {  # name: the pipeline runs' logs, metrics and evaluation records, in one file under $OUT (small
                  # enough to copy off the machine), without their exported weights; their checkpoints are gone already
  tar czf "$OUT/$1-runs.tgz" --exclude="*.safetensors" /tmp/df-*-*/run/logs /tmp/df-*-*/run/metrics.jsonl /tmp/df-*-*/run/evals 2>/dev/null
  rm -rf /tmp/df-*-*/
}
for step in $steps; do
  case $step in
    tests)  # pytest-timeout (where installed) stops a hung test with its stack, and the others still run
          per_test=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 330")
          run gpu_tests 600 $PY -m pytest -q -rfEs -p no:cacheprovider $per_test --durations=8 -m "gpu or multigpu" tests/test_ring_cuda.py tests/test_target.py tests/test_pipeline_gpu.py tests/test_tensor_parallel.py tests/test_fsdp.py ;;
    gpu_tests_all)  # every test marked gpu, named as it starts (-v), each stopped after GPU_TEST_TIMEOUT_S (default
                    # 150) where pytest-timeout is installed: the log says which test a cut-off call was running
          per_test=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${GPU_TEST_TIMEOUT_S:-150}")
          run gpu_tests_all 590 $PY -m pytest -v -rfEs -p no:cacheprovider $per_test --durations=15 -m gpu tests/ ;;
    hybrid)  # issue 17: Qwen3.6-27B shapes (Gated-DeltaNet hybrid): fla GPU test, producer capture, the 27B draft's step
          run hybrid_tests 300 $PY -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_hybrid_target.py tests/test_drafter_masks.py tests/test_serving_fidelity.py
          run target_27b 420 $PY -m launch.bench.target --shape qwen3.6-27b --attn varlen --batches 8 --warmup 2 --json-out "$OUT/target_27b.json"
          run target_27b_3072 240 $PY -m launch.bench.target --shape qwen3.6-27b --attn varlen --rows 4 --length 3072 --batches 8 --warmup 2 --json-out "$OUT/target_27b_3072.json"
          run step_27b 300 $PY -m launch.bench.step --draft qwen3.6-27b --variants compile-layers --warmup 3 --steps 8 ;;
    ring) run ring 110 $PY -m launch.bench.ring --count 100 --json "$OUT/ring.json" ;;
    producer) run producer 180 $PY -m launch.bench.producer --warmup 20 --seconds 30 ;;
    step) run step 300 $PY -m launch.bench.step --variants eager,compile-layers --warmup 3 --steps 10
          run step_fp32 200 $PY -m launch.bench.step --variants compile-layers --master-fp32 --warmup 3 --steps 10 ;;
    restart) run restart 560 $PY -m launch.bench.restart --timeout 240 ;;
    scaling)  # issue 8: trainer samples/s on 1 GPU, then DDP and FSDP over 2 (data already on the GPUs)
          run scale_1gpu 200 $PY -m launch.bench.step --variants compile-layers --master-fp32 --warmup 3 --steps 10
          run scale_ddp2 250 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m launch.bench.step --variants compile-layers --master-fp32 --warmup 3 --steps 10 --parallelism ddp
          run scale_fsdp2 250 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m launch.bench.step --variants compile-layers --master-fp32 --warmup 3 --steps 10 --parallelism fsdp ;;
    pipeline) run pipeline 3000 $PY -m launch.bench.pipeline --json "$OUT/pipeline.json" ;;
    mps)  # issue 6: do the shared placements reach their ideal when the processes run under MPS?
          # (stage rates: the H200's producer and trainer alone, BENCHMARKS.md, for the ideal column)
          run pipeline_mps 560 $PY -m launch.bench.pipeline --runs shared-1,shared-2,balanced-2 --seconds 20 --warm-steps 5 --timeout 200 --set launch.mps=true --stage-rates producer=13.15,trainer=6.27 --json "$OUT/pipeline_mps.json" ;;
    mps_share)  # issue 6: MPS with launch.mps_producer_sm_percent, the producers' share of the SMs (32: stage balance)
          for percent in 32 45; do
            run pipeline_mps_sm$percent 280 $PY -m launch.bench.pipeline --runs shared-2,balanced-2 --seconds 20 --warm-steps 5 --timeout 150 --set launch.mps=true --set launch.mps_producer_sm_percent=$percent --stage-rates producer=13.15,trainer=6.27 --json "$OUT/pipeline_mps_sm$percent.json"
          done ;;
    shared_fsdp)  # issue 6: both GPUs shared under MPS with an FSDP trainer (faster alone than DDP, half the memory)
          run pipeline_shared_fsdp 280 $PY -m launch.bench.pipeline --runs shared-2 --seconds 20 --warm-steps 5 --timeout 150 --set launch.mps=true --set training.parallelism=fsdp --stage-rates producer=13.15,trainer=6.27 --json "$OUT/pipeline_shared_fsdp.json" ;;
    stalls)  # issue 6: with the stalls of real training, decoupled (shared GPUs, headroom) against coupled
          run pipeline_stalls 560 $PY -m launch.bench.pipeline --runs coupled-2-stalls,shared-2-stalls --seconds 20 --warm-steps 5 --timeout 150 --cycles 1 --stall-every 40 --json "$OUT/pipeline_stalls.json" ;;
    evals)  # issue 18: one H200 under MPS, a checkpoint and a 16-prompt evaluation every 40 steps, decoupled against coupled
          run pipeline_evals 560 $PY -m launch.bench.pipeline --runs shared-1-evals,coupled-1-evals --warm-steps 5 --timeout 200 --cycles 3 --skip-cycles 1 --set launch.mps=true --json "$OUT/pipeline_evals.json"
          keep_run_logs pipeline_evals ;;
    pauses)  # issue 18: the same decoupled run against the coupled baseline the issue measured, a 10 s pause for each evaluation
          run pipeline_pauses 560 $PY -m launch.bench.pipeline --runs shared-1-evals,coupled-1-pauses --warm-steps 5 --timeout 200 --cycles 3 --skip-cycles 1 --set launch.mps=true --json "$OUT/pipeline_pauses.json"
          keep_run_logs pipeline_pauses ;;
    checkpoint)  # issue 6: the Qwen3-8B draft's checkpoint stall (synchronous against background) and write (eight threads
                 # against one), and what the disk under /tmp takes
          run disk 120 $PY -m launch.bench.disk --dir /tmp
          run checkpoint 400 $PY -m launch.bench.checkpoint --device cuda:0 --hidden 4096 --intermediate 12288 --layers 5 --vocab 151936 --repeats 1 --dir /tmp ;;
    checkpoint_fsdp)  # issue 6: the same draft's checkpoint stall under a 2-rank FSDP trainer (NCCL gather into reused pinned buffers)
          for mode in synchronous background; do
            run checkpoint_fsdp_$mode 320 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m launch.bench.checkpoint --parallelism fsdp --modes $mode --device auto --hidden 4096 --intermediate 12288 --layers 5 --vocab 151936 --repeats 1 --dir /tmp
          done ;;
    generate)  # issue 33: batched generation (static cache, CUDA graphs, refill) against plain generate, and its GPU test
          run generate_tests 300 $PY -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_generate.py
          run generate_smollm2 300 $PY -m launch.bench.generate --model smollm2 ${GGUF:+--path "$GGUF"} --rows 256 --prompts 1024 --json "$OUT/generate_smollm2.json"
          # more rows per decode step for the synthesis preset (synthesize.rows): a 135M model's step is launch-bound
          run generate_smollm2_1024 300 $PY -m launch.bench.generate --model smollm2 ${GGUF:+--path "$GGUF"} --rows 1024 --prompts 2048 --json "$OUT/generate_smollm2_1024.json"
          run generate_qwen3_8b 400 $PY -m launch.bench.generate --model qwen3-8b --rows 128 --prompts 256 --json "$OUT/generate_qwen3_8b.json" ;;
    dflash2)  # DFlash 2: its compiled CUDA step against the eager dense one, then its step cost beside DFlash's at the
              # Qwen3-8B, Qwen3.6-27B and SmolLM2 preset draft shapes (compiled layers, fp32 master weights, as trained)
          run dflash2_tests 300 $PY -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_dflash2.py
          run step_kinds_8b 240 $PY -m launch.bench.step --kinds dflash,dflash2 --variants compile-layers --master-fp32 --warmup 3 --steps 10
          run step_kinds_27b 300 $PY -m launch.bench.step --kinds dflash,dflash2 --draft qwen3.6-27b --variants compile-layers --master-fp32 --warmup 3 --steps 8
          run step_kinds_smollm2 240 $PY -m launch.bench.step --kinds dflash,dflash2 --draft smollm2-135m --seq-len 65536 --num-anchors 2048 --num-docs 160 --variants compile-layers --master-fp32 --warmup 3 --steps 10 ;;
    masks)  # block masks built from their tiles (a80755e, 4dd5bb8): the compiled flex forwards against the dense ones,
            # the build against create_block_mask's pair-by-pair one, and a SmolLM2-sized draft step (65,536 tokens)
          run masks_tests 420 $PY -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_drafter_masks.py tests/test_target.py
          run masks 200 $PY -m launch.bench.masks --repeats 5
          run step_smollm2 300 $PY -m launch.bench.step --draft smollm2-135m --seq-len 65536 --num-anchors 2048 --num-docs 160 --variants compile-layers --master-fp32 --warmup 3 --steps 10 ;;
    data)  # the producer's host data path on the GPU host's cores (needs GGUF=SmolLM2's file, for its tokenizer)
          run data 200 $PY -m launch.bench.data --gguf "$GGUF" --records 8000 --epochs 3 ;;
    quality)  # issue 33: the real drafter (needs GGUF=SmolLM2's file); over one call's time: in the background, its
              # JSON rewritten after every stage in /tmp/quality (collect it with the 'collect_quality' step)
          setsid nohup $PY -m launch.bench.quality --gguf "$GGUF" --out /tmp/quality ${QUALITY_ARGS:-} > /tmp/quality.log 2>&1 &
          echo "quality benchmark started (pid $!)" ;;
    collect_quality)  # wait up to QUALITY_WAIT_S for the background quality benchmark, then keep what it wrote
          wait_while_running launch.bench.quality "${QUALITY_WAIT_S:-500}"
          tail -n 30 /tmp/quality.log; cp /tmp/quality.log /tmp/quality/quality-*.json "$OUT/" 2>/dev/null
          tar czf "$OUT/quality-runs.tgz" --exclude="*.safetensors" --exclude="*.pt" /tmp/quality/*.log /tmp/quality/train*/logs /tmp/quality/train*/metrics.jsonl /tmp/quality/data/synthesized/status-*.json 2>/dev/null ;;
    recipes)  # issue 35: training options side by side (needs GGUF; RECIPES, the recipe list; RECIPE_ARGS, e.g. --steps);
              # in the background, one folder for every call (/tmp/recipes: the data is synthesized once)
          setsid nohup $PY -m launch.bench.recipes --gguf "$GGUF" --out /tmp/recipes ${RECIPE_ARGS:-} ${RECIPES:-default} >> /tmp/recipes.log 2>&1 &
          echo "recipes started (pid $!)" ;;
    collect_recipes)  # wait up to RECIPES_WAIT_S for the background recipes, then keep the table and the runs' records
          wait_while_running launch.bench.recipes "${RECIPES_WAIT_S:-500}"
          tail -n 40 /tmp/recipes.log; $PY -m launch.bench.recipes --out /tmp/recipes --table > "$OUT/recipes-table.txt" 2>&1
          cp /tmp/recipes.log /tmp/recipes/*.json "$OUT/" 2>/dev/null
          tar czf "$OUT/recipes-runs.tgz" --exclude="*.safetensors" --exclude="*.pt" /tmp/recipes/*.log /tmp/recipes/*-s*/logs /tmp/recipes/*-s*/metrics.jsonl /tmp/recipes/data/synthesized/status-*.json 2>/dev/null ;;
    kinds)  # issue 47: DFlash against DFlash 2 at equal data and GPU time (needs GGUF; KINDS_ROWS, the rows;
            # KINDS_ARGS, e.g. --minutes 4 --warm); in the background, its JSON rewritten as rows finish (/tmp/kinds)
          setsid nohup $PY -m launch.bench.kinds --gguf "$GGUF" --out /tmp/kinds ${KINDS_ARGS:-} ${KINDS_ROWS:-dflash dflash2} > /tmp/kinds.log 2>&1 &
          echo "kinds started (pid $!)" ;;
    collect_kinds)  # wait up to KINDS_WAIT_S for the background kinds benchmark, then keep the table and the runs' records
          wait_while_running launch.bench.kinds "${KINDS_WAIT_S:-500}"
          tail -n 30 /tmp/kinds.log; $PY -m launch.bench.kinds --out /tmp/kinds --table > "$OUT/kinds-table.txt" 2>&1
          cp /tmp/kinds.log /tmp/kinds/*.json "$OUT/" 2>/dev/null
          tar czf "$OUT/kinds-runs.tgz" --exclude="*.safetensors" --exclude="*.pt" /tmp/kinds/*.log /tmp/kinds/*-s*/logs /tmp/kinds/*-s*/metrics.jsonl /tmp/kinds/*-s*/trainer.json /tmp/kinds/data/synthesized/status-*.json 2>/dev/null ;;
    optimizer)  # issue 68: the trainer's optimizer step alone (Muon and AdamW) at the SmolLM2 preset's and the
                # Qwen3-8B drafts, then the preset's step with Muon, what its trainer runs, beside fused AdamW
          run optimizer_smollm2 200 $PY -m launch.bench.optimizer --draft smollm2-135m
          run optimizer_8b 200 $PY -m launch.bench.optimizer --draft qwen3-8b --steps 5 --repeats 3
          run step_muon_smollm2 300 $PY -m launch.bench.step --draft smollm2-135m --kinds dflash --variants compile-layers --master-fp32 --optimizer muon --warmup 3 --steps 10 ;;
    real_step)  # issue 68: the trainer's own step in a real run of the SmolLM2 preset (needs GGUF): two minutes of
                # launch/run_all.sh on the peers benchmark's data (or 8,192 records synthesized here), five steady steps
                # profiled; keeps its metrics.jsonl (step_time_s), its profile and its logs
          data="$PEERS_OUT/data/synthesized"
          if ! ls "$data"/*.jsonl > /dev/null 2>&1; then
            data=/tmp/real-data/synthesized
            run real_step_data 400 launch/run_all.sh synthesize --run-dir /tmp/real-data --config launch/smollm2-135m.toml target.path="\"$GGUF\"" synthesize.num_magpie=8192
          fi
          rm -rf /tmp/real-step
          run real_step 420 launch/run_all.sh --run-dir /tmp/real-step --config launch/smollm2-135m.toml target.path="\"$GGUF\"" "data.paths=[\"$data/*.jsonl\"]" training.max_minutes=2 eval.every_steps=0 logging.profile_steps=5 logging.profile_after=300 ${REAL_STEP_ARGS:-}
          cp /tmp/real-step/metrics.jsonl "$OUT/real_step-metrics.jsonl" 2>/dev/null
          cp /tmp/real-step/logs/trainer-profile.txt /tmp/real-step/logs/trainer.log "$OUT/" 2>/dev/null ;;
    small_shapes)  # issue 68: the step at small shapes, the compiled layers against their replay as CUDA graphs
          run step_graphs_smollm2 360 $PY -m launch.bench.step --draft smollm2-135m --kinds dflash,dflash2,dspark --variants compile-layers,compile-layers-graphs --master-fp32 --warmup 3 --steps 10
          run step_graphs_8b 240 $PY -m launch.bench.step --draft qwen3-8b --kinds dflash --variants compile-layers,compile-layers-graphs --master-fp32 --warmup 3 --steps 10 ;;
    peers)  # issue 66: ours beside the peers' trainers (needs GGUF; PEERS_WHEELS, the folder of the peers' wheels where
            # no package index is reached; PEERS_ARGS, e.g. --minutes 4 --peers speculators); in the background, in
            # PEERS_OUT (default /tmp/peers): the rows already trained there are kept, so a later call can add a peer
          launch/setup_peers.sh > "$OUT/setup_peers.log" 2>&1 || { tail -n 5 "$OUT/setup_peers.log"; exit 2; }
          setsid nohup $PY -m launch.bench.peers --gguf "$GGUF" --out "$PEERS_OUT" ${PEERS_ARGS:---minutes 4} >> "$PEERS_OUT.log" 2>&1 < /dev/null &
          echo "peers started (pid $!)" ;;
    collect_peers)  # wait up to PEERS_WAIT_S for the background peers benchmark, then keep the table and the rows' records
                    # (never a run's secrets/: its CURVE keys stay on the card)
          wait_while_running launch.bench.peers "${PEERS_WAIT_S:-500}"
          tail -n 30 "$PEERS_OUT.log"; $PY -m launch.bench.peers --out "$PEERS_OUT" --table > "$OUT/peers-table.txt" 2>&1
          cp "$PEERS_OUT.log" "$PEERS_OUT"/*.json "$OUT/" 2>/dev/null
          (cd "$(dirname "$PEERS_OUT")" && find "$(basename "$PEERS_OUT")" -type f -size -4M -not -path "*/secrets/*" \( -name "*.json" -o -name "*.jsonl" -o -name "*.log" -o -name "*.toml" -o -name "*.yaml" \) -print0 | tar czf "$OUT/peers-runs.tgz" --null -T -) 2>/dev/null ;;
    busy)  # issue 47: the trainer's busy share of the SmolLM2 preset alone on the GPU, 1 producer against BUSY_PRODUCERS
           # (default 3) under MPS, evaluating every 150 steps on producer 0 (needs the data of the 'kinds' step)
          for n in 1 ${BUSY_PRODUCERS:-3}; do
            devices=$($PY -c "import json; print(json.dumps(['cuda:0'] * $n))")
            run busy_p$n 400 $PY -m launch.bench.quality --gguf "$GGUF" --out /tmp/kinds --reuse-data --throughput-only --name busy-p$n --minutes ${BUSY_MINUTES:-1.5} "launch.producer_devices=$devices" eval.every_steps=150 eval.num_prompts=48
            cp /tmp/kinds/quality-busy-p$n.json "$OUT/" 2>/dev/null
          done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
