"""The end of `make test` says why tests skipped, one line per reason with how many, so a missing tool
(sshd, Chromium, Go, llama-cpp-python) is a line to act on instead of an 's' among the dots. conftest.py
takes the hook from here; a test runs it as a plugin (-p skip_summary) on tests of its own."""

import collections

import pytest


def skip_reasons(reports):
    """(count, reason) per distinct reason of the skipped test reports, most first."""
    counted = collections.Counter()
    for report in reports:
        if isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
            counted[report.longrepr[2].removeprefix("Skipped: ")] += 1
    return [(count, reason) for reason, count in counted.most_common()]


@pytest.hookimpl(wrapper=True, tryfirst=True)  # around pytest's own summary: after its -ra list
def pytest_terminal_summary(terminalreporter):
    yield
    for count, reason in skip_reasons(terminalreporter.stats.get("skipped", [])):
        terminalreporter.write_line(f"skipped {count}: {reason}", yellow=True)
