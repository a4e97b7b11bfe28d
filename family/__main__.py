"""python -m family: the command line of family/memories.py."""

import sys

from family.memories import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
