"""python -m evaluation: the command line of evaluation/runs.py."""

import sys

from evaluation.runs import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
