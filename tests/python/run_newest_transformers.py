# SPDX-License-Identifier: Apache-2.0
"""Runs test_hf_models.py under the newest transformers: the folder
scripts/venv.sh installs python/requirements-transformers-newest.txt into
(<venv>/newest-transformers), first on the path. Exit 77 (skipped) where the
interpreter has no such folder (MOECAP_PYTHON of one's own)."""
import os
import pathlib
import re
import subprocess
import sys

here = pathlib.Path(__file__).resolve().parent
newest = pathlib.Path(sys.prefix) / "newest-transformers"
if not newest.is_dir():
    if (pathlib.Path(sys.prefix) / ".moecap-stamp").exists():  # a venv scripts/venv.sh made: it should be there
        sys.exit(f"{newest} is missing from a venv scripts/venv.sh made: rerun scripts/venv.sh")
    print(f"{newest} is missing (made by scripts/venv.sh): moecap.hf not tested against the newest transformers")
    sys.exit(77)
pins = (here.parents[1] / "python" / "requirements-transformers-newest.txt").read_text()
pinned = re.search(r"^transformers==(\S+)", pins, re.M).group(1)
env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(newest), os.environ.get("PYTHONPATH")) if p))
found = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"], env=env,
                       capture_output=True, text=True, check=True).stdout.strip()
if found != pinned:
    sys.exit(f"{newest} holds transformers {found}, not the pinned {pinned}: rerun scripts/venv.sh")
print(f"moecap.hf against transformers {found}")
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(here / "test_hf_models.py")], env=env))
