"""The environment a user's shell gives `make`, for tests that run make themselves.

Under `make test` pytest inherits MAKELEVEL, MAKEFLAGS and MFLAGS, and an inner `make` that sees them
believes it is a sub-make: it prints "make[1]: Entering directory" around its output and takes the outer
make's flags. A test that reads what make prints must run it as a user's shell would.
"""

import os

MAKE_STATE = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")


def users_env(base=None, drop=()):
    """`base` (default: this process's environment) without make's inherited state and without `drop`."""
    base = os.environ if base is None else base
    return {k: v for k, v in base.items() if k not in MAKE_STATE and k not in drop}
