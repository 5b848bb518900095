"""Command line: `python -m workbench demo` runs the demo (the README's main command);
`python -m workbench run config.yaml [field=value ...]` runs a config headless (workbench.run);
`python -m workbench app [--run DIR]` serves the widgets as a panel app on 127.0.0.1;
`python -m workbench import-model <file.gguf|smollm2> [--out DIR]` imports a GGUF model as a
Hugging Face directory (workbench.models.import_gguf) and prints its path."""

import sys

from workbench import demo


def app(argv: list[str]) -> None:
    from widgets.app import main  # panel and the widgets load only for this command

    main(argv)


def run(argv: list[str]) -> None:
    from workbench.run.runner import main  # the run stack loads only for this command

    main(argv)


def import_model(argv: list[str]) -> None:
    """Dequantize a GGUF model into a Hugging Face directory (cached) and print its path."""
    import argparse

    from workbench.models.gguf_import import PACKAGES, GGUFImportError, import_gguf

    parser = argparse.ArgumentParser(prog="python -m workbench import-model", description=import_model.__doc__)
    parser.add_argument("source", help=f"a .gguf file, or one of {sorted(PACKAGES)} (an installed package's model)")
    parser.add_argument("--out", help="the directory to write (default: a cache directory named after the file)")
    parser.add_argument("--cache-dir", help="where imports are cached (default ~/.cache/hybridflow-workbench/models)")
    args = parser.parse_args(argv)
    try:
        print(import_gguf(args.source, cache_dir=args.cache_dir, out=args.out))
    except GGUFImportError as error:
        print(f"import-model: {error}", file=sys.stderr)
        sys.exit(1)


COMMANDS = {"demo": demo.main, "run": run, "app": app, "import-model": import_model}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m workbench {{{','.join(COMMANDS)}}} [options]")
        sys.exit(2)
    COMMANDS[sys.argv[1]](sys.argv[2:])
