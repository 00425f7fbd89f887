"""cuflash's version: the one place it is written (pyproject.toml reads it from here, statically)."""
from __future__ import annotations

__version__ = "0.1.0"


def version_string() -> str:
    """What every CLI's --version prints, like pip's: the version, where the package was imported
    from (a wheel's site-packages or a checkout) and the Python running it."""
    import pathlib
    import sys

    where = pathlib.Path(__file__).resolve().parent
    return f"cuflash {__version__} from {where} (python {sys.version_info.major}.{sys.version_info.minor})"


def add_version_argument(parser) -> None:
    """--version on an argparse parser, printed on one line: argparse's own action="version"
    wraps it to the terminal's width, splitting the path."""
    import argparse

    class _Version(argparse.Action):
        def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
            super().__init__(option_strings, dest=dest, default=default, nargs=0,
                             help=help or "print cuflash's version and where it was imported from, and exit")

        def __call__(self, parser, namespace, values, option_string=None):
            import sys

            print(version_string(), file=sys.stdout, flush=True)
            parser.exit(0)

    parser.add_argument("--version", action=_Version)
