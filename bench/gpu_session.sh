#!/usr/bin/env bash
# The GPU measurements as one prepared command for a lent GPU (the device tool's `run`):
# `trident doctor --gpu`, bench/gpu.py (every strategy against a plain loop), and its FP8 rows
# (bench/gpu.py --fp8), each written under $OUT.
#
# The device image has torch 2.11 but neither pydantic nor torchao: carry them as wheels. Here,
# once, in the repo's root:
#     echo /.whl/ >> .git/info/exclude
#     bash bench/gpu_session.sh --fetch          # pip download of WHEELS into .whl/ (about 6 MB)
# then, through the device tool:
#     run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=590)
# and commit what comes back (results/gpu.md, results/gpu_fp8.md, the doctor's report).
set -uo pipefail
cd "$(dirname "$0")/.."

# pydantic as the CPU venv has it; torchao 0.16, released for the torch 2.10-2.11 era (its float8
# training is Python over torch._scaled_mm; trident needs nothing newer from it).
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 torchao==0.16.0"

if [ "${1:-}" = "--fetch" ]; then
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
fi

OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "carry the wheels: bash bench/gpu_session.sh --fetch, then carry=[\".whl\"]"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
status=0
python3 -m trident.cli.main doctor --gpu 2>&1 | tee "$OUT/doctor.txt" || status=1
timeout 330 python3 bench/gpu.py --out "$OUT/gpu.md" || status=1
timeout 200 python3 bench/gpu.py --fp8 --out "$OUT/gpu_fp8.md" || status=1
exit $status
