#!/usr/bin/env bash
# The Python environment moecap builds its extension with and runs its Python
# tests in: a venv outside the repository, so it survives between runs and
# checkouts, at ${MOECAP_VENV:-$HOME/.cache/moecap/venv}, with
# python/requirements-dev.txt from PyPI (torch >= 2.4, NumPy 2, JAX, ...).
# Reused while the requirements and the base interpreter are what it was made
# from (a stamp file); updated in place when only the requirements changed,
# rebuilt from scratch when the interpreter did. Prints the venv's
# python on stdout (everything else goes to stderr). Used by setup.sh.
#
# The base interpreter is ${MOECAP_VENV_PYTHON:-python3 on PATH} (pyenv's
# CPython 3.11 on this project's machines): it ships its C headers, which the
# extension needs, and venv/ensurepip. Debian's /usr/bin/python3 would need
# python3-venv and python3-dev from apt as well.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${MOECAP_VENV:-$HOME/.cache/moecap/venv}
base=${MOECAP_VENV_PYTHON:-python3}
requirements=$root/python/requirements-dev.txt

base_path=$(command -v "$base") || { echo "venv: no $base on PATH (set MOECAP_VENV_PYTHON)" >&2; exit 1; }
base_id=$("$base_path" -c 'import sys, sysconfig; print(sys.executable, sys.version.split()[0], sysconfig.get_paths()["include"])')
base_exe=${base_id%% *}  # the interpreter itself, not a pyenv shim
include=${base_id##* }
if [ ! -f "$include/Python.h" ]; then
  echo "venv: $base_path has no C headers ($include/Python.h); install its -dev package or set MOECAP_VENV_PYTHON" >&2
  exit 1
fi
stamp="$(sha256sum "$requirements" | cut -d' ' -f1) $base_id"
# One creator at a time (several checkouts on one machine share the venv).
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
current=$(cat "$venv/.moecap-stamp" 2>/dev/null || true)
if [ -x "$venv/bin/python" ] && [ "$current" = "$stamp" ]; then
  echo "$venv/bin/python"
  exit 0
fi
if [ -x "$venv/bin/python" ] && [ "${current#* }" = "$base_id" ]; then
  echo "venv: $requirements changed: updating $venv" >&2  # same interpreter: install what is new
else
  echo "venv: creating $venv from $base_exe (first run downloads torch and its CUDA libraries, a few GB)" >&2
  rm -rf "$venv"
  "$base_exe" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q -r "$requirements" >&2
echo "$stamp" > "$venv/.moecap-stamp"
echo "$venv/bin/python"
