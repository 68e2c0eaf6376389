"""The README's first command, as written, in a fresh virtualenv: it installs pagedlm and
its dependencies, starts the server on the embedded default model, and the server answers.

(The second command, the tests' install and run, is what CI itself runs.) The virtualenv
shares nothing with this interpreter's packages; pip reads the same configuration (local
wheels, PyPI), and the default model comes from this user's cache when an earlier test
fetched it, as on a user's second project. The C++ CPU kernels are built as on a first
start, into a folder of this test's own (PAGEDLM_KERNEL_DIR), so that the builds every
other test uses stay as they are: pip's install starts their build in the background, the
server finds them built or waits for that build, and the chat answer comes through them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from tests.conftest import requires_smollm2
from tests.helpers import wait_until_healthy
from tests.server.conftest import free_port

pytestmark = [requires_smollm2, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def first_command() -> str:
    readme = (REPO / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):]
    return re.search(r"```bash\n(.*?)\n```", quick_start, flags=re.S).group(1).strip()


def test_readme_first_command_in_a_fresh_virtualenv(tmp_path):
    command = first_command()
    install, _, serve = command.partition(" && ")
    assert shlex.split(serve) == ["pagedlm", "serve"], command
    argv = shlex.split(install)
    assert argv[:2] == ["pip", "install"] and "-e" in argv and "." in argv, command

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.pop("PAGEDLM_DISABLE_CPU_KERNELS", None)
    env.pop("PAGEDLM_PREBUILT_KERNELS", None)
    kernels = tmp_path / "kernels"
    env["PAGEDLM_KERNEL_DIR"] = str(kernels)
    started = time.monotonic()
    subprocess.run([str(bin_dir / "pip"), *argv[1:], "--quiet"], cwd=REPO, env=env,
                   check=True, timeout=1200)
    install_s = time.monotonic() - started
    # pagedlm comes from the virtualenv, not from this interpreter's site-packages.
    where = subprocess.run([str(bin_dir / "python"), "-c", "import pagedlm, torch, sys; "
                            "print(sys.prefix)"], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert Path(where) == env_dir and Path(where) != Path(sys.prefix)

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen([str(bin_dir / "pagedlm"), "serve", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, proc, 600, (tmp_path / "serve.log").read_text, 0.5)
        ready_s = time.monotonic() - started
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        served_log = (tmp_path / "serve.log").read_text()
        assert "unavailable" not in served_log, served_log
        # pip's install built them (the server waited for that build if it was still
        # running, and said so: it built nothing itself).
        install_log = (kernels / "install.log").read_text()
        assert "building llama_decode_cpu, sampler_cpu" in install_log
        assert "CPU kernels, one time" not in served_log, served_log
        if "waiting for another process building the CPU kernels" in served_log:
            assert "(started by pip install)" in served_log, served_log
        assert len(list(kernels.glob("pagedlm_*.so"))) == 2, install_log
        print(f"\nREADME first command in a fresh venv: install {install_s:.0f} s, "
              f"server ready {ready_s:.0f} s later")
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
