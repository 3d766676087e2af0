# SPDX-License-Identifier: Apache-2.0
"""`pip install <repo>` into a fresh venv, then `import moecap` and the
quick-start example from another directory with no environment variables.

Run by the ctest `python_wheel`, which names a build directory that survives
between runs (MOECAP_WHEEL_BUILD_DIR), so the wheel build is incremental. The
wheel is built without build isolation, from this venv's scikit-build-core
and nanobind (no network), and without the CUDA kernels (nvcc takes minutes;
the rest of the suite covers them)."""
import os
import pathlib
import site
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_DIR = os.environ.get("MOECAP_WHEEL_BUILD_DIR")

pytestmark = pytest.mark.skipif(not BUILD_DIR, reason="run by the ctest python_wheel (MOECAP_WHEEL_BUILD_DIR)")


def run(*args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_pip_install_then_import_anywhere(tmp_path):
    wheels = tmp_path / "wheels"
    # The long option: pip below 23.1 (Debian 12's python3-venv) has no -C. The build's own -j: Ninja's default
    # would take every core beside ctest's other jobs.
    run(sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q",
        "-w", str(wheels), f"--config-settings=build-dir={BUILD_DIR}",
        "--config-settings=cmake.define.MOECAP_CUDA=OFF", str(ROOT),
        env=dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("MOECAP_JOBS", "2")))
    (wheel,) = wheels.glob("moecap-*.whl")

    fresh = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(fresh))
    python = fresh / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps", "-q", str(wheel))

    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH, no MOECAP_*
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run(str(python), "-c", "import importlib.metadata as m, moecap; "
              "print(moecap.__file__, moecap.__version__, m.version('moecap'), moecap.abi_version())",
              cwd=elsewhere, env=clean_env)
    assert out.startswith(str(fresh)), out  # the installed package, not the source tree
    _, version, installed_version, _ = out.split(" ", 3)
    assert version == installed_version, out  # __version__ is what pip installed

    # The extension loads the libmoecap.so.1 beside it even where LD_LIBRARY_PATH names another one (an
    # engine with the C library installed): DT_RPATH, which the loader reads before LD_LIBRARY_PATH; a
    # DT_RUNPATH comes after it. The decoy has the SONAME and no symbols, so loading it fails the import.
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    run("cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(decoy / "libmoecap.so.1"), "-Wl,-soname,libmoecap.so.1",
        input="int moecap_decoy;\n")
    out = run(str(python), "-c", "import moecap; print([l.split()[-1] for l in open('/proc/self/maps') "
              "if 'libmoecap' in l][0])", cwd=elsewhere, env=dict(clean_env, LD_LIBRARY_PATH=str(decoy)))
    assert out.strip().startswith(str(fresh)), out

    # The quick start needs NumPy and PyTorch: lend them from this venv by a .pth file, not an env var.
    (fresh_site,) = (fresh / "lib").glob("python3*/site-packages")
    (fresh_site / "lend_numpy_torch.pth").write_text(site.getsitepackages()[0] + "\n")
    out = run(str(python), str(ROOT / "examples" / "python" / "quickstart.py"), cwd=elsewhere, env=clean_env)
    assert "refused as it should be: OUT_OF_RANGE" in out

    # The package's own library older than its extension (files of two installs mixed): the import says so.
    (own,) = (fresh_site / "moecap").glob("libmoecap.so.1")
    own.write_bytes((decoy / "libmoecap.so.1").read_bytes())
    failed = subprocess.run([str(python), "-c", "import moecap"], capture_output=True, text=True, cwd=elsewhere,
                            env=clean_env)
    assert failed.returncode != 0
    assert "the libmoecap.so.1 moecap's extension found beside it (or on its RPATH) is older than the extension" \
        in failed.stderr, failed.stderr
