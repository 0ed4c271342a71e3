"""Count the lines a user changes to turn each public script into a 2-process script, library by library.

    python benchmarks/conversions/count.py                 # markdown table (docs/library.md's)
    python benchmarks/conversions/count.py --json          # the same numbers as JSON
    python benchmarks/conversions/count.py --count-blank   # also count added and removed blank lines

The counts are read from the changes themselves (``convert.py``: one unified diff per script and library, kept in
the project while the originals stay in ../shared/corpus): "added" is the number of '+' lines of that diff,
"removed" the number of '-' lines; a changed line counts once in each. A blank '+' or '-' line is not counted
unless asked; comments and docstrings are counted like code. The original's own length needs the corpus; the
counts do not.
"""
import argparse
import json
import sys

from convert import CORPUS, LIBRARIES, SCRIPTS, REPO, changed_lines, patch_of


def counts(count_blank=False):
    """{script: {library: (added, removed)}}."""
    return {script: {library: changed_lines(patch_of(script, library), count_blank) for library in LIBRARIES}
            for script in SCRIPTS}


def original_lines(script):
    path = CORPUS / SCRIPTS[script].original
    return len(path.read_text().splitlines()) if path.is_file() else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument("--count-blank", action="store_true", help="count added/removed blank lines too")
    a = p.parse_args()
    found = counts(a.count_blank)
    what = "blank lines included" if a.count_blank else "blank lines not counted"
    if a.json:
        print(json.dumps({"counting": f"'+' and '-' lines of each change, {what}", "results": {
            script: {"original": SCRIPTS[script].original, "original_lines": original_lines(script), **{
                library: {"patch": str(patch_of(script, library).relative_to(REPO)), "added": added,
                          "removed": removed, "total": added + removed}
                for library, (added, removed) in row.items()}}
            for script, row in found.items()}}, indent=2))
        return 0
    print(f"Lines changed in each original (added + removed = total; {what})\n")
    print("| script (original lines) | " + " | ".join(LIBRARIES[1:] + LIBRARIES[:1]) + " |")
    print("|---|" + "---|" * len(LIBRARIES))
    for script, row in found.items():
        cells = [f"{row[library][0]} + {row[library][1]} = {sum(row[library])}"
                 for library in LIBRARIES[1:] + LIBRARIES[:1]]
        print(f"| {script} ({original_lines(script) or '?'}) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
