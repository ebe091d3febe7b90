#!/usr/bin/env bash
# Create .venv and install tdgather into it (editable), with extras given as $1 (e.g. "test").
# torch: installed only when the venv has none, as $TDGATHER_TORCH (default the local CPU
# build, torch==2.13.0); set TDGATHER_TORCH to any pip requirement to choose another build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TDGATHER_VENV:-.venv}
pip_q=(--disable-pip-version-check -q)
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing ${TDGATHER_TORCH:-torch==2.13.0} into $venv"
  "$venv/bin/pip" install "${pip_q[@]}" "${TDGATHER_TORCH:-torch==2.13.0}" 2> >(grep -v "is ignored: it is neither" >&2)
fi
extras=${1:+[$1]}
"$venv/bin/pip" install "${pip_q[@]}" -c constraints.txt -e ".$extras" 2> >(grep -v "is ignored: it is neither" >&2)
