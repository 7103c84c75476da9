#!/usr/bin/env bash
# Fetch, into .whl/, the wheels of the packages the engine imports that the GPU machines' Python
# (3.12, x86-64, no internet) lacks, at the versions of this checkout's .venv; scripts/gpu_check.sh
# installs them there before its steps. Run it here, where PyPI is reachable, then carry .whl with
# the call (it must be ignored by git: `echo /.whl/ >> .git/info/exclude`).
#
#   scripts/gpu_wheels.sh [PACKAGE ...]     (default: the list below)
set -eu
cd "$(dirname "$0")/.."
venv_python=.venv/bin/python
# The engine's imports missing from the GPU image: the grammar matcher, the S3 and hub clients'
# libraries, and gguf (the embedded model's reader, for a machine that has its GGUF file).
packages=${*:-llguidance httpx2 httpcore2 truststore boto3 botocore s3transfer jmespath gguf}
mkdir -p .whl
for package in $packages; do
    version=$("$venv_python" -m pip show "$package" 2>/dev/null | sed -n 's/^Version: //p')
    spec=$package${version:+==$version}
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$spec"
done
du -sh .whl
