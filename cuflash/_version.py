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
