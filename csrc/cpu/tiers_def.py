"""Reads the tier rows of tiers.def (beside this file) for the Python side of the build: setup.py
compiles csrc/cpu/tier.cpp once per row with the row's macros and flags, and the tests compile
rows for other architectures."""
import os
import re

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiers.def")
FIELDS = ("name", "arch", "header", "ops", "dtypes", "emulated", "flags")
_ROW = re.compile(r'^FLASHSDPA_TIER\((\w+), (\w+), ([\w.]+), (\w+), (\w+), ([01]), [^"]*"([^"]*)"\)$',
                  re.M)


def rows():
    """The rows in table order, as dicts of FIELDS (flags as a list)."""
    with open(PATH) as f:
        text = f.read()
    found = [dict(zip(FIELDS, m)) for m in _ROW.findall(text)]
    if not found or found[0]["name"] != "portable" or \
            len(found) != len(re.findall(r"^FLASHSDPA_TIER\(", text, re.M)):
        raise RuntimeError(f"could not read the tier rows of {PATH}: one row per line, as documented")
    for r in found:
        r["flags"] = r["flags"].split()
        r["emulated"] = r["emulated"] == "1"
    return found


def requested():
    """The tier names FLASHSDPA_TIERS gives ("portable,avx2"; setup.py, `make sanitize`): the
    rows a build holds besides portable. Empty: every row."""
    return set(os.environ.get("FLASHSDPA_TIERS", "").replace(",", " ").split())


def asked(row, only):
    """Whether a build restricted to `only` (requested()) holds this row: portable always (every
    call can fall to it)."""
    return not only or row["name"] in only or row["name"] == "portable"


def macros(row):
    """The -D flags that make csrc/cpu/tier.cpp this row's tier."""
    return [f"-DFLASHSDPA_TIER={row['name']}", f"-DFLASHSDPA_TIER_HEADER={row['header']}",
            f"-DFLASHSDPA_TIER_OPS={row['ops']}"]
