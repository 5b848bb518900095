"""Command line: `python -m workbench demo` runs the demo (the README's main command);
`python -m workbench run config.yaml [field=value ...]` runs a config headless (workbench.run);
`python -m workbench app [--run DIR]` serves the widgets as a panel app on 127.0.0.1."""

import sys

from workbench import demo


def app(argv: list[str]) -> None:
    from widgets.app import main  # panel and the widgets load only for this command

    main(argv)


def run(argv: list[str]) -> None:
    from workbench.run.runner import main  # the run stack loads only for this command

    main(argv)


COMMANDS = {"demo": demo.main, "run": run, "app": app}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m workbench {{{','.join(COMMANDS)}}} [options]")
        sys.exit(2)
    COMMANDS[sys.argv[1]](sys.argv[2:])
