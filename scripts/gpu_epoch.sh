#!/usr/bin/env bash
# One COCO-sized epoch of `vse train` on a GPU, eager and with the CUDA graph (`vse bench epoch`), each under a
# time limit, the JSON of each under $OUT. The follow-up to the prepared GPU check (scripts/prepare_gpu_check.sh):
#
#     OUT=$OUT bash scripts/gpu_epoch.sh            # knobs: DEV (cuda), N (113287), LIMIT (s per run, 200)
#
# Setup: a .venv that imports torch with CUDA and vsekit is used as is; else one is made that sees the CUDA
# torch of the machine's python3 through a .pth file and installs vsekit alone (no network needed).
# Rehearse it on a CPU: DEV=cpu N=300 EXTRA="--regions 8 --img-dim 64" OUT=epoch_dry bash scripts/gpu_epoch.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_epoch_out}; DEV=${DEV:-cuda}; N=${N:-113287}; LIMIT=${LIMIT:-200}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
ok() { "$1" -c "import torch, vsekit, sys; sys.exit(0 if '$DEV' == 'cpu' or torch.cuda.is_available() else 1)" \
  >/dev/null 2>&1; }
if ! ok .venv/bin/python; then
  rm -rf .venv
  python3 -m venv .venv
  parent=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$parent" >"$own/zz_parent_site.pth"
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/setup.log" 2>&1
fi
ok .venv/bin/python || { echo "gpu_epoch: no python with torch, vsekit and $DEV here (see $OUT/setup.log)"; exit 2; }
# the set once for both runs (16.7 GB at COCO's size), removed at the end
SET=$(mktemp -d -t vsekit-epoch-set.XXXXXX); trap 'rm -rf "$SET"' EXIT
# shellcheck disable=SC2086  # EXTRA is a list of options
shape=$(.venv/bin/python - $EXTRA <<'PY'
import argparse, sys
p = argparse.ArgumentParser(); p.add_argument("--regions", type=int, default=36); p.add_argument("--img-dim", type=int, default=2048)
a, _ = p.parse_known_args(sys.argv[1:]); print(a.regions, a.img_dim)
PY
)
read -r regions img_dim <<<"$shape"
s=$(date +%s)
.venv/bin/python -c "import sys; from vsekit_lab.bench.epoch import write_epoch_set as w; w(sys.argv[1], int(sys.argv[2]), \
  int(sys.argv[3]), int(sys.argv[4]), 1000)" "$SET" "$N" "$regions" "$img_dim" || exit 1
echo "gpu_epoch: wrote $N x ${regions}x$img_dim float16 in $(( $(date +%s) - s )) s" | tee -a "$OUT/epoch.log"
for variant in eager graph; do
  keys=(--set train.cuda_graph=false); [ "$variant" = graph ] && keys=(--set train.cuda_graph=true)
  # shellcheck disable=SC2086
  timeout -k 5 $((LIMIT + 30)) .venv/bin/python -m vsekit.cli bench epoch --device "$DEV" --data "$SET" \
    --n "$N" $EXTRA "${keys[@]}" --timeout "$LIMIT" --json-out "$OUT/epoch_$variant.json" 2>&1 | tee -a "$OUT/epoch.log"
done
ls "$OUT"
