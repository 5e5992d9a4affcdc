#!/usr/bin/env bash
# The whole workflow on this machine: profile vgg16, plan it for 4 GPUs and verify the generated stages,
# then plan it for 2 devices and train a few steps on them (CPU ranks over gloo when there is no GPU),
# printing measured against predicted time per minibatch, and feed the measured stage times back.
# `make demo` calls it with the virtualenv's bin folder; it writes profiles/ and models/ here.
set -euo pipefail
BIN=$(cd "${1:-.venv/bin}" && pwd)
pipeplan() { "$BIN/pipeplan" "$@"; }
# Two ranks share this machine's cores in step 4: measure each layer with the threads one rank will get.
threads=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))

step() { if [ -t 1 ]; then printf '\n\033[1m== %s\033[0m\n  $ %s\n' "$1" "$2"; else printf '\n== %s\n  $ %s\n' "$1" "$2"; fi; }

step "1. profile: trace vgg16 with torch.fx, time every layer (small images so a CPU is quick)" \
     "pipeplan profile vgg16 --batch-size 8 --input-shape 3,64,64 --threads $threads"
pipeplan profile vgg16 --batch-size 8 --input-shape 3,64,64 --threads "$threads"

step "2. partition: stages and replicas for 4 GPUs, beside the data-parallel and balanced baselines" \
     "pipeplan partition --gpus 4 --explain"
pipeplan partition --gpus 4 --explain

step "3. verify: the 4-GPU package's stages against the original model (outputs, loss, every gradient)" \
     "pipeplan verify models/vgg16/gpus=4"
pipeplan verify models/vgg16/gpus=4

step "4. partition for 2 devices (PipeDream's 1F1B with weight stashing), then train 8 steps on 2 ranks" \
     "pipeplan partition --gpus 2 && pipeplan run models/vgg16/gpus=2 --steps 8 --lr 0.001"
pipeplan partition --gpus 2
pipeplan run models/vgg16/gpus=2 --steps 8 --lr 0.001

step "5. calibrate: the run's measured stage times against the profile's, fed back for the next plan" \
     "pipeplan calibrate models/vgg16/gpus=2"
# On a busy machine calibrate refuses the run's times (they include waiting for other jobs); the demo
# shows the refusal, then takes them anyway so that step 6 has a calibrated profile to plan from.
if ! pipeplan calibrate models/vgg16/gpus=2; then
  printf '  $ pipeplan calibrate models/vgg16/gpus=2 --accept-load   (the demo goes on with them)\n'
  pipeplan calibrate models/vgg16/gpus=2 --accept-load
fi

step "6. plan again from the calibrated profile and train again: measured/predicted shows how close it came" \
     "pipeplan partition --profile profiles/vgg16/calibrated.json --gpus 2 --force && pipeplan run ... --steps 8"
pipeplan partition --profile profiles/vgg16/calibrated.json --gpus 2 --force
pipeplan run models/vgg16/gpus=2 --steps 8 --lr 0.001

printf '\nWritten: profiles/vgg16/{profile,calibrated}.json, models/vgg16/gpus={2,4}/ (stage code, plan.json,\n'
printf 'mp_conf.json), models/vgg16/gpus=2/run/metrics.json (the first run: runs.<time>/). Next: %s/pipeplan --help\n' \
       "${1:-.venv/bin}"
