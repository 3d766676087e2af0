#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python environment moecap builds its extension with and runs its Python
# tests in: a venv outside the repository, so it survives between runs and
# checkouts, at ${MOECAP_VENV:-$HOME/.cache/moecap/venv}, with
# python/requirements-dev.txt from PyPI (torch, NumPy 2, JAX, ...; every package,
# transitive ones too, held at python/constraints.txt's exact versions), then the
# engines whose own capture code the adapters are tested against (SGLang,
# vLLM): python/requirements-engines-deps.txt (exact pins of what their
# capture paths import) and python/requirements-engines.txt (the engines),
# both with --no-deps, so they never move torch, NumPy, transformers, JAX or
# megatron-core (checked after the install); and python/requirements-transformers-newest.txt
# into a folder of its own, <venv>/newest-transformers.
# Reused while the requirements and the base interpreter are what it was made
# from (a stamp file); rebuilt from scratch when either changed, so a package
# dropped from the pins goes too (pip's cache keeps the downloads). Prints the venv's
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
engine_deps=$root/python/requirements-engines-deps.txt
engines=$root/python/requirements-engines.txt
newest_transformers=$root/python/requirements-transformers-newest.txt
constraints=$root/python/constraints.txt  # the whole venv at exact versions, transitive packages too

base_path=$(command -v "$base") || { echo "venv: no $base on PATH (set MOECAP_VENV_PYTHON)" >&2; exit 1; }
# One field per line: the interpreter's path or its headers' may hold spaces.
mapfile -t base_fields < <("$base_path" -c 'import sys, sysconfig
print(sys.executable); print(sys.version.split()[0]); print(sysconfig.get_paths()["include"])')
if [ "${#base_fields[@]}" -ne 3 ]; then
  echo "venv: $base_path did not report its executable, version and include directory" >&2
  exit 1
fi
base_exe=${base_fields[0]}  # the interpreter itself, not a pyenv shim
include=${base_fields[2]}
base_id="${base_fields[*]}"
if [ ! -f "$include/Python.h" ]; then
  echo "venv: $base_path has no C headers ($include/Python.h); install its -dev package or set MOECAP_VENV_PYTHON" >&2
  exit 1
fi
stamp="$(cat "$requirements" "$engine_deps" "$engines" "$newest_transformers" "$constraints" | sha256sum | cut -d' ' -f1) $base_id"
# One creator at a time (several checkouts on one machine share the venv).
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
# The newest transformers, in a folder of its own that only the test of moecap.hf
# against it puts on its path.
install_newest_transformers() {
  rm -rf "$venv/newest-transformers"
  "$venv/bin/python" -m pip install -q --no-deps --target "$venv/newest-transformers" -r "$newest_transformers" >&2
}
current=$(cat "$venv/.moecap-stamp" 2>/dev/null || true)
if [ -x "$venv/bin/python" ] && [ "$current" = "$stamp" ]; then
  newest_pin=$(sed -n 's/^transformers==\([^ ]*\).*/\1/p' "$newest_transformers")
  if [ ! -d "$venv/newest-transformers/transformers-$newest_pin.dist-info" ]; then
    echo "venv: $venv/newest-transformers lacks transformers $newest_pin: installing it again" >&2
    install_newest_transformers
  fi
  echo "$venv/bin/python"
  exit 0
fi
if [ -x "$venv/bin/python" ]; then
  echo "venv: the pins in python/ or the interpreter changed since $venv was made: rebuilding it" >&2
else
  echo "venv: creating $venv from $base_exe (first run downloads torch and its CUDA libraries, a few GB)" >&2
fi
rm -rf "$venv"
"$base_exe" -m venv "$venv"
"$venv/bin/python" -m pip install -q -r "$requirements" -c "$constraints" >&2
# The engines declare CUDA-only dependencies (and pins of torch that differ
# by a patch release): none of them is installed, only what the capture
# paths import, pinned, without resolving.
"$venv/bin/python" -m pip install -q --no-deps -r "$engine_deps" >&2
"$venv/bin/python" -m pip install -q --no-deps -r "$engines" >&2
install_newest_transformers
# The pins the other tests rely on must have survived.
"$venv/bin/python" - "$requirements" >&2 <<'PY'
import re, sys
from importlib.metadata import version
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", open(sys.argv[1]).read(), re.M))
moved = [f"{name} {version(name)} (pinned {pins[name]})" for name in
         ("torch", "numpy", "transformers", "jax", "megatron-core") if version(name) != pins[name]]
if moved:
    sys.exit("venv: the engines' install moved " + ", ".join(moved))
PY
echo "$stamp" > "$venv/.moecap-stamp"
echo "$venv/bin/python"
