"""python -m agent: the command line of agent/tools.py."""

import sys

from agent.tools import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
