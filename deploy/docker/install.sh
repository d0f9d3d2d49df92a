#!/bin/sh
# The one install of jaxserve that every image runs, and tests/test_install_script.py
# runs too (so CI proves the images' install without a Docker engine).
#
#   install.sh VENV [PLATFORM] [PACKAGE] [-- PIP_ARGS...]
#
# VENV      the virtual environment to create (or reuse) and install into
# PLATFORM  cpu (default) | cuda | tpu: the jaxlib build (the pyproject extras gpu, tpu)
# PACKAGE   what to install: a source tree or a built wheel (default: this repository)
# PIP_ARGS  more pip install arguments (e.g. --no-index --find-links DIR)
set -eu

usage() { echo "usage: $0 VENV [cpu|cuda|tpu] [PACKAGE] [-- PIP_ARGS...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
venv=$1; shift
platform=cpu
package=$(cd "$(dirname "$0")/../.." && pwd)
if [ $# -ge 1 ] && [ "$1" != "--" ]; then platform=$1; shift; fi
if [ $# -ge 1 ] && [ "$1" != "--" ]; then package=$1; shift; fi
if [ $# -ge 1 ]; then [ "$1" = "--" ] || usage; shift; fi

case "$platform" in
    cpu) extra="" ;;
    cuda) extra="[gpu]" ;;    # jax[cuda13]: CUDA and cuDNN come as pip packages
    tpu) extra="[tpu]" ;;     # jax[tpu]: libtpu
    *) echo "install.sh: unknown platform '$platform' (cpu, cuda or tpu)" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --no-cache-dir "$@" "$package$extra"
# The entry point the images run, and the engine's imports, must work.
"$venv/bin/jaxserve" --version
"$venv/bin/python" -c "import jax, jaxserve.engine.llm; print('jax', jax.__version__)"
