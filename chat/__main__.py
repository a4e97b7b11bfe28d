"""python -m chat: the preparation command of chat/prepare.py."""

import sys

from chat.prepare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
