#!/usr/bin/env bash
# Run the test suite against another torch, in a venv of its own.
#
#   tools/test_torch.sh 2.11.0 [pytest args...]     # e.g. tools/test_torch.sh 2.14.1 -x tests/test_lax.py
#
# The venv is /tmp/fshard-torch-VERSION (FSHARD_VENV_DIR overrides /tmp); it is made on the first
# run and reused. torch is installed pinned (`torch==VERSION`): the registry's builds of other
# versions are CUDA builds of several GB, which run on a CPU machine too. fshard is installed
# editable from this checkout, so the suite tests the working tree. PYTHON picks the interpreter
# (default: python3). docs/measurements.md's "Compatibility" table lists what was run this way.
set -euo pipefail
version="${1:?usage: tools/test_torch.sh TORCH_VERSION [pytest args...]}"
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${FSHARD_VENV_DIR:-/tmp}/fshard-torch-${version}"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==${version}"
fi
"$venv/bin/python" -m pip install -q -e "${root}[test]"
installed="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [ "$installed" != "$version" ]; then
    echo "tools/test_torch.sh: the venv holds torch $installed, not $version" >&2
    exit 2
fi
cd "$root"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
