"""
The command of each kind of chain stage, read from chain/commands.mk: the one table that the Makefile's
targets and the chain both take a stage's command line from.

    command("train", "configs/pretrain-2060.yaml")   # -> ["train.py", "configs/pretrain-2060.yaml"]
"""

import functools
import os
import re

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "commands.mk")
ENTRY = re.compile(r"STAGE\.([a-z][a-z0-9-]*) = (.+)")
VALUE = re.compile(r"\$\((\d)\)")


@functools.cache
def table():
    """{name: words} of chain/commands.mk, the words with their $(n) as written; a line that is neither an
    entry, a comment nor blank is an error, so the file stays what both make and this reader read alike."""
    entries = {}
    with open(TABLE, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = ENTRY.fullmatch(line)
            words = match.group(2).split() if match else []
            if not match or any("$" in w and not VALUE.fullmatch(w) for w in words):
                raise ValueError(
                    f"{TABLE}:{number}: not `STAGE.<name> = <words>` with each $(n) a word: {line}"
                )
            entries[match.group(1)] = words
    return entries


def command(name, *values):
    """The words of entry `name` with $(1), $(2), ... replaced by values (as many as it names)."""
    words = table()[name]
    wanted = max((int(VALUE.fullmatch(w).group(1)) for w in words if VALUE.fullmatch(w)), default=0)
    if len(values) != wanted:
        raise TypeError(f"STAGE.{name} takes {wanted} values, not {len(values)}")
    return [values[int(VALUE.fullmatch(w).group(1)) - 1] if VALUE.fullmatch(w) else w for w in words]
