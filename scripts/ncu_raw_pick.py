"""Pick metrics out of `ncu --import R --page raw --csv` (stdin): one line per metric whose name contains
any of the given substrings, `name value` (the first profiled kernel's row), for the stall totals of
scripts/gpu_run.sh's bwdstall stage."""
import csv
import sys

rows = list(csv.reader(sys.stdin))
if len(rows) < 3:
    sys.exit("no kernel rows in the raw page")
names, values = rows[0], rows[2]  # row 1: units
for name, value in zip(names, values):
    if any(s in name for s in sys.argv[1:]):
        print(name, value.replace(",", ""))
