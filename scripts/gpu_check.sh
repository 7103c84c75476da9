#!/usr/bin/env bash
# The CUDA path's check in one command (benchmarks/gpu_check.py says what it runs and writes):
#
#   scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--model-dir DIR] [--budget-s 470]
#
# OUT_DIR defaults to $OUT. Runs with $PYTHON, else the repository's .venv where it has one, else
# python3 (on the GPU machines, the Python that holds PyTorch), with the repository on PYTHONPATH:
# nothing is built or installed, and the compiled CPU ops are not needed on CUDA. Packages that
# Python lacks there (no internet) travel as wheels in .whl/ (scripts/gpu_wheels.sh fetches them,
# on a machine that reaches PyPI): they are installed into a scratch folder first. Every step runs
# whatever the ones before it did; the exit status is 0 when all passed.
set -u
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    python=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "" 2>/dev/null; then
    python=.venv/bin/python
else
    python=python3
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        || echo "gpu_check.sh: installing .whl/*.whl failed; the steps that need them will say what is missing" >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$python" -m benchmarks.gpu_check "$@"
status=$?
[ -z "${site:-}" ] || rm -rf "$site"
exit $status
