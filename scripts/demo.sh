#!/usr/bin/env bash
# The whole workflow on this machine's CPU; `make demo` calls it with the virtualenv's bin folder.
set -euo pipefail
BIN=${1:-.venv/bin}
"$BIN/pipeplan" profile vgg16 --batch-size 8 --input-shape 3,64,64
