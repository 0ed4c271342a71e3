"""Count the lines a user changes to turn each original.py into a 2-process script.

    python count.py            # markdown table
    python count.py --json     # the same numbers as JSON
    python count.py --count-blank   # also count added/removed blank lines

For each script folder (imagenet, vae, nanogpt) and each conversion file, the
conversion is compared with the folder's original.py by difflib.unified_diff
(trailing whitespace stripped from every line first).  "added" is the number
of '+' lines, "removed" the number of '-' lines of that diff; a changed line
counts once in each.  By default a '+' or '-' line that is blank (empty after
stripping) is not counted; comments and docstrings are counted like code.

The ddpkit conversions are not in this folder: DDPKIT maps each script to a
file relative to the repository root; a missing file is skipped with a note.
"""
import argparse
import difflib
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

SCRIPTS = ["imagenet", "vae", "nanogpt"]
LIBRARIES = {  # column -> file inside the script folder
    "accelerate": "with_accelerate.py",
    "fabric": "with_fabric.py",
}
DDPKIT = {  # script -> ddpkit conversion, relative to the repo root
    "imagenet": "examples/imagenet_main.py",
    "vae": "examples/vae_main.py",
    "nanogpt": "examples/nanogpt_train.py",
}


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip() for line in f.read().splitlines()]


def diff_counts(original, converted, count_blank=False):
    added = removed = 0
    for line in difflib.unified_diff(original, converted, lineterm="", n=0):
        if line.startswith(("+++", "---", "@@")):
            continue
        if not count_blank and not line[1:].strip():
            continue
        if line.startswith("+"):
            added += 1
        elif line.startswith("-"):
            removed += 1
    return added, removed


def counts(count_blank=False):
    """{script: {library: (added, removed)}} for every conversion that exists."""
    found = {}
    for script in SCRIPTS:
        original = read_lines(os.path.join(HERE, script, "original.py"))
        found[script] = {}
        for lib in list(LIBRARIES) + ["ddpkit"]:
            path = os.path.join(REPO, DDPKIT[script]) if lib == "ddpkit" else os.path.join(HERE, script, LIBRARIES[lib])
            if os.path.exists(path):
                found[script][lib] = diff_counts(original, read_lines(path), count_blank)
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument("--count-blank", action="store_true", help="count added/removed blank lines too")
    a = p.parse_args()

    columns = list(LIBRARIES) + ["ddpkit"]
    results, notes = {}, []
    for script in SCRIPTS:
        orig_path = os.path.join(HERE, script, "original.py")
        original = read_lines(orig_path)
        row = {"original_lines": len(original)}
        for lib in columns:
            path = os.path.join(REPO, DDPKIT[script]) if lib == "ddpkit" else os.path.join(HERE, script, LIBRARIES[lib])
            if not os.path.exists(path):
                notes.append(f"{script}/{lib}: {os.path.relpath(path, REPO)} not found, skipped")
                row[lib] = None
                continue
            added, removed = diff_counts(original, read_lines(path), a.count_blank)
            row[lib] = {"file": os.path.relpath(path, REPO), "added": added, "removed": removed,
                        "total": added + removed}
        results[script] = row

    if a.json:
        print(json.dumps({"counting": "unified diff vs original.py, '+' and '-' lines, "
                                      + ("blank lines included" if a.count_blank else "blank lines not counted"),
                          "results": results, "notes": notes}, indent=2))
        return
    what = "blank lines included" if a.count_blank else "blank lines not counted"
    print(f"Lines changed versus original.py (added + removed = total; {what})\n")
    print("| script (original lines) | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for script, row in results.items():
        cells = []
        for lib in columns:
            c = row[lib]
            cells.append("n/a" if c is None else f"{c['added']} + {c['removed']} = {c['total']}")
        print(f"| {script} ({row['original_lines']}) | " + " | ".join(cells) + " |")
    for note in notes:
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
