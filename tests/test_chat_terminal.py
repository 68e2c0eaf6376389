"""`pagedlm chat` in a real terminal (a pty, driven by pexpect), as a user meets it: the
banner states the sampling settings, replies stream after the prompt, /clear forgets,
Ctrl-D quits cleanly."""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import requires_smollm2

pexpect = pytest.importorskip("pexpect")
pytestmark = [requires_smollm2, pytest.mark.slow]


def test_chat_in_a_terminal():
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TERM="dumb")
    child = pexpect.spawn(sys.executable, ["-m", "pagedlm.entrypoints.cli", "chat",
                                           "--max-tokens", "40"],
                          env=env, encoding="utf-8", timeout=300)
    try:
        child.expect("sampling: greedy, at most 40 tokens")
        child.expect(">>> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect(">>> ")
        child.sendline("/clear")
        child.expect(r"\(conversation cleared\)")
        child.expect(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
