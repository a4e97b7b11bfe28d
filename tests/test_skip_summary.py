"""The end of a test run names why tests skipped, one line per reason with its count (tests/skip_summary.py,
the hook conftest.py installs), so a missing tool is named with what would enable it."""

import os
import subprocess
import sys

from conftest import ROOT

SKIPPING_TESTS = """
import pytest

no_sshd = pytest.mark.skipif(True, reason="sshd is not installed (apt install openssh-server)")

@no_sshd
def test_a():
    pass

@no_sshd
def test_b():
    pass

def test_c():
    pytest.skip("Go is not installed (apt install golang-go)")

def test_d():
    pytest.importorskip("a_module_nobody_has", reason="a_module_nobody_has is not installed (make it)")

def test_e():
    pass
"""


def test_each_skip_reason_is_one_line_with_its_count_at_the_end_of_the_run(tmp_path):
    (tmp_path / "test_skipping.py").write_text(SKIPPING_TESTS, encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "skip_summary",
            "-p",
            "no:cacheprovider",
            "test_skipping.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-4:-1] == [
        "skipped 2: sshd is not installed (apt install openssh-server)",
        "skipped 1: Go is not installed (apt install golang-go)",
        "skipped 1: a_module_nobody_has is not installed (make it)",
    ], done.stdout
    assert "1 passed, 4 skipped" in lines[-1]


def test_a_run_without_skips_adds_no_line(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_a():\n    pass\n", encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "skip_summary",
            "-p",
            "no:cacheprovider",
            "test_plain.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "skipped" not in done.stdout, done.stdout
