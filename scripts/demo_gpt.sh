#!/usr/bin/env bash
# A small GPT learns Python source byte by byte on 2 pipeline stages: profile the built-in byte-gpt,
# plan it for 2 devices, and train it a few hundred steps on text that ships with Python (standard
# library packages for training, another package held out), evaluating the held-out text as it goes
# and writing checkpoints. `make demo-gpt` calls it with the virtualenv's bin folder; it writes
# corpus/, profiles/ and models/ here.
set -euo pipefail
BIN=$(cd "${1:-.venv/bin}" && pwd)
pipeplan() { "$BIN/pipeplan" "$@"; }
threads=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))  # two ranks share this machine's cores
PKG=models/byte-gpt/gpus=2

step() { if [ -t 1 ]; then printf '\n\033[1m== %s\033[0m\n  $ %s\n' "$1" "$2"; else printf '\n== %s\n  $ %s\n' "$1" "$2"; fi; }

step "1. text: the standard library's email, http, logging and urllib sources to train on, json held out" \
     "python -c '...' -> corpus/stdlib-train.txt, corpus/stdlib-heldout.txt"
"$BIN/python" - <<'PY'
import pathlib
import sysconfig

lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
out = pathlib.Path("corpus")
out.mkdir(exist_ok=True)
for name, packages in (("train", ("email", "http", "logging", "urllib")), ("heldout", ("json",))):
    files = [p for package in packages for p in sorted((lib / package).glob("*.py"))]
    text = b"".join(p.read_bytes() for p in files)
    (out / f"stdlib-{name}.txt").write_bytes(text)
    print(f"corpus/stdlib-{name}.txt: {len(text):,} bytes from {len(files)} files of {', '.join(packages)}")
PY

step "2. profile: byte-gpt (4 blocks, 128 wide, a byte vocabulary of 256), 16 windows of 64 bytes" \
     "pipeplan profile byte-gpt --batch-size 16 --input-shape 64 --threads $threads"
pipeplan profile byte-gpt --batch-size 16 --input-shape 64 --threads "$threads"

# Synchronous 1F1B trains exactly like the unsplit model; --straight asks for 2 pipeline stages where the
# optimizer would pick 2 data-parallel replicas for a model this small.
step "3. partition: 2 pipeline stages under synchronous 1F1B (4 microbatches per minibatch)" \
     "pipeplan partition --gpus 2 --schedule 1f1b --straight"
pipeplan partition --gpus 2 --schedule 1f1b --straight

step "4. train 400 steps on 2 ranks: held-out loss every 50 steps, a checkpoint every 100" \
     "pipeplan run $PKG --data text:corpus/stdlib-train.txt --seq-len 64 --eval-data text:corpus/stdlib-heldout.txt ..."
pipeplan run "$PKG" --steps 400 --data text:corpus/stdlib-train.txt --seq-len 64 --shuffle \
    --eval-data text:corpus/stdlib-heldout.txt --eval-every 50 \
    --optimizer adamw --lr 0.003 --weight-decay 0.01 --lr-schedule cosine --warmup-steps 20 \
    --checkpoint-every 100

step "5. export: the step-400 checkpoint as one state_dict of byte-gpt, loaded back strictly" \
     "pipeplan export $PKG -o byte-gpt.pt"
pipeplan export "$PKG" -o byte-gpt.pt
"$BIN/python" - "$PKG" <<'PY'
import json
import sys

import torch
from partitioner.models.specs import load_model

model = load_model("byte-gpt").build()
model.load_state_dict(torch.load("byte-gpt.pt"), strict=True)
model.eval()
data = torch.frombuffer(bytearray(open("corpus/stdlib-heldout.txt", "rb").read()), dtype=torch.uint8).long()
n = (len(data) - 1) // 64
inputs, targets = data[: n * 64].view(n, 64), data[1 : n * 64 + 1].view(n, 64)
with torch.no_grad():
    logits = torch.cat([model(inputs[i : i + 16]) for i in range(0, n, 16)])
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)).item()
last = json.load(open(f"{sys.argv[1]}/run/metrics.json"))["eval"][-1]
print(f"byte-gpt.pt loads strictly into byte-gpt: held-out loss {loss:.4f} in one process "
      f"(the pipeline's last evaluation: {last['loss']:.4f} at step {last['step']})")
PY

printf '\nWritten: corpus/stdlib-{train,heldout}.txt, profiles/byte-gpt/profile.json, %s/ (stage code,\n' "$PKG"
printf 'plan.json), %s/run/metrics.json (losses, held-out evaluations), %s/run/checkpoints/step-N/ and byte-gpt.pt.\n' \
       "$PKG" "$PKG"
