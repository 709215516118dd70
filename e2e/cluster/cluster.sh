#!/usr/bin/env bash
# Thin wrapper: run cluster.py with the repo's virtualenv (falls back to python3).
#   e2e/cluster/cluster.sh build|up|down|status|env
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py="$here/../../.venv/bin/python"
[ -x "$py" ] || py=python3
exec "$py" "$here/cluster.py" "$@"
