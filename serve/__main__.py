"""python -m serve: the command line of serve/app.py."""

import sys

from serve.app import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
