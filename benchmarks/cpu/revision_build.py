"""A CPU kernel as it was at another git revision, built as its own extension module, for the
benchmarks that time the current kernel against it side by side in one process."""

import subprocess
from pathlib import Path

from pagedlm.csrc import CFLAGS, LDFLAGS
from pagedlm.csrc.build import BUNDLED, LIBRARY_SOURCES

REPO = Path(__file__).resolve().parents[2]
CSRC = "pagedlm/csrc"


def build_revision(rev: str, sources: list[str], workdir: Path):
    """Compile ``sources[0]`` (paths in the repository; the rest are headers it includes) as
    they were at git revision ``rev``. A kernel bundled into the decoder's library
    (csrc/build.py BUNDLED) is built as that whole library, as the revision had it."""
    from torch.utils.cpp_extension import load

    main = Path(sources[0])
    tag = "".join(c for c in rev if c.isalnum())
    if main.stem in BUNDLED:
        return build_library(BUNDLED[main.stem], workdir, f"pagedlm_{BUNDLED[main.stem]}_rev_{tag}", rev)
    for path in sources:
        (workdir / Path(path).name).write_text(_show(rev, path))
    return load(name=f"pagedlm_{main.stem}_rev_{tag}", sources=[str(workdir / main.name)],
                extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, build_directory=str(workdir), verbose=False)


def build_library(library: str, workdir: Path, name: str, rev: str | None = None):
    """The kernel library `library` (with its other translation units, csrc/build.py
    LIBRARY_SOURCES) under the module name `name`: from every source and header of
    pagedlm/csrc at git revision `rev`, or of the working tree when `rev` is None."""
    from torch.utils.cpp_extension import load

    if rev is None:
        files = {p.name: p.read_text() for p in (REPO / CSRC).iterdir() if p.suffix in (".cpp", ".h")}
    else:
        names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{CSRC}"],
                               check=True, capture_output=True, text=True).stdout.split()
        files = {n: _show(rev, f"{CSRC}/{n}") for n in names if n.endswith((".cpp", ".h"))}
    for file_name, text in files.items():
        (workdir / file_name).write_text(text)
    units = LIBRARY_SOURCES.get(library, [library])
    return load(name=name, sources=[str(workdir / f"{u}.cpp") for u in units if f"{u}.cpp" in files],
                extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, build_directory=str(workdir), verbose=False)


def _show(rev: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"],
                          check=True, capture_output=True, text=True).stdout
