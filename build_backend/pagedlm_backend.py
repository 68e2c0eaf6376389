"""pagedlm's build backend: flit_core's, which packages the Python, plus one thing: when
pip asks for the package's metadata (before it fetches the dependencies) it starts the C++
CPU kernels' build in the background (pagedlm/csrc/build.py --install, the standard
library and the compiler only). The kernels then compile while pip is still resolving,
fetching and unpacking torch, and the first `pagedlm serve` finds them built, or waits for
the build and says so. Its log: the kernel folder's install.log.

No build is started when PAGEDLM_DISABLE_CPU_KERNELS or PAGEDLM_NO_INSTALL_BUILD is set,
or when no C++ compiler is on the PATH (the first start then says that the kernels are
unavailable, and why).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from flit_core import buildapi

BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "pagedlm" / "csrc" / "build.py"

get_requires_for_build_wheel = buildapi.get_requires_for_build_wheel
get_requires_for_build_editable = buildapi.get_requires_for_build_editable
get_requires_for_build_sdist = buildapi.get_requires_for_build_sdist
build_sdist = buildapi.build_sdist


def _start_kernel_build() -> None:
    if (os.environ.get("PAGEDLM_DISABLE_CPU_KERNELS") or os.environ.get("PAGEDLM_NO_INSTALL_BUILD")
            or shutil.which(os.environ.get("CXX") or "c++") is None or not BUILD_SCRIPT.is_file()):
        return
    # Its own session, no inherited pipe (pip reads this hook's output to its end) and
    # -I: pip's isolated build path is gone by the time the build ends, and the script
    # needs only the standard library.
    subprocess.Popen([sys.executable, "-I", str(BUILD_SCRIPT), "--install"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _start_kernel_build()
    return buildapi.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _start_kernel_build()
    return buildapi.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _start_kernel_build()  # a no-op when the metadata hook's build holds the lock or is done
    return buildapi.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _start_kernel_build()
    return buildapi.build_editable(wheel_directory, config_settings, metadata_directory)
