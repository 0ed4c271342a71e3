"""Other people's one-device scripts, byte for byte, under ``ddpkit run --unchanged`` on 1 and on 2 processes.

    .venv/bin/python benchmarks/public_unchanged.py [--only NAME ...] [--json FILE] [--keep DIR] [--flags '--shard always']
                                                   [--docs]

The scripts are the corpus beside the project (``../shared/corpus/pytorch-examples``: thirteen pytorch/examples
scripts as their authors wrote them, never edited, never copied into the repository), and beside them the project's
own scripts written as each library's documentation shows it (``tests/unchanged_*_script.py``: a transformers loop,
transformers' Trainer, torch.compile, a timm model). Each runs in a folder of its own, as

    ddpkit run --unchanged --seed 0 --nproc-per-node N SCRIPT ARGS        (N = 1, then 2)

its data given only through its own arguments or stand-in files in the layout it reads (an MNIST-format copy of
scikit-learn's digits, a random graph in Cora's format, random images; ``make_data``). A script is

- **exact**: it draws nothing per sample; the weights it saved (norm of the difference over the norm of one
  process's), or else the numbers it printed, agree to float rounding;
- **trains like one device**: it draws per sample (dropout, a random pair per item, a VAE's noise); its printed
  numbers on 1 and 2 processes are reported;
- **stands aside**: it distributes itself (transformers' Trainer), and runs as under ``ddpkit run``;
- **refused** or **stops, said why**: ddpkit's one line;
- **cannot run here**: it fails on one process too, here (what it needs and cannot get: the network, a package), the
  first error line said; or it is not run, and the case says why.

Anything else (a crash on 2 processes only, exact numbers that differ) is a DEFECT. ``--docs`` writes the table into
docs/unchanged.md between its markers; tests/test_public_unchanged.py runs every corpus script that runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus" / "pytorch-examples"
TESTS = REPO / "tests"
MAKE_DATA = REPO / "benchmarks" / "conversions" / "make_data.py"
DOCS = REPO / "docs" / "unchanged.md"
TABLE_START, TABLE_END = "<!-- corpus table: benchmarks/public_unchanged.py --docs -->", "<!-- end of the corpus table -->"
EXACT_TOLERANCE = 1e-4  # float32 rounding grown over a few steps; a wrong gradient is 1e-2 or more
TEST_SET = {"test loss": r"Test set: Average loss: (\S+),", "test accuracy": r"Accuracy: (\d+/\d+)"}
RANK, ANSI = re.compile(r"^\[rank\d+\]:\s*"), re.compile(r"\x1b\[[0-9;]*m")
GRAPH = {"test loss": r"Test set results: loss (\S+)", "test accuracy": r"accuracy (\S+)"}


@dataclass
class Case:
    name: str
    script: str  # below the corpus, or below tests/ for the project's own (``own``)
    args: list[str]  # "{out}": the run's folder
    expect: str  # the verdict this machine gives (the slow test holds the runs to it)
    what: str  # what it does, for the table
    weights: str | None = None  # a glob in the run folder: the file it saves; None: its printed numbers count
    metrics: dict[str, str] = field(default_factory=dict)  # name -> regex with one group; the last match counts
    data: tuple[str, ...] = ()  # stand-ins linked into the run folder: "mnist" (../data), "mnist-here" (./data), ...
    prepare: list[str] = field(default_factory=list)  # a corpus script run in the run folder first
    flags: list[str] = field(default_factory=list)  # ddpkit run's flags the script needs (--loss-reduction sum)
    folders: tuple[str, ...] = ()  # empty folders it writes into and expects to exist
    own: bool = False
    not_run: str | None = None  # why it is not run here at all
    here: str = ""  # why it fails on one process here too (its first error line follows in the table)
    tolerance: float = EXACT_TOLERANCE


CASES = [
    Case("mnist", "mnist/main.py", ["--epochs", "1", "--dry-run", "--save-model"], "trains like one device", "CNN, dropout, Adadelta, "
         "StepLR", weights="mnist_cnn.pt", metrics=TEST_SET, data=("mnist",)),
    Case("mnist_rnn", "mnist_rnn/main.py", ["--epochs", "1", "--dry-run", "--save-model"], "trains like one device",
         "LSTM, BatchNorm, Dropout2d", weights="mnist_rnn.pt", metrics=TEST_SET, data=("mnist",)),
    Case("mnist_forward_forward", "mnist_forward_forward/main.py", ["--epochs", "5", "--save_model"], "exact",
         "layers trained through `self.forward`, one batch each", metrics={
             "train error": r"train error: (\S+)", "test error": r"test error: (\S+)"}, data=("mnist-here",)),
    Case("siamese_network", "siamese_network/main.py", ["--epochs", "1", "--dry-run", "--save-model"], "trains like one device",
         "ResNet-18 pairs drawn in `__getitem__`", weights="siamese_network.pt", metrics=TEST_SET,
         data=("mnist-small",)),
    Case("mnist_hogwild", "mnist_hogwild/main.py", ["--epochs", "1", "--num-processes", "2", "--dry-run", "--save_model"],
         "trains like one device", "its own processes (torch.multiprocessing) sharing one model",
         weights="MNIST_hogwild.pt", metrics=TEST_SET, data=("mnist",)),
    Case("vae", "vae/main.py", ["--epochs", "1", "--batch-size", "32"], "trains like one device", "a summed loss, noise per sample, "
         "images saved", metrics={"test loss": r"Test set loss: (\S+)"}, data=("mnist",),
         flags=["--loss-reduction", "sum"], folders=("results",)),
    Case("regression", "regression/main.py", [], "exact", "batches cut by hand, the loss outside",
         metrics={"final loss": r"Loss: (\S+) after", "batches": r"after (\d+) batches"}),
    Case("time_sequence_prediction", "time_sequence_prediction/train.py", ["--steps", "1"], "cannot run here",
         "LBFGS with a closure, the whole set at once", metrics={"test loss": r"test loss: (\S+)"},
         here="its `torch.load('traindata.pt')` of a NumPy array, which torch 2.6 and later refuse by default "
              "(`weights_only=True`)",
         prepare=["time_sequence_prediction/generate_sine_wave.py"]),
    Case("super_resolution", "super_resolution/main.py", ["--upscale_factor", "3", "--batchSize", "8",
                                                          "--testBatchSize", "10", "--nEpochs", "2", "--threads", "2"],
         "exact", "loader workers, `torch.save(model)`", weights="model_epoch_2.pth",
         metrics={"PSNR (dB)": r"Avg\. PSNR: (\S+) dB"}, data=("dataset",)),
    Case("gcn", "gcn/main.py", ["--epochs", "5", "--val-every", "1"], "cannot run here", "the whole graph at once, "
         "sparse", metrics=GRAPH, data=("cora",), here="it downloads Cora at every start, with no look for a copy "
         "(gat has one), and this machine reaches no network"),
    Case("gat", "gat/main.py", ["--epochs", "3", "--val-every", "1", "--hidden-dim", "16", "--num-heads", "2"], "exact",
         "the whole graph at once, dropout", metrics=GRAPH, data=("cora",)),
    Case("fast_neural_style", "fast_neural_style/neural_style/neural_style.py",
         ["train", "--dataset", "styles/train", "--style-image", "styles/style.png", "--save-model-dir", "saved",
          "--image-size", "32", "--epochs", "2", "--log-interval", "1"], "cannot run here",
         "InstanceNorm, Adam, VGG-16 features", weights="saved/*.model", data=("styles",),
         here="it downloads VGG-16's pretrained weights, and this machine reaches no network"),
    Case("reinforcement_learning", "reinforcement_learning/reinforce.py", [], "cannot run here",
         "REINFORCE on CartPole", not_run="it needs gymnasium, and plays until its running reward passes CartPole's "
         "threshold, with no flag to stop sooner: longer than the minute a run may take here"),
    # The project's own, as each library's documentation shows it (tests/test_unchanged.py holds them to 1e-9).
    Case("transformers loop", "unchanged_counted_script.py", ["{out}"], "exact", "GPT-2 from a config, padded "
         "batches, its own loss and `num_items_in_batch`; `ignore_index`; class weights", weights="result.pt",
         own=True),
    Case("transformers Trainer", "unchanged_trainer_script.py", ["{out}"], "stands aside", "`Trainer.train`, "
         "`evaluate`, `save_model`", metrics={"eval loss": r"'eval_loss': '(\S+)'"}, own=True),
    Case("torch.compile", "unchanged_stack_script.py", ["{out}"], "exact", "`torch.compile` (inductor, C++ on the "
         "CPU), a figure, `save_pretrained` read back", weights="result.pt", own=True),
    Case("timm", "unchanged_timm_script.py", ["{out}"], "exact", "`create_model`, `create_optimizer_v2`, a cosine "
         "schedule, `ModelEmaV3`, label smoothing", weights="result.pt", own=True),
]


def make_data(folder: Path) -> None:
    """Every stand-in, once: MNIST files, a Cora-format graph, BSDS-like images, a style set."""
    subprocess.run([sys.executable, str(MAKE_DATA), "--out", str(folder), "--no-check"], check=True,
                   capture_output=True)
    rng = random.Random(0)
    cora = folder / "cora"  # 1800 papers (the scripts' splits need more than 1600), 100 binary words, 7 subjects
    cora.mkdir()
    ids = rng.sample(range(1, 10**6), 1800)
    subjects = ["Case_Based", "Genetic_Algorithms", "Neural_Networks", "Probabilistic_Methods",
                "Reinforcement_Learning", "Rule_Learning", "Theory"]
    with open(cora / "cora.content", "w") as out:
        for paper in ids:
            words = ["1" if rng.random() < 0.05 else "0" for _ in range(100)]
            out.write("\t".join([str(paper), *words, rng.choice(subjects)]) + "\n")
    with open(cora / "cora.cites", "w") as out:
        for _ in range(5000):
            out.write(f"{rng.choice(ids)}\t{rng.choice(ids)}\n")
    from PIL import Image  # noqa: PLC0415  (only here: the driver itself needs no imaging)

    def noise(path: Path, size: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3))).save(path)

    for split, count in (("train", 19), ("test", 7)):  # odd counts: uneven batches on 2 processes
        for i in range(count):
            noise(folder / "dataset" / "BSDS300" / "images" / split / f"{i:03d}.png", 64)
    for i in range(9):
        noise(folder / "styles" / "train" / "images" / f"{i:03d}.png", 40)
    noise(folder / "styles" / "style.png", 32)
    smaller_mnist(folder, folder / "mnist-small", 256, 101)


def smaller_mnist(source: Path, folder: Path, train: int, test: int) -> None:
    """The first images of each MNIST split, in MNIST's files (an idx header: magic, then one count per dimension)."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", train), ("t10k", test)):
        for kind, row_bytes in (("images-idx3", 28 * 28), ("labels-idx1", 1)):
            data = (source / "MNIST" / "raw" / f"{split}-{kind}-ubyte").read_bytes()
            header = 16 if kind.startswith("images") else 8
            (raw / f"{split}-{kind}-ubyte").write_bytes(
                data[:4] + count.to_bytes(4, "big") + data[8:header] + data[header:header + count * row_bytes])


def script_of(case: Case) -> Path:
    return (TESTS if case.own else CORPUS) / case.script


def arguments(case: Case, nproc: int, flags: list[str], here: Path) -> list[str]:
    """What follows ``ddpkit``: the run, as a user types it."""
    return ["run", "--unchanged", "--seed", "0", *case.flags, *flags, "--nproc-per-node", str(nproc),
            str(script_of(case)), *[arg.replace("{out}", str(here)) for arg in case.args]]


def lay_out(case: Case, here: Path, data: Path) -> None:
    """The run's folder, with the stand-ins where the script reads them and what it runs first."""
    here.mkdir(parents=True)
    for name in case.data:  # ../data (as the MNIST scripts read it), ./data, or a folder of the same name
        if name in ("mnist", "mnist-small"):
            (here.parent / "data").symlink_to(data if name == "mnist" else data / "mnist-small")
        elif name == "mnist-here":
            (here / "data").symlink_to(data)
        else:
            (here / name).symlink_to(data / name)
    for folder in case.folders:
        (here / folder).mkdir()
    for script in case.prepare:
        subprocess.run([sys.executable, str(CORPUS / script)], cwd=here, check=True, capture_output=True)


def by_subprocess(args: list[str], cwd: Path) -> tuple[object, str, str]:
    try:
        done = subprocess.run([sys.executable, "-m", "ddpkit", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=600)
        return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as timeout:
        return "timeout", str(timeout.stdout or ""), str(timeout.stderr or "")


def run_once(case: Case, nproc: int, scratch: Path, flags: list[str],
             runner: Callable[[list[str], Path], tuple] = by_subprocess) -> dict:
    """One run of ``case`` on ``nproc`` processes, in a folder of its own below ``scratch`` (where ``make_data`` put
    the stand-ins in ``data``); ``runner(args, cwd)`` starts ``ddpkit ARGS`` and returns (status, stdout, stderr)."""
    here = scratch / f"{case.name}-{nproc}".replace(" ", "-") / "run"
    lay_out(case, here, scratch / "data")
    start = time.perf_counter()
    rc, out, err = runner(arguments(case, nproc, flags, here), here)
    wall = time.perf_counter() - start
    metrics = {}
    for name, pattern in case.metrics.items():
        found = re.findall(pattern, out)
        metrics[name] = found[-1] if found else None
    saved = sorted(here.glob(case.weights)) if case.weights else []
    errors = [ANSI.sub("", RANK.sub("", line)).strip()[:160] for line in (err + "\n" + out).splitlines()
              if re.search(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception): ", line)]
    said = [line.strip() for line in err.splitlines() if "ddpkit: error: --unchanged" in line]
    return {"rc": rc, "wall_s": round(wall, 1), "metrics": metrics, "weights": str(saved[0]) if saved else None,
            "first_error": errors[0] if errors else None, "stdout_tail": out[-3000:], "stderr_tail": err[-4000:],
            "said": said[-1] if said else None, "stood aside": "--unchanged stood aside" in err}


def run_both(case: Case, scratch: Path, flags: list[str],
             runner: Callable[[list[str], Path], tuple] = by_subprocess) -> dict[int, dict]:
    """``case`` on 1 process, then on 2 where it ran on 1 (else the one run stands for both)."""
    one = run_once(case, 1, scratch, flags, runner)
    return {1: one, 2: run_once(case, 2, scratch, flags, runner) if one["rc"] == 0 else one}


def load_weights(path: str, folder: Path) -> dict:
    import torch  # noqa: PLC0415  (the driver starts the runs before it needs torch)

    sys.path.insert(0, str(folder))  # a whole model saved (super_resolution) unpickles its class from there
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    finally:
        sys.path.remove(str(folder))
    if isinstance(obj, dict) and "weights" in obj:  # the project's own scripts: {"weights": {part: state dict}}
        return {f"{part}.{key}": value for part, state in obj["weights"].items() for key, value in state.items()}
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def relative_difference(one: dict, two: dict) -> float:
    if one.keys() != two.keys():
        raise ValueError(f"the saved keys differ: {sorted(one.keys() ^ two.keys())}")
    keys = [k for k in one if one[k].is_floating_point()]
    diff = sum(float((one[k].double() - two[k].double()).pow(2).sum()) for k in keys)
    norm = sum(float(one[k].double().pow(2).sum()) for k in keys)
    return (diff / norm) ** 0.5 if norm else float("nan")


def printed_difference(one: dict, two: dict) -> float:
    """The largest relative difference of the numbers both runs printed last (inf where one printed none)."""
    worst = 0.0
    for name, value in one.items():
        other = two.get(name)
        if value is None or other is None:
            return float("inf")
        if "/" in value:  # a count, "95/101"
            worst = max(worst, 0.0 if value == other else float("inf"))
            continue
        a, b = float(value), float(other)
        worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    return worst


def judge(case: Case, runs: dict[int, dict]) -> dict:
    result = {"name": case.name, "runs": runs, "command": " ".join(
        ["ddpkit", *arguments(case, 0, [], Path("OUT"))]).replace("--nproc-per-node 0", "--nproc-per-node N")
        .replace(str(CORPUS) + "/", "").replace(str(REPO) + "/", "")}
    if runs[1]["rc"] != 0:
        result["verdict"] = "cannot run here"
        result["why"] = runs[1]["first_error"] or f"exits {runs[1]['rc']} on one process"
        return result
    if runs[2]["stood aside"]:
        result["verdict"] = "stands aside" if runs[2]["rc"] == 0 else "DEFECT: stood aside, then failed"
        return result
    if runs[2]["rc"] == 2 and runs[2]["said"]:
        result["verdict"], result["why"] = "refused", runs[2]["said"]
        return result
    if runs[2]["rc"] != 0:
        explained = runs[2]["said"]  # ddpkit's line saying why, before a traceback (a limit of --shard's)
        result["verdict"] = "stops, said why" if explained else "DEFECT: crash on 2 processes"
        result["why"] = explained or runs[2]["first_error"]
        return result
    if case.weights and runs[1]["weights"] and runs[2]["weights"]:
        folder = script_of(case).parent
        result["weights difference"] = relative_difference(load_weights(runs[1]["weights"], folder),
                                                           load_weights(runs[2]["weights"], folder))
    if case.metrics:
        result["printed difference"] = printed_difference(runs[1]["metrics"], runs[2]["metrics"])
    measured = result.get("weights difference", result.get("printed difference"))
    if case.expect != "exact":
        result["verdict"] = "trains like one device"
    elif measured is not None and measured <= case.tolerance:
        result["verdict"] = "exact"
    else:
        result["verdict"] = "DEFECT: exact expected, the numbers differ"
    return result


def row(case: Case, result: dict) -> str:
    if case.not_run:
        return f"| {case.name} | {case.what} | cannot run here | {case.not_run} |"
    runs = result["runs"]
    if "why" in result:
        numbers = (f"{case.here}: " if case.here and result["verdict"] == "cannot run here" else "") + \
            f"`{result['why']}`"
    else:
        parts = []
        if "weights difference" in result:
            parts.append(f"weights {result['weights difference']:.1e}")
        for name in runs[1]["metrics"]:
            parts.append(f"{name} {runs[1]['metrics'][name]} / {runs[2]['metrics'][name]}")
        numbers = "; ".join(parts) or "finished on both"
    return f"| {case.name} | {case.what} | {result['verdict']} | {numbers} |"


def made_on() -> str:
    import torch  # noqa: PLC0415

    return f"{os.cpu_count()} CPU cores, gloo, torch {torch.__version__.split('+')[0]}, {time.strftime('%Y-%m-%d')}"


def table(rows: list[str], flags: list[str], made: str | None = None) -> str:
    return "\n".join([
        f"Generated by `benchmarks/public_unchanged.py --docs{' --flags ' + repr(' '.join(flags)) if flags else ''}` "
        f"({made or made_on()}); each command and its output in `benchmarks/results/public-unchanged-cpu.json`. "
        "Numbers: 1 process / 2.",
        "", "| script | what it does | verdict | numbers, or why |", "|---|---|---|---|", *rows])


def write_docs(text: str) -> None:
    docs = DOCS.read_text()
    start, end = docs.index(TABLE_START) + len(TABLE_START), docs.index(TABLE_END)
    DOCS.write_text(docs[:start] + "\n" + text + "\n" + docs[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="these scripts only")
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--keep", default=None, metavar="DIR", help="run in DIR (kept) instead of a temporary one")
    parser.add_argument("--flags", default="", metavar="FLAGS",
                        help="more of ddpkit run's flags for both runs, as one word: '--shard always'")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/unchanged.md")
    parser.add_argument("--from-json", default=None, metavar="FILE", help="the table from a run's --json, not runs")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        by_name = {result["name"]: {**result, "runs": {int(n): run for n, run in result.get("runs", {}).items()}}
                   for result in saved["results"]}
        text = table([row(case, by_name[case.name]) for case in CASES if case.name in by_name], saved.get("flags", []),
                     saved.get("made"))
        print(text)
        if args.docs:
            write_docs(text)
        return
    if not CORPUS.is_dir():
        sys.exit(f"public_unchanged.py: no corpus at {CORPUS} (the shared folder beside the repository)")
    flags = args.flags.split()
    cases = [case for case in CASES if args.only is None or case.name in args.only]
    results, rows = [], []
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(args.keep or temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        make_data(scratch / "data")
        for case in cases:
            result = {"name": case.name, "verdict": "cannot run here", "why": case.not_run} if case.not_run else \
                judge(case, run_both(case, scratch, flags))
            results.append(result)
            rows.append(row(case, result))
            print(f"{case.name}: {result['verdict']}", file=sys.stderr, flush=True)
    text = table(rows, flags)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "cores": os.cpu_count(),
                                               "made": made_on(), "flags": flags, "results": results}, indent=1))
    if args.docs:
        write_docs(text)


if __name__ == "__main__":
    main()
