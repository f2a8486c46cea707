"""``python -m maskln_cli``: the same command line as ``maskln``."""

from maskln_cli.cli.app import main

if __name__ == "__main__":
    main()
