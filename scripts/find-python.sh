#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter (megatron-core >= 0.17 requires 3.12), finding it
# on PATH or under pyenv, and installing it with pyenv when pyenv is there but has no 3.12.
# Exit 1 with instructions when none can be found or installed.
set -euo pipefail

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
for name in python3.12 python3.13 python3; do
  p=$(command -v "$name" 2>/dev/null || true)
  [ -n "$p" ] && candidates+=("$p")
done
pyenv_root=$( (command -v pyenv >/dev/null && pyenv root) 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for p in $(ls -d "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r) /usr/bin/python3.12 /usr/local/bin/python3.12; do
  candidates+=("$p")
done
for p in "${candidates[@]}"; do
  # pyenv shims may point at another version: resolve them to the real interpreter
  real=$("$p" -c 'import sys; print(sys.executable)' 2>/dev/null || true)
  if [ -n "$real" ] && ok "$real"; then echo "$real"; exit 0; fi
done

if command -v pyenv >/dev/null 2>&1; then
  echo "find-python: no Python 3.12 found; installing it with pyenv (pyenv install -s 3.12)" >&2
  if pyenv install -s 3.12 >&2; then
    p=$(ls -d "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r | head -n 1)
    if [ -n "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  fi
fi
cat >&2 <<'MSG'
find-python: Python 3.12 or newer is required and none was found.
Install it (e.g. `pyenv install 3.12`, or your distribution's python3.12 package) or point
PYTHON=/path/to/python3.12 at one, then run the command again.
MSG
exit 1
