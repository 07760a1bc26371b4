#!/usr/bin/env bash
# Set up, lint and run the whole test suite (unit + end-to-end). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
# one formatter: ruff format (a `# fmt: skip` only where a table's layout carries meaning)
.venv/bin/ruff format --check src tests scripts
# the dependency direction of docs/architecture.md (pyproject.toml [tool.importlinter]); a wrong-way import fails here
.venv/bin/lint-imports
# screenshots and other test artefacts (e.g. the search page in headless Chromium) land here
export VSE_ARTIFACTS="${VSE_ARTIFACTS:-artifacts}"
mkdir -p "$VSE_ARTIFACTS"
# VSE_KERNELS="native default avx2": the suite once per CPU kernel level (scripts/test_kernels.sh)
if [ -n "${VSE_KERNELS:-}" ]; then
  exec bash scripts/test_kernels.sh "$@"
fi
.venv/bin/python -m pytest -q "$@"
