#!/usr/bin/env bash
# Every hf: family with a small default config through the whole chain, as a user runs it, in a
# temporary folder: profile -> partition (2 GPUs, 4 straight stages, interleaved: 4 stages on 2 ranks,
# zbv) -> verify each -> run 2 steps of each (zbv verified only). Prints one line per family and a total.
# Usage: bash scripts/hf_families.sh [.venv/bin] [FAMILY...]   (default: every family of runtime/building/hugging_face.py)
set -u
bin=$(cd "${1:-.venv/bin}" && pwd)
shift || true
families=${*:-$("$bin/python" -c "from runtime.building.hugging_face import FAMILIES; print(' '.join(FAMILIES))")}
work=$(mktemp -d)
cd "$work" || exit 2
ok=0; total=0
step() {  # step NAME COMMAND...: run, log, stop the family at the first failure
  local name=$1; shift
  echo "\$ $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then failed=$name; return 1; fi
}
for f in $families; do
  total=$((total + 1)); log="$work/$f.log"; failed=""; start=$SECONDS
  models="models/hf-$f"
  step profile "$bin/pipeplan" profile "hf:$f" --batch-size 4 --repeats 1 \
    && for plan in "2:" "4:--straight" "2:--schedule interleaved -o inter" "2:--schedule zbv -o zbv"; do
      gpus=${plan%%:*}; extra=${plan#*:}
      root=$(echo "$extra" | sed -n 's/.*-o \([a-z]*\).*/\1/p'); root=${root:-models}
      # shellcheck disable=SC2086
      step partition "$bin/pipeplan" partition --profile "profiles/hf-$f/profile.json" --gpus "$gpus" $extra \
        && step verify "$bin/pipeplan" verify "$root/hf-$f/gpus=$gpus" \
        && { [ "$root" = zbv ] || step run "$bin/pipeplan" run "$root/hf-$f/gpus=$gpus" --steps 2 --timeout 120; } \
        || break
    done
  if [ -z "$failed" ]; then
    ok=$((ok + 1)); echo "$f: ok ($((SECONDS - start)) s; $(grep -m1 -o 'loss [0-9.]* -> [0-9.]*' "$log"))"
  else
    echo "$f: FAILED at $failed: $(grep -m1 -E '^error|Error' "$log" | cut -c1-200) (log $log)"
  fi
done
echo "$ok of $total families pass profile, partition (2, 4 straight, interleaved, zbv), verify and run"
[ "$ok" = "$total" ]
