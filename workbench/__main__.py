"""Command line: `python -m workbench demo` runs the demo (the README's main command)."""

import sys

from workbench import demo

COMMANDS = {"demo": demo.main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m workbench {{{','.join(COMMANDS)}}} [options]")
        sys.exit(2)
    COMMANDS[sys.argv[1]](sys.argv[2:])
