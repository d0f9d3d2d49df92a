#!/usr/bin/env bash
# The web stack the GPU image lacks, as wheels for its Python 3.12 (x86-64), into .whl/
# (git-ignored): the device tool carries the folder (`carry: [".whl"]`) and
# benchmarks/gpu_session.sh installs it for its server step. Run here, once, with pip's
# network access; the versions are the ones this project's CI runs.
set -eu
cd "$(dirname "$0")/.."
WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5
  typing_extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 llguidance==1.9.1"
mkdir -p .whl
for w in $WHEELS; do
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d .whl "$w"
done
ls -1 .whl
