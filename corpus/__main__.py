"""python -m corpus: the command line of corpus/pipeline.py."""

import sys

from corpus.pipeline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
