"""Reading a JSON file a user named on a command line, with the reason in words when it fails."""
from __future__ import annotations

import json


def load(path) -> tuple:
    """(the parsed document, "") or (None, why not): unreadable (missing, a directory, no permission)
    or not JSON. The CLIs print the reason instead of a traceback."""
    try:
        with open(path) as f:
            return json.load(f), ""
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{path} is not JSON ({e})"
