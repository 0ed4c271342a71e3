"""Public scripts converted to 2-process training, each conversion kept as its change to the original.

    python benchmarks/conversions/convert.py imagenet ddpkit OUT       # writes OUT/main.py: the original, changed
    python benchmarks/conversions/convert.py nanogpt fabric OUT        # OUT/train.py, beside model.py and configurator.py
    python benchmarks/conversions/convert.py --check                   # every change applies to its original
    python benchmarks/conversions/convert.py vae accelerate --make EDITED.py   # the change again, from an edited copy

The originals are other people's code and stay outside the project, byte for byte, in the corpus beside it
(``../shared/corpus``, or ``--corpus DIR``): pytorch/examples' ImageNet trainer and VAE, and nanoGPT's ``train.py``.
The project keeps only each change: a unified diff without context lines (``@@ -12,3 +12,2 @@``, then the lines
removed and the lines added), whose header names the original and its SHA-256. ddpkit's changes are
``examples/<name>.patch``; Accelerate's and Lightning Fabric's are ``benchmarks/conversions/<script>/<library>.patch``.

Writing a conversion out checks the original's SHA-256 first, then applies the change with GNU patch (``patch``, no
fuzz): an original that changed upstream is refused in one line that says which file and what to do, never patched
at a guess. A script's companions (nanoGPT's ``model.py`` and ``configurator.py``, which it imports and reads from
the folder it runs in) are copied beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CORPUS = REPO.parent / "shared" / "corpus"
LIBRARIES = ("ddpkit", "accelerate", "fabric")


@dataclasses.dataclass(frozen=True)
class Script:
    original: str  # below the corpus
    source: str  # where it comes from, for the patch's header
    example: str  # ddpkit's change: examples/<example>.patch
    companions: tuple[str, ...] = ()  # files of the original's folder that it needs beside it

    @property
    def name(self) -> str:
        return Path(self.original).name


SCRIPTS = {
    "imagenet": Script("pytorch-examples/imagenet/main.py", "pytorch/examples at 77f55b912142e11fcfdf5b530231fb9c52f181e8",
                       "imagenet_main"),
    "vae": Script("pytorch-examples/vae/main.py", "pytorch/examples at 77f55b912142e11fcfdf5b530231fb9c52f181e8",
                  "vae_main"),
    "nanogpt": Script("nanogpt/train.py", "karpathy/nanoGPT at 3adf61e154c3fe3fca428ad6bc3818b27a3b8291",
                      "nanogpt_train", companions=("model.py", "configurator.py")),
}


class ConversionError(Exception):
    """A change that cannot be applied: its original is missing or not the file it was written for."""


def patch_of(script: str, library: str) -> Path:
    """Where the change that converts ``script`` to ``library`` is kept."""
    if script not in SCRIPTS:
        raise ConversionError(f"no public script {script!r}: one of {', '.join(SCRIPTS)}")
    if library not in LIBRARIES:
        raise ConversionError(f"no library {library!r}: one of {', '.join(LIBRARIES)}")
    if library == "ddpkit":
        return REPO / "examples" / f"{SCRIPTS[script].example}.patch"
    return HERE / script / f"{library}.patch"


def header(patch: Path) -> dict[str, str]:
    """The ``# key: value`` lines above the diff."""
    fields = {}
    for line in patch.read_text().splitlines():
        if line.startswith("--- "):
            break
        key, colon, value = line.lstrip("# ").partition(":")
        if colon:
            fields[key.strip()] = value.strip()
    return fields


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def original_of(script: str, library: str, corpus: Path = CORPUS) -> Path:
    """The original, checked to be the file that ``library``'s change was written for."""
    path = corpus / SCRIPTS[script].original
    if not path.is_file():
        raise ConversionError(f"{path} is not there: the originals live in the corpus beside the project "
                              f"(../shared/corpus), or give --corpus DIR")
    wanted = header(patch_of(script, library)).get("sha256", "")
    if sha256(path) != wanted:
        raise ConversionError(f"{path} is not the file that {library}'s change was written for "
                              f"({SCRIPTS[script].source}, sha256 {wanted[:12]}...): fetch that version, or write the "
                              f"change again against this one (convert.py {script} {library} --make EDITED.py)")
    return path


def write(script: str, library: str, out: Path, corpus: Path = CORPUS) -> Path:
    """``script`` converted to ``library``, written into the folder ``out`` under the original's name, its companions
    beside it; the path of the converted script."""
    original, patch = original_of(script, library, corpus), patch_of(script, library)
    if shutil.which("patch") is None:
        raise ConversionError("GNU patch is needed to apply a change (Debian: apt-get install patch)")
    out.mkdir(parents=True, exist_ok=True)
    target = out / SCRIPTS[script].name
    done = subprocess.run(["patch", "--batch", "--silent", "--fuzz=0", "--reject-file=-", "--output", str(target),
                           str(original), str(patch)], capture_output=True, text=True)
    if done.returncode != 0:
        target.unlink(missing_ok=True)
        said = (done.stdout + done.stderr).strip().splitlines()
        raise ConversionError(f"{patch.name} does not apply to {original}: {said[-1] if said else 'patch failed'}")
    for name in SCRIPTS[script].companions:
        shutil.copyfile(original.parent / name, out / name)
    return target


def make(script: str, library: str, edited: Path, corpus: Path = CORPUS) -> Path:
    """Write ``library``'s change to ``script`` again, from ``edited`` (a converted copy changed by hand)."""
    spec, original = SCRIPTS[script], corpus / SCRIPTS[script].original
    before = original.read_text().splitlines(keepends=True)
    after = edited.read_text().splitlines(keepends=True)
    diff = difflib.unified_diff(before, after, spec.name, spec.name, n=0)
    who = {"ddpkit": "ddpkit", "accelerate": "Hugging Face Accelerate", "fabric": "Lightning Fabric"}[library]
    patch = patch_of(script, library)
    patch.write_text(
        f"# {who}'s change to {Path(spec.original).parent.name}/{spec.name}, as a user makes it to train on 2 "
        "or more processes\n"
        f"# original: {spec.original} below ../shared/corpus, from {spec.source}\n"
        f"# sha256: {sha256(original)}\n"
        f"# written out by: python benchmarks/conversions/convert.py {script} {library} OUT\n"
        + "".join(diff))
    return patch


def changed_lines(patch: Path, count_blank: bool = False) -> tuple[int, int]:
    """The lines that ``patch`` adds and removes (a changed line counts once in each); blank ones only if asked."""
    added = removed = 0
    in_diff = False
    for line in patch.read_text().splitlines():
        if line.startswith("--- "):
            in_diff = True
            continue
        if not in_diff or line.startswith(("+++ ", "@@")) or (not count_blank and not line[1:].strip()):
            continue
        added += line.startswith("+")
        removed += line.startswith("-")
    return added, removed


def check(corpus: Path = CORPUS) -> list[str]:
    """Every change applied to its original in a scratch folder: what failed, one line each."""
    failed = []
    with tempfile.TemporaryDirectory() as scratch:
        for script in SCRIPTS:
            for library in LIBRARIES:
                try:
                    write(script, library, Path(scratch) / script / library, corpus)
                except ConversionError as error:
                    failed.append(f"{script} {library}: {error}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", nargs="?", choices=list(SCRIPTS))
    parser.add_argument("library", nargs="?", choices=list(LIBRARIES))
    parser.add_argument("out", nargs="?", type=Path, help="the folder to write the converted script into")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help=f"where the originals are (default {CORPUS})")
    parser.add_argument("--check", action="store_true", help="apply every change in a scratch folder")
    parser.add_argument("--make", type=Path, metavar="EDITED", help="write the change again, from an edited copy")
    args = parser.parse_args(argv)
    try:
        if args.check:
            failed = check(args.corpus)
            for line in failed:
                print(line, file=sys.stderr)
            return 1 if failed else 0
        if args.script is None or args.library is None or (args.out is None) == (args.make is None):
            parser.error("give SCRIPT LIBRARY and either OUT or --make EDITED.py (or --check)")
        if args.make is not None:
            print(make(args.script, args.library, args.make, args.corpus))
        else:
            print(write(args.script, args.library, args.out, args.corpus))
    except ConversionError as error:
        print(f"convert.py: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
