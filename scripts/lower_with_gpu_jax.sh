#!/usr/bin/env bash
# Lower the Mosaic GPU and Pallas-Triton kernels for CUDA with the GPU machine's JAX (0.11.2,
# Python 3.12) on a CPU machine: Mosaic GPU's layout inference, SMEM-transform and TMA checks
# differ between JAX versions (0.11 rejected two kernels that 0.10 lowered), and this catches that
# without a GPU. Also runs the Mosaic GPU kernels under 0.11's interpreter. Needs a Python 3.12
# and the package index (first run ~1 minute); the venv is kept in $VENV.
#   bash scripts/lower_with_gpu_jax.sh            # lowering, refusals, shared memory (~15 s)
#   bash scripts/lower_with_gpu_jax.sh --all      # + the interpreted kernels (~2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION=${JAX_VERSION:-0.11.2}
VENV=${VENV:-/tmp/venv-jax-$JAX_VERSION}
PY=""
for c in ${PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  if "$c" --version >/dev/null 2>&1; then PY=$c; break; fi
done
[ -n "$PY" ] || { echo "no Python 3.12 found: set PYTHON312=/path/to/python3.12" >&2; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" numpy pytest
fi
"$VENV/bin/python" -c "import jax; print('jax', jax.__version__)"
K="lowers or warp_specialised_kernels_lower or refuse or two_ctas or variants"
[ "${1:-}" = "--all" ] && K="$K or interpreted or api or entry"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -W error::DeprecationWarning \
    tests/pallas_kernels/test_mosaic_gpu.py -k "$K"
