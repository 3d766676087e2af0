# SPDX-License-Identifier: Apache-2.0
"""The version is written once, in abi/moecap.h; everything else derives it.

Applies pyproject.toml's metadata provider (scikit-build-core's regex
provider: the regex over the input file, the groups formatted by `result`)
to the header and checks that the wheel's version equals CMake's project
version, moecap.pc's and the CMake package's, and that pyproject.toml writes
no version of its own.

Usage: check_version.py <source dir> <build dir> <CMake's PROJECT_VERSION>
"""
import pathlib
import re
import sys
import tomllib

source, build, project_version = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
pyproject = tomllib.loads((source / "pyproject.toml").read_text())
if "version" in pyproject["project"] or "version" not in pyproject["project"].get("dynamic", []):
    sys.exit("pyproject.toml writes a version of its own; it must be dynamic, read from abi/moecap.h")
provider = pyproject["tool"]["scikit-build"]["metadata"]["version"]
header = (source / provider["input"]).read_text()
match = re.search(provider["regex"], header, re.MULTILINE)
if match is None:
    sys.exit(f"pyproject.toml's version regex finds nothing in {provider['input']}")
wheel_version = provider["result"].format(*match.groups(), **match.groupdict())

pc = re.search(r"^Version: (.*)$", (build / "moecap.pc").read_text(), re.MULTILINE).group(1)
package = re.search(r'set\(PACKAGE_VERSION "([^"]*)"\)', (build / "moecapConfigVersion.cmake").read_text()).group(1)
found = {"wheel (pyproject.toml)": wheel_version, "CMake project": project_version, "moecap.pc": pc,
         "moecapConfigVersion.cmake": package}
if len(set(found.values())) != 1:
    sys.exit(f"the versions differ: {found}")
major, minor = (int(part) for part in wheel_version.split(".")[:2])
abi = {name: int(value) for name, value in
       re.findall(r"^#define MOECAP_ABI_VERSION_(MAJOR|MINOR) (\d+)", header, re.MULTILINE)}
if (major, minor) != (abi["MAJOR"], abi["MINOR"]):
    sys.exit(f"version {wheel_version} is not ABI {abi['MAJOR']}.{abi['MINOR']}")
print(f"version: {wheel_version} everywhere ({', '.join(found)})")
