#!/usr/bin/env bash
# Foundation checks on a CUDA machine with PyTorch + transformers 5.17 (the lent H200):
#  1. the HF fixtures regenerate there with the same reference losses as committed;
#  2. `eval --device cuda` matches those losses (1e-3 relative);
#  3. `generate --device cuda` on stories260K reproduces llama2.c's greedy text.
# Usage: foundation_h200.sh BIN_DIR STORIES_DIR OUT_DIR   (BIN_DIR holds lemo-train)
set -uo pipefail
bin=$1/lemo-train stories=$2 out=$3
fixtures=crates/lemo-models/tests/fixtures/hf
mkdir -p "$out"

loss_of() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['loss'])" "$1"; }

declare -A committed
for case_dir in "$fixtures"/*/; do
  case=$(basename "$case_dir"); committed[$case]=$(loss_of "$case_dir/expected.json")
done
python3 "$fixtures/make_fixtures.py" > "$out/make_fixtures.log" 2>&1 || echo "make_fixtures.py failed (see log)"

failures=0
{
  echo "{"
  first=1
  for case_dir in "$fixtures"/*/; do
    case=$(basename "$case_dir")
    regenerated=$(loss_of "$case_dir/expected.json")
    cuda=$("$bin" eval --model "$case_dir" --data "$case_dir/tokens.jsonl" --seq-len 64 --json --device cuda 2>>"$out/eval.err" \
      | python3 -c "import json,sys; print(json.load(sys.stdin)['loss'])")
    ok=$(python3 -c "import sys; a,b,c=map(float,sys.argv[1:]); print(abs(a-b)/b<1e-6 and abs(c-b)/b<1e-3)" \
      "$regenerated" "${committed[$case]}" "${cuda:-nan}")
    [ "$ok" = True ] || failures=$((failures+1))
    [ $first = 1 ] || echo ","; first=0
    printf '  "%s": {"committed": %s, "regenerated_on_gpu_machine": %s, "eval_cuda": %s, "ok": %s}' \
      "$case" "${committed[$case]}" "$regenerated" "${cuda:-null}" "$( [ "$ok" = True ] && echo true || echo false)"
  done
  echo; echo "}"
} > "$out/foundation.json"
cat "$out/foundation.json"

"$bin" generate --model "$stories/stories260K.bin" --prompt "" --max-new-tokens 100 --device cuda > "$out/generate.txt" 2>>"$out/eval.err"
if python3 -c "import sys; a=open(sys.argv[1]).read().rstrip(); b=open(sys.argv[2]).read().rstrip(); n=min(len(a),len(b)); sys.exit(0 if n>200 and a[:n]==b[:n] else 1)" \
    "$out/generate.txt" "$stories/expected_greedy_once_upon.txt"; then
  echo "generate --device cuda: matches llama2.c"
else
  echo "generate --device cuda: DIFFERS from llama2.c"; failures=$((failures+1))
fi
echo "$failures failed"
exit $((failures > 0))
