"""Every name an old README gave a user, and where it lives now: in README.md, or one link away from it.

    python benchmarks/readme_names.py 089111c          # the README of a git revision (git show REV:README.md)
    python benchmarks/readme_names.py old-README.md    # or a file

Names: every --flag, `ddpkit <command>`, ddpkit.X and job.X, environment variable, install extra ([ray]),
inline code span without spaces (files, metric keys, data sets), and heading. A heading is found where each of
its words of three letters or more is (their first six letters). One line per name: README, the docs page that
holds it (a page README.md links to directly, a subject's own page before the general ones; anchors ignored),
or MISSING. Exit status 1 when a name is MISSING.
"""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GENERAL = ("index.md", "benchmarks.md", "api.md", "architecture.md")  # pages that mention every subject


def old_readme(source):
    if Path(source).is_file():
        return Path(source).read_text()
    return subprocess.run(["git", "show", f"{source}:README.md"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout


def names(text):
    """(kind, name) pairs, in order of first appearance, each once."""
    code = "\n".join(re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S))
    found = [("flag", m) for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)]
    found += [("command", "ddpkit " + " ".join(m).strip())
              for m in re.findall(r"(?<![\w/.-])ddpkit ((?:checkpoint|data)(?= ))? ?([a-z][a-z-]*)", code)]
    found += [("python", m) for m in re.findall(r"\b(?:ddpkit|job)\.[A-Za-z_]\w*", code)]
    found += [("variable", m) for m in re.findall(r"\b[A-Z][A-Z0-9]+(?:_[A-Z0-9]+)+\b", text)]
    found += [("extra", m) for m in re.findall(r"\[[a-z]+\]", code)]
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        span = " ".join(span.split())
        parts = span.split(", ") if re.fullmatch(r"[\w, …]+", span) else [span]  # a list of metric keys
        found += [("code", part) for part in parts if " " not in part and not part.startswith("-")
                  and len(part) > 2 and part != "…"]
    found += [("heading", m) for m in re.findall(r"^#{2,4} (.+)$", text, flags=re.M)]
    seen = set()
    return [(kind, name) for kind, name in found if not (name in seen or seen.add(name))]


def linked_pages(readme):
    """The docs pages README.md links to directly, in order."""
    pages = []
    inline = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", readme)
    for target in inline + re.findall(r"^\[[^\]]+\]: (\S+\.md)(?:#\S*)?$", readme, flags=re.M):
        path = (REPO / target).resolve()
        if path.is_file() and path.parent == REPO / "docs" and path not in pages:
            pages.append(path)
    return pages


def holds(page_text, kind, name):
    if kind != "heading":
        return name in page_text
    words = [w[:6] for w in re.findall(r"[a-z]+", name.lower()) if len(w) >= 3]  # "Benchmarking": "benchm"
    return all(w in page_text.lower() for w in words)


def main(source):
    readme = (REPO / "README.md").read_text()
    linked = sorted(linked_pages(readme), key=lambda p: p.name in GENERAL)  # a subject's own page first
    pages = [("README", readme)] + [(f"docs/{p.name}", p.read_text()) for p in linked]
    found = names(old_readme(source))
    missing = 0
    for kind, name in found:
        where = next((label for label, text in pages if holds(text, kind, name)), "MISSING")
        missing += where == "MISSING"
        print(f"{kind:8} {name} -> {where}")
    print(f"{len(found)} names, {missing} missing", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
