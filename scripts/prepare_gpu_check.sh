#!/usr/bin/env bash
# Copy the prepared GPU check (gpu_check.sh, the released code's timer and the released code it reads) into the
# git-ignored .ref/ folder and adapt the copy to this tree, so that a GPU machine that receives only the working tree
# can run it:
#
#     bash scripts/prepare_gpu_check.sh [SHARED]    # SHARED: the folder holding tools/ and reference-code/
#     (REF_DIR: where the copy goes, default .ref; PYTHON: the interpreter that parses tests/, default .venv's)
#     OUT=$OUT REF_TOOL=.ref/tools/bench_released_vse_infty.py bash .ref/tools/gpu_check.sh
#
# Rehearse it on a CPU first (tiny shapes, minutes):
#     SMALL=1 DEV=cpu PY=.venv/bin/python OUT=gpu_check_dry REF_TOOL=.ref/tools/bench_released_vse_infty.py \
#         bash .ref/tools/gpu_check.sh
#
# Then, in a second call with the time left: one COCO-sized epoch of `vse train`, eager and with the graph:
#     OUT=$OUT bash scripts/gpu_epoch.sh
# Issue it at once: the GPU machine stays warm only briefly after a call (its .venv with it), and a fresh start
# costs minutes of the device time. With little time left, a smaller set: N=30000 LIMIT=90.
#
# The adaptations (each one checked: the script stops when a pattern it edits is missing):
# - the profile step imports the training-step builder from the lab package (vsekit_lab.bench), not the library;
# - the CUDA-only test list gains every test marked as needing CUDA that the shipped list lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${1:-../shared}
REF=${REF_DIR:-.ref}
PYTHON=${PYTHON:-.venv/bin/python}
for d in tools reference-code; do
  [ -d "$SHARED/$d" ] || { echo "prepare_gpu_check: $SHARED/$d not found (pass the shared folder as argument)" >&2; exit 2; }
done
rm -rf "$REF"
mkdir -p "$REF"
cp -r "$SHARED/tools" "$SHARED/reference-code" "$REF/"
chmod -R u+w "$REF"
CHECK=$REF/tools/gpu_check.sh

# the builder's module, taken from the tree rather than assumed
mod=$(grep -rl "^def build_train_step" src --include=*.py | head -1)
[ -n "$mod" ] || { echo "prepare_gpu_check: no build_train_step in src/" >&2; exit 1; }
mod=${mod#src/}; mod=${mod%.py}; mod=${mod//\//.}
grep -q "^from vsekit.bench.train_step import build_train_step" "$CHECK" \
  || { echo "prepare_gpu_check: the profile step's import line changed; adapt this script" >&2; exit 1; }
sed -i "s/^from vsekit.bench.train_step import build_train_step/from $mod import build_train_step/" "$CHECK"

# every CUDA-only test (a skipif on torch.cuda.is_available, directly or through a CUDA marker)
missing=()
while IFS= read -r id; do
  grep -qF "\"$id\"" "$CHECK" || missing+=("$id")
done < <("$PYTHON" - <<'EOF'
import ast, pathlib

def cuda_mark(node):
    text = ast.unparse(node)
    return "cuda.is_available" in text and "skipif" in text

for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    tree = ast.parse(path.read_text())
    names = {t.id for n in tree.body if isinstance(n, ast.Assign) and cuda_mark(n.value) for t in n.targets
             if isinstance(t, ast.Name)}
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"):
            if any(cuda_mark(d) or (isinstance(d, ast.Name) and d.id in names) for d in n.decorator_list):
                print(f"{path}::{n.name}")
EOF
)
if [ "${#missing[@]}" -gt 0 ]; then
  anchor='"tests/test_ladder.py::test_cuda_graph_levels_equal_eager_and_cpu"'
  grep -qF "$anchor" "$CHECK" || { echo "prepare_gpu_check: the CUDA test list changed; adapt this script" >&2; exit 1; }
  extra=""
  for id in "${missing[@]}"; do extra+=" \\\\\n  \"$id\""; done
  sed -i "s|^  $anchor\$|  $anchor$extra|" "$CHECK"
fi
bash -n "$CHECK"
echo "prepared $REF/ (builder: $mod; CUDA tests added: ${#missing[@]})"
printf '  %s\n' "${missing[@]}"
