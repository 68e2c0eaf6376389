"""A CPU kernel as it was at another git revision, built as its own extension module, for the
benchmarks that time the current kernel against it side by side in one process."""

import subprocess
from pathlib import Path

from pagedlm.csrc import CFLAGS, LDFLAGS

REPO = Path(__file__).resolve().parents[2]


def build_revision(rev: str, sources: list[str], workdir: Path):
    """Compile ``sources[0]`` (paths in the repository; the rest are headers it includes) as
    they were at git revision ``rev``."""
    from torch.utils.cpp_extension import load

    for path in sources:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"],
                              check=True, capture_output=True, text=True).stdout
        (workdir / Path(path).name).write_text(text)
    main = Path(sources[0])
    name = f"pagedlm_{main.stem}_rev_" + "".join(c for c in rev if c.isalnum())
    return load(name=name, sources=[str(workdir / main.name)], extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS, build_directory=str(workdir), verbose=False)
