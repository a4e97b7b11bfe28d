"""python -m chat: the command line of chat/template.py."""

import sys

from chat.template import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
