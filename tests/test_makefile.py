"""The Makefile: every target it declares is one a user can run (a dry run names its commands)."""

import re
import subprocess

import pytest
from conftest import ROOT


def phony_targets():
    with open(f"{ROOT}/Makefile", encoding="utf-8") as f:
        text = f.read()
    declared = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", text, re.MULTILINE).group(1)
    return declared.replace("\\", " ").split()


@pytest.mark.parametrize("target", phony_targets())
def test_every_declared_make_target_has_commands(target):
    # -B: as if nothing were built yet (an up-to-date `setup` has nothing to do, yet has commands).
    dry = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "Nothing to be done" not in dry.stdout + dry.stderr, f"make {target} has no recipe"
    assert dry.stdout.strip(), f"make {target} runs nothing"
