"""Public one-device scripts, as they are, under ``ddpkit run --unchanged`` on 1 and on 2 processes.

    .venv/bin/python benchmarks/public_unchanged.py [--only NAME ...] [--json FILE] [--keep DIR] [--flags '--shard always']

Each script in ``benchmarks/public/<name>/original.py`` is written to behave like its pytorch/examples original on one
device (its docstring names every addition); this runs each, in a folder of its own, as

    ddpkit run --unchanged --seed 0 --nproc-per-node N original.py ARGS        (N = 1, then 2)

with offline stand-in data made first (an MNIST-format copy of scikit-learn's digits, a random graph in Cora's
format, random images, the sine waves of the script's own generator), and prints a markdown table. A script is

- **exact**: it draws nothing per sample; the relative difference of the weights it saved (norm of the difference
  over the norm of the 1-process weights, over all tensors) is reported, and must be float rounding;
- **trains like one device**: it draws per sample (dropout, a random pair per item); its final metrics on 1 and on 2
  processes are reported (and the weights' difference, which is not expected to be small);
- **refused**: ddpkit's one-line refusal (exit status 2) is reported;
- **stops, said why**: it stopped on 2 processes with a traceback, after ddpkit's one line saying why (a limit of
  ``--shard``'s: a sharded parameter used as a whole tensor).

Anything else (a crash, exact weights that differ) is marked DEFECT. Runs go one at a time; each run's wall time is
in the JSON, and the scripts whose two runs take under 15 s are listed as candidates for slow tests.
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUBLIC = REPO / "benchmarks" / "public"
MAKE_DATA = REPO / "benchmarks" / "conversions" / "make_data.py"
EXACT_TOLERANCE = 1e-4  # float32 rounding grown over a few steps; a wrong gradient is 1e-2 or more


@dataclass
class Case:
    name: str
    args: list[str]
    weights: str  # a glob in the run folder: the file the script saved
    exact: bool  # False: the script draws per sample (dropout, random pairs)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> regex with one group; the last match counts
    links: tuple[str, ...] = ()  # names in the data folder linked into the run folder ("." the folder itself)
    prepare: list[str] = field(default_factory=list)  # a command run in the run folder first
    script: str = "original.py"
    # parameters whose gradient is zero in exact arithmetic (a bias that a normalisation after it cancels): their
    # gradient is rounding noise, which Adam scales to a full step, so they are left out of the exact comparison
    zero_gradient: str | None = None
    # float32 rounding grown by training; fast_neural_style's Adam steps on 6 batches grow it to 7e-4, and the same run
    # in float64 (default dtype float64, its images made double) agrees to 5e-9, 1e-10 without the zero-gradient biases
    tolerance: float = EXACT_TOLERANCE
    mnist: tuple[int, int] | None = None  # a smaller MNIST stand-in for this script: (train, test) images


CASES = [
    Case("mnist", ["--epochs", "1", "--save-model"], "mnist_cnn.pt", exact=False,
         metrics={"test loss": r"Test set: Average loss: (\S+),", "test accuracy": r"Accuracy: (\d+/\d+)"}),
    Case("mnist_rnn", ["--epochs", "1", "--save-model"], "mnist_rnn.pt", exact=False,
         metrics={"test loss": r"Test set: Average loss: (\S+),", "test accuracy": r"Accuracy: (\d+/\d+)"}),
    Case("mnist_forward_forward", ["--epochs", "20", "--save_model"], "mnist_ff_layers.pt", exact=True,
         metrics={"train error": r"train error: (\S+)", "test error": r"test error: (\S+)"}, links=(".",)),
    Case("siamese_network", ["--epochs", "1", "--save-model"], "siamese_network.pt", exact=False, mnist=(256, 101),
         metrics={"test loss": r"Test set: Average loss: (\S+),", "test accuracy": r"Accuracy: (\d+/\d+)"}),
    Case("regression", [], "regression.pt", exact=True, metrics={"final loss": r"Loss: (\S+) after",
                                                                  "batches": r"after (\d+) batches"}),
    Case("time_sequence_prediction", ["--steps", "1"], "sequence.pt", exact=True,
         metrics={"test loss": r"test loss: (\S+)"},
         prepare=[str(PUBLIC / "time_sequence_prediction" / "generate_sine_wave.py"), "100"]),
    Case("super_resolution", ["--upscale_factor", "3", "--batchSize", "8", "--testBatchSize", "10", "--nEpochs",
                              "2", "--crop_size", "48", "--threads", "2"], "model_epoch_2.pth", exact=True,
         metrics={"PSNR (dB)": r"Avg\. PSNR: (\S+) dB"}, links=("dataset",)),
    # The graph scripts train on the whole graph at once (no DataLoader; the loss outside the model): every process
    # computes each step whole, their dropout from the shared streams, so they are exact too.
    Case("gcn", ["--epochs", "5", "--val-every", "1"], "gcn.pt", exact=True,
         metrics={"test loss": r"Test set results: loss (\S+)", "test accuracy": r"accuracy (\S+)"},
         links=("cora",)),
    Case("gat", ["--epochs", "3", "--val-every", "1", "--hidden-dim", "16", "--num-heads", "2"], "gat.pt",
         exact=True, metrics={"test loss": r"Test set results: loss (\S+)", "test accuracy": r"accuracy (\S+)"},
         links=("cora",)),
    Case("fast_neural_style", ["train", "--dataset", "styles/train", "--style-image", "styles/style.png",
                               "--save-model-dir", "saved", "--image-size", "32", "--epochs", "2",
                               "--log-interval", "1"], "saved/*.model", exact=True,
         metrics={"total loss": r"total: (\S+)"}, links=("styles",),
         tolerance=1e-3, zero_gradient=r"^(conv[123]|res\d\.conv[12]|deconv[12])\.conv2d\.bias$|^res\d\.in2\.bias$"),
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


def command(case: Case, nproc: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "ddpkit", "run", "--unchanged", "--seed", "0", *flags, "--nproc-per-node", str(nproc),
            str(PUBLIC / case.name / case.script), *case.args]


def run_once(case: Case, nproc: int, scratch: Path, flags: list[str]) -> dict:
    here = scratch / f"{case.name}-{nproc}"
    if case.mnist:  # its own ../data: a smaller MNIST
        here = scratch / case.name / f"{case.name}-{nproc}"
        if not (scratch / case.name / "data").exists():
            smaller_mnist(scratch / "data", scratch / case.name / "data", *case.mnist)
    here.mkdir(parents=True)
    for name in case.links:  # "." is the data folder itself, as ./data
        (here / ("data" if name == "." else name)).symlink_to(scratch / "data" / name)
    if case.prepare:
        subprocess.run([sys.executable, *case.prepare], cwd=here, check=True, capture_output=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command(case, nproc, flags), cwd=here, capture_output=True, text=True, timeout=600)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as timeout:
        rc, out, err = "timeout", str(timeout.stdout or ""), str(timeout.stderr or "")
    wall = time.perf_counter() - start
    metrics = {}
    for name, pattern in case.metrics.items():
        found = re.findall(pattern, out)
        metrics[name] = found[-1] if found else None
    saved = sorted(here.glob(case.weights))
    errors = [line.strip()[:300] for line in err.splitlines() if re.search(r"^\S*\s*\w*(Error|Exception): ", line)]
    said = [line.strip() for line in err.splitlines() if "ddpkit: error: --unchanged" in line]
    return {"rc": rc, "wall_s": round(wall, 1), "metrics": metrics, "weights": str(saved[0]) if saved else None,
            "first_error": errors[0] if errors else None, "stdout_tail": out[-3000:], "stderr_tail": err[-4000:],
            "said": said[-1] if said else None}


def load_weights(path: str, folder: Path) -> dict:
    import torch  # noqa: PLC0415  (the driver starts the runs before it needs torch)

    sys.path.insert(0, str(folder))  # a whole model saved (super_resolution) unpickles its class from there
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    finally:
        sys.path.remove(str(folder))
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def relative_difference(one: dict, two: dict, skip: str | None = None) -> float:
    if one.keys() != two.keys():
        raise ValueError(f"the saved keys differ: {sorted(one.keys() ^ two.keys())}")
    keys = [k for k in one if one[k].is_floating_point() and not (skip and re.search(skip, k))]
    diff = sum(float((one[k].double() - two[k].double()).pow(2).sum()) for k in keys)
    norm = sum(float(one[k].double().pow(2).sum()) for k in keys)
    return (diff / norm) ** 0.5 if norm else float("nan")


def refusal(run: dict) -> str | None:
    """ddpkit's one line, when the run was refused (exit status 2 and a line of ddpkit's)."""
    if run["rc"] != 2:
        return None
    lines = [line for line in run["stderr_tail"].splitlines() if "ddpkit" in line and "--unchanged" in line]
    lines = lines or [line for line in run["stderr_tail"].splitlines() if "ddpkit" in line]
    return lines[-1].strip() if lines else None


def judge(case: Case, runs: dict[int, dict], flags: list[str]) -> dict:
    result = {"name": case.name, "exact_expected": case.exact, "runs": runs,
              "command": " ".join(["ddpkit run --unchanged --seed 0", *flags, "--nproc-per-node N",
                                   f"benchmarks/public/{case.name}/{case.script}", *case.args])}
    refused = {n: refusal(run) for n, run in runs.items()}
    if any(refused.values()):
        result["verdict"] = "refused" if refused[2] and runs[1]["rc"] == 0 else "DEFECT: refused on 1 process"
        result["refusal"] = refused[2] or refused[1]
        return result
    failed = [n for n, run in runs.items() if run["rc"] != 0]
    explained = runs[2]["said"] if failed == [2] else None  # ddpkit's line saying why, before a traceback
    if explained:  # a limit met and said by ddpkit in one line (a sharded parameter read as a whole one)
        result["verdict"], result["refusal"] = "stops, said why", explained
        return result
    if failed:
        result["verdict"] = f"DEFECT: crash on {', '.join(map(str, failed))} process(es)"
        return result
    if not (runs[1]["weights"] and runs[2]["weights"]):
        result["verdict"] = "DEFECT: no weights saved"
        return result
    one, two = (load_weights(runs[n]["weights"], PUBLIC / case.name) for n in (1, 2))
    result["relative_difference"] = relative_difference(one, two)
    measured = result["relative_difference"]
    if case.zero_gradient:
        measured = result["relative_difference_nonzero_gradient"] = relative_difference(one, two, case.zero_gradient)
    if not case.exact:
        result["verdict"] = "trains like one device"
    elif measured <= case.tolerance:
        result["verdict"] = "exact"
    else:
        result["verdict"] = "DEFECT: exact expected, weights differ"
    return result


def row(result: dict) -> str:
    runs = result["runs"]
    if "refusal" in result:
        numbers = f"`{result['refusal']}`"
    elif result["verdict"].startswith("DEFECT: crash"):
        errors = [runs[n]["first_error"] for n in runs if runs[n]["first_error"]]
        numbers = f"`{errors[0]}`" if errors else "(no error line: see the JSON's stderr_tail)"
    else:
        numbers = f"weights {result.get('relative_difference', float('nan')):.1e}"
        if "relative_difference_nonzero_gradient" in result:
            numbers += f" ({result['relative_difference_nonzero_gradient']:.1e} without the zero-gradient biases)"
        for name in runs[1]["metrics"]:
            numbers += f"; {name} {runs[1]['metrics'][name]} (1) / {runs[2]['metrics'][name]} (2)"
    walls = f"{runs[1]['wall_s']:.0f} + {runs[2]['wall_s']:.0f} s"
    return f"| {result['name']} | {result['verdict']} | {numbers} | {walls} | `{result['command']}` |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="these scripts only")
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--keep", default=None, metavar="DIR", help="run in DIR (kept) instead of a temporary one")
    parser.add_argument("--flags", default="", metavar="FLAGS",
                        help="more of ddpkit run's flags for both runs, as one word: '--shard always'")
    args = parser.parse_args()
    flags = args.flags.split()
    cases = [case for case in CASES if args.only is None or case.name in args.only]
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(args.keep or temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        make_data(scratch / "data")
        results = []
        for case in cases:
            runs = {nproc: run_once(case, nproc, scratch, flags) for nproc in (1, 2)}
            results.append(judge(case, runs, flags))
            print(f"{case.name}: {results[-1]['verdict']}", file=sys.stderr, flush=True)
    print("| script | verdict | numbers (1 process / 2 processes) | wall, 1 + 2 processes | command |")
    print("|---|---|---|---|---|")
    for result in results:
        print(row(result))
    fast = [r["name"] for r in results if r["runs"][1]["wall_s"] + r["runs"][2]["wall_s"] < 15]
    print(f"\nunder 15 s for both runs: {', '.join(fast) or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "cores": os.cpu_count(),
                                               "results": results, "fast": fast}, indent=1))


if __name__ == "__main__":
    main()
