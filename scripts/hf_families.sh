#!/usr/bin/env bash
# Every hf: family with a small default config through profile -> partition (4 straight stages) -> verify,
# in a temporary folder; prints one line per family. Usage: bash scripts/hf_families.sh [.venv/bin]
set -u
bin=$(cd "${1:-.venv/bin}" && pwd)
families=$("$bin/python" -c "from runtime.hf import FAMILIES; print(' '.join(FAMILIES))")
work=$(mktemp -d)
cd "$work" || exit 2
ok=0; total=0
for f in $families; do
  total=$((total + 1))
  log="$work/$f.log"
  if "$bin/pipeplan" profile "hf:$f" --repeats 1 >"$log" 2>&1 \
    && "$bin/pipeplan" partition --profile "profiles/hf-$f/profile.json" --gpus 4 --straight >>"$log" 2>&1 \
    && "$bin/pipeplan" verify "models/hf-$f/gpus=4" >>"$log" 2>&1; then
    ok=$((ok + 1)); echo "$f: $(tail -1 "$log" | cut -c1-100)"
  else
    echo "$f: FAILED: $(grep -m1 'error' "$log" | cut -c1-200) (log $log)"
  fi
done
echo "$ok of $total families verify at 4 straight stages"
[ "$ok" = "$total" ]
