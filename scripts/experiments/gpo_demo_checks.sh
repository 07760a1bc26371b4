#!/usr/bin/env bash
# Why VSE∞ (GPO) does not beat VSE++ on the openclipart demo: the checks behind README "What the demo gives"
# and docs/demo_results.md. Needs a finished `vse demo --seeds 3` in DEMO_RUNS.
#   bash scripts/experiments/gpo_demo_checks.sh DATA DEMO_RUNS OUT
# 1. GPO on one side only (BiGRU, the demo's settings), seeds 0-2, scored on test;
# 2. every demo run scored on the training split (fit vs generalisation);
# 3. the learned GPO weights (`vse pooling`).
# Finished runs (RUN.test.json present, beside the run: results never go into a run) are skipped, so an
# interrupted run resumes.
set -euo pipefail
DATA=${1:?dataset dir}; DEMO=${2:?demo run dir}; OUT=${3:?output dir}
VSE=${VSE:-vse}; PYTHON=${PYTHON:-python}   # both from the environment vsekit is installed in
mkdir -p "$OUT"
# the demo's own overrides for its VSE∞ BiGRU run (8 epochs), as `--set` arguments
mapfile -t DEMO_SETS < <("$PYTHON" -c '
from vsekit_lab.demo import VARIANTS, DEMO_EPOCHS, demo_overrides
variant = next(v for v in VARIANTS if v.name == "vse_infty_bigru")
for item in demo_overrides(variant, DEMO_EPOCHS):
    print("--set"); print(item)')
[ ${#DEMO_SETS[@]} -gt 0 ] || { echo "gpo_demo_checks: cannot import vsekit with $PYTHON (set PYTHON=...)" >&2; exit 1; }
for cfg in imggpo_txtavg:model.text.pooling.name=avg imgavg_txtgpo:model.image.pooling.name=avg; do
  name=${cfg%%:*}; override=${cfg#*:}
  mkdir -p "$OUT/$name"
  for seed in 0 1 2; do
    run="$OUT/$name/seed$seed"
    [ -f "$run.test.json" ] && continue
    "$VSE" train --recipe vse_infty --data "$DATA" --out "$run" --overwrite --no-progress --seed "$seed" \
      "${DEMO_SETS[@]}" --set "$override" > "$run.log" 2>&1
    "$VSE" eval "$run" --split test --json-out "$run.test.json" > /dev/null
  done
done
mkdir -p "$OUT/train_split"
for run in "$DEMO"/*/seed*; do
  variant=$(basename "$(dirname "$run")"); seed=$(basename "$run")
  "$VSE" eval "$run" --split train --json-out "$OUT/train_split/${variant}_${seed}.json" > /dev/null
done
"$VSE" pooling "$DEMO"/vse_infty_*/seed* --png "$OUT/gpo_weights.png"
"$PYTHON" - "$OUT" "$DEMO" <<'PY'
import json, statistics, sys
from pathlib import Path
out, demo = Path(sys.argv[1]), Path(sys.argv[2])
def show(label, values):
    print(f"{label:28s} " + " ".join(f"{v:6.1f}" for v in values) + f"   mean {statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}")
runs = json.loads((demo / "results.json").read_text())["runs"]
print("test rsum, seeds 0-2")
for key in ("vsepp_bigru", "vse_infty_bigru"):
    show(key, [r["metrics"]["rsum"] for r in runs[key]])
for name in ("imggpo_txtavg", "imgavg_txtgpo"):
    show(name, [json.loads((out / name / f"seed{s}.test.json").read_text())["rsum"] for s in range(3)])
print("train-split rsum, seeds 0-2")
for key in sorted(runs):
    show(key, [json.loads((out / "train_split" / f"{key}_seed{s}.json").read_text())["rsum"] for s in range(3)])
PY
