"""The shipped tuned tables (tuning/*.json) are keyed by the kernel sources they were tuned with:
an entry whose source fingerprint differs from today's sources is ignored (with a warning) on
every first call. Editing a header that a tuned family includes retires its entries; this test
says so at commit time instead of on the GPU."""
import json
import pathlib

import pytest

from cuflash import _compile, families

TABLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "tuning").glob("*.json"))


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_shipped_entries_match_the_kernel_sources(path):
    entries = json.loads(path.read_text())["entries"]
    stale = sorted({(e["kernel"], e["source"]) for e in entries
                    if e["source"] != _compile.kernel_fingerprint(families.get(e["kernel"]))})
    assert not stale, (f"{path.name}: entries tuned for other sources of {stale} (today: "
                       f"{ {k: _compile.kernel_fingerprint(families.get(k)) for k, _ in stale} }); "
                       "re-tune (scripts/gpu_run.sh tune) or undo the edit to that family's headers")
