"""The ``ddpkit`` command line: every sub-command's flags, their defaults and help.

``ddpkit train``'s own flags are TrainConfig's fields (``ddpkit.app.config`` turns each into a flag); the launch
flags are shared by train, run and doctor.
"""

from __future__ import annotations

import argparse

from ddpkit.core import logs
from ddpkit.core.errors import UsageError
from ddpkit.launch.launcher import DEFAULT_RDZV_TIMEOUT_S, LAUNCHERS


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (not usage + error) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

def add_nccl_flag(group) -> None:
    group.add_argument("--nccl", action="append", default=[], metavar="KEY=VALUE|PRESET",
                       help="an NCCL setting for every rank, e.g. NCCL_ALGO=Ring (repeatable), or a preset: "
                            "debug, no-p2p, no-ib; echoed at start and recorded (docs/nccl.md)")

def add_log_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=None, choices=logs.LEVELS,
                        help="debug: every rank's messages; info: rank 0's, and warnings and errors from every rank; "
                             "warning; error (default: info, or DDPKIT_LOG_LEVEL)")

def add_launch_flags(parser: argparse.ArgumentParser, *, with_launcher: bool = False) -> None:
    group = parser.add_argument_group("launching (as torchrun)")
    if with_launcher:
        group.add_argument("--launcher", default="torchrun", choices=LAUNCHERS,
                           help="torchrun (its elastic agent), spawn (torch.multiprocessing.spawn; train only) or ray "
                                "(one Ray Train worker per process on a Ray cluster, placed by Ray: --address; "
                                "docs/ray.md) (default: torchrun)")
        group.add_argument("--address", default=None, metavar="HOST:PORT",
                           help="with --launcher ray: the Ray cluster's head (its GCS port, as `ray start --head` "
                                "prints it), auto, or ray://HOST:10001 (default: RAY_ADDRESS, else a cluster started "
                                "on this machine, else a new local one)")
    group.add_argument("--nproc-per-node", default="auto", metavar="N|auto",
                       help="processes on this node; auto = one per GPU, or 2 without GPUs (default: auto)")
    group.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                       help="number of machines; MIN:MAX (with --rdzv-endpoint) starts once MIN joined and lets "
                            "up to MAX take part (default: 1)")
    group.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (default: 0)")
    group.add_argument("--master-addr", default=None, metavar="A",
                       help="address of node 0, reachable from every node (default: 127.0.0.1)")
    group.add_argument("--master-port", type=int, default=None, metavar="P",
                       help="free TCP port on node 0 (default: a free port on one node, 29500 on several)")
    group.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="torchrun's c10d rendezvous instead of --master-addr/--node-rank: the same command on "
                            "every node, HOST one of them; the nodes are numbered as they join")
    group.add_argument("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S, metavar="SECONDS",
                       help="on several machines: how long one waits for node 0 (or the rendezvous) and the others "
                            "to join before it ends with one line (default: 900)")
    group.add_argument("--rdzv-id", default=None, metavar="ID",
                       help="the job's name at the rendezvous; jobs sharing an endpoint need their own (default: ddpkit)")
    add_nccl_flag(group)
    group.add_argument("--find-hangs", action="store_true",
                       help="TORCH_DISTRIBUTED_DEBUG=DETAIL for the workers: before each collective the ranks check "
                            "in, so a timeout names the rank(s) that never arrived (slower; for debugging)")
    group.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="restart the whole group up to K times when a process fails; `ddpkit train` then "
                            "resumes from its newest checkpoint (default: 0)")

def add_train_flags(parser: argparse.ArgumentParser) -> None:
    from ddpkit.app.config import add_flags
    from ddpkit.app.train.config import TrainConfig

    add_flags(parser, TrainConfig)  # flags, defaults, choices and help: TrainConfig's fields declare them
    parser.add_argument("--list-models", action="store_true", help="print the model names and exit")
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="settings from a TOML file whose keys are these flags' long names (batch-size = 64); "
                             "flags given on the command line override them. Every run writes its own to "
                             "OUTPUT_DIR/config.toml, which --config takes back to repeat it")

def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one sub-command each for train, run, doctor, bench, status, checkpoint, data, plot and
    manifest."""
    parser = Parser(prog="ddpkit", description="Data-parallel PyTorch training, launched and checked.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_train_command(commands)
    add_run_command(commands)
    add_doctor_command(commands)
    add_bench_command(commands)
    add_status_command(commands)
    add_checkpoint_command(commands)
    add_data_command(commands)
    add_plot_command(commands)
    add_manifest_command(commands)
    return parser


def add_replica_flags(parser: argparse.ArgumentParser, how: str = "") -> None:
    """--replica-groups and its settings (``ddpkit train`` and ``ddpkit run``)."""
    parser.add_argument("--replica-groups", type=int, default=None, metavar="R",
                        help="run R replica groups (torchft): a group that dies is restarted under --max-restarts and "
                             f"copies its state from a live one, while the others train on ({how}--nproc-per-node "
                             "processes per group, DDP or FSDP among them; with --nnodes M, R/M groups on each "
                             "machine, machine 0 at --master-addr serving the others; docs/replica-groups.md)")
    parser.add_argument("--replica-heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                        help="with --replica-groups: how long the others wait for a group that stopped answering "
                             "before they go on without it (default: 2)")
    parser.add_argument("--min-replicas", type=int, default=None, metavar="K",
                        help="with --replica-groups: the fewest groups a step may take; while fewer are alive, the "
                             "others wait for them (up to the quorum timeout) instead of training on without them "
                             "(default: 1)")
    parser.add_argument("--lighthouse", default=None, metavar="URL",
                        help="with --replica-groups: use the torchft lighthouse that serves at URL (http://HOST:PORT, "
                             "started with torchft_lighthouse) instead of starting one (default: TORCHFT_LIGHTHOUSE "
                             "if set)")


def add_train_command(commands) -> None:
    """``ddpkit train``: TrainConfig's flags, the launch flags and --config."""
    train = commands.add_parser("train", help="train a built-in or torchvision model",
                                description="Train a model data-parallel on every device of this machine (or many).")
    add_train_flags(train)
    add_launch_flags(train, with_launcher=True)
    add_replica_flags(train)


def add_run_command(commands) -> None:
    """``ddpkit run SCRIPT``: the launch flags and the script's own arguments."""
    run = commands.add_parser(
        "run", help="start a torchrun-style script on N processes",
        description="Run SCRIPT on every process, like torchrun: each gets RANK, LOCAL_RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT in its environment. With --unchanged, a script written for one "
                    "device trains on every process as it would on one, without a changed line.")
    add_launch_flags(run, with_launcher=True)
    add_log_flag(run)
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="how long a collective waits for the other ranks before failing, for scripts on ddpkit "
                          "and for those that start their own process group without a timeout (default: 1800 on "
                          "ddpkit, PyTorch's otherwise)")
    run.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                     help="end the job, naming the rank that holds it up and its stack, once no rank has moved for "
                          "this long (0: off) (default: 60)")
    run.add_argument("--log-dir", default=None, metavar="DIR",
                     help="keep each rank's whole output in DIR/rank<N>.log; the console shows rank 0's output as it "
                          "comes and the other ranks' lines, those that several ranks say alike (but for their numbers) "
                          "once for all of them (--log-level debug: every line at once) (default: a temporary folder, "
                          "kept and named when a line was shown as one with others or a rank failed)")
    add_replica_flags(run, "the script runs on ddpkit.Job or ddpkit.ReplicaGroup; ")
    run.add_argument("--unchanged", action="store_true",
                     help="SCRIPT is written for one device: train it on every process as it would train on one. "
                          "Each batch of its DataLoaders is split across the processes, gradients are averaged by "
                          "each one's share during backward, BatchNorm normalises over the whole batch, rank 0 alone "
                          "saves; its batch size, steps and learning rate keep their meaning (docs/unchanged.md)")
    run.add_argument("--seed", type=int, default=None, metavar="S",
                     help="with --unchanged: the seed every process starts from, so that a run can be repeated and "
                          "1 and N processes compared (default: one drawn per run, and printed)")
    run.add_argument("--loss-reduction", choices=("mean", "sum", "coupled"), default=None,
                     help="with --unchanged: an override, needed only for batches that no DataLoader makes (cut by "
                          "hand). A DataLoader's steps are decided from the step itself: split where the loss is "
                          "proven a mean over rows, else gathered as DataParallel computes them (docs/unchanged.md). "
                          "`sum`: the loss is summed over the samples; `coupled`: every process loads the whole batch, "
                          "each computes its share of the model's forward, and the outputs are gathered, so any loss "
                          "is exact (default: decided from the step)")
    run.add_argument("--find-unused-parameters", action="store_true", default=None,
                     help="with --unchanged: DDP looks for parameters left without a gradient at every step "
                          "(find_unused_parameters), for a model that uses all of its parameters at its first step and "
                          "leaves some unused at a later one (a branch taken now and then). Not needed where the first "
                          "step leaves one unused: --unchanged then turns it on itself (default: from the first step)")
    run.add_argument("--shard", choices=("auto", "always", "never"), default=None,
                     help="with --unchanged: where each model's training state lives. `always`: sharded in place "
                          "(FSDP2), each process holding about 1/N of its parameters, gradients and optimizer state; "
                          "`never`: a whole replica on every process; `auto`: on a GPU, at the model's first training "
                          "call, the least sharding whose estimated state fits the free memory (a replica, then "
                          "gradients and optimizer state sharded, then everything), said in one line; a replica on "
                          "the CPU. Sharding needs torch 2.10 (docs/unchanged.md) (default: auto)")
    run.add_argument("--local-rank-arg", action="store_true",
                     help="also pass --local-rank=N, like the old `python -m torch.distributed.launch`")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as in `python -m`")
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to SCRIPT unchanged")


def add_doctor_command(commands) -> None:
    """``ddpkit doctor``: the machine report, and with launch flags a check across processes."""
    doctor = commands.add_parser(
        "doctor", help="versions, backends, GPUs, variables, leftovers; a connectivity check across processes",
        description="Explain this machine before a run and after a hang: versions, backends, GPUs and their "
                    "topology, the NCCL/GLOO/TORCH variables in effect with what each does, processes holding "
                    "the master port or GPU memory; with --nproc-per-node N (or under torchrun/srun) also an "
                    "all-reduce check across the processes, with latency, bandwidth and each rank's interface.")
    doctor.add_argument("--json", default=None, metavar="FILE|-", help="write the report as JSON (- for stdout)")
    doctor.add_argument("--port", type=int, default=None,
                        help="port to look for holders of (default: MASTER_PORT, else 29500)")
    add_launch_flags(doctor)
    add_log_flag(doctor)


def add_bench_command(commands) -> None:
    """``ddpkit bench``: what it measures and how it reports it."""
    bench = commands.add_parser(
        "bench", help="images/s of single, DP and DDP at 1, 2, ... devices",
        description="Measure training throughput for each strategy and device count: a table like the "
                    "tutorials', scaling efficiency, communication wait, ddpkit's overhead over a hand-written "
                    "loop, and a projection to more devices.")
    bench.add_argument("--model", default=None, help="default: resnet50 on GPU, net on CPU")
    bench.add_argument("--strategies", default="single,dp,ddp", metavar="LIST",
                       help="comma list of single, dp, ddp (dp is skipped without GPUs) (default: single,dp,ddp)")
    bench.add_argument("--nproc", default=None, metavar="LIST",
                       help="device counts to try, e.g. 1,2,4 (default: 1,2 on CPU; 1,2,4,... up to the GPUs)")
    bench.add_argument("--batch-size", type=int, default=32, metavar="B", help="per device (default: 32)")
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: auto")
    bench.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16"],
                       help="fp16/bf16 use autocast, fp16 with a GradScaler; tf32 also enables TF32 matmuls; fp32 is "
                            "PyTorch's default, whose cuDNN convolutions already use TF32 (default: fp32)")
    bench.add_argument("--channels-last", action="store_true", help="model and images in channels_last")
    bench.add_argument("--compile", action="store_true", help="torch.compile the model")
    bench.add_argument("--static-graph", action="store_true", help="DDP rows: DDP(static_graph=True)")
    bench.add_argument("--gradient-as-bucket-view", action="store_true",
                       help="DDP rows: DDP(gradient_as_bucket_view=True): gradients are views into the all-reduce "
                            "buckets (one copy less per step)")
    bench.add_argument("--data", default="synthetic", metavar="synthetic|loader|folder:PATH|shards:PATH",
                       help="synthetic: one batch already on the device; loader: a DataLoader over pinned host "
                            "memory, copied each step; folder:PATH or shards:PATH: image files read, decoded and "
                            "augmented as ddpkit train does, timed beside synthetic data (their fraction of it is "
                            "reported) (default: synthetic)")
    bench.add_argument("--decode", default="auto", choices=["auto", "cpu", "gpu"],
                       help="with folder: or shards: data: decode JPEGs in the loader processes (cpu) or with nvJPEG "
                            "(gpu); auto = cpu, or on CUDA gpu when the loader processes are too few to keep nvJPEG's "
                            "measured pace (default: auto)")
    bench.add_argument("--image-size", type=int, default=None, metavar="PIXELS",
                       help="side of the square input (default: 224 for torchvision's classifiers, as ImageNet "
                            "numbers are quoted; a built-in model's own size)")
    bench.add_argument("--warmup", type=int, default=5,
                       help="untimed steps of each variant first, rounded up to whole rounds of --steps (default: 5)")
    bench.add_argument("--steps", type=int, default=20, help="steps per timed round (default: 20)")
    bench.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default: 3)")
    bench.add_argument("--link-gbps", default="100,400", metavar="LIST",
                       help="link bandwidths (Gb/s) to project DDP efficiency for (default: 100,400)")
    add_nccl_flag(bench)
    add_log_flag(bench)
    bench.add_argument("--sweep", action="store_true",
                       help="also time DDP on the most devices (2 or more) for bucket sizes 1/5/25/100 MB and the "
                            "fp16, bf16 and PowerSGD gradient-compression hooks, and name the best")
    bench.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    bench.add_argument("--csv", default=None, metavar="FILE", help="write the result rows as CSV")
    bench.add_argument("--plot", default=None, metavar="FILE.png", help="plot throughput and efficiency (matplotlib)")


def add_status_command(commands) -> None:
    """``ddpkit status OUTPUT_DIR``."""
    status = commands.add_parser(
        "status", help="every rank's step, phase, last heartbeat, step time and memory",
        description="Show a run of `ddpkit train` from its output folder, while it runs or after it ended: how it "
                    "stands (running, ended, failed, stopped, stalled), each rank's step, phase, last heartbeat, "
                    "step time and memory, and its last epoch's metrics.")
    status.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's --output-dir")
    status.add_argument("--watch", action="store_true", help="show it again every --every seconds while it runs")
    status.add_argument("--every", type=float, default=5.0, metavar="SECONDS", help="with --watch (default: 5)")


def command_group(commands, name: str, *, help: str, description: str):  # noqa: A002 - argparse's name
    """A command whose own sub-commands (``ddpkit NAME ACTION``) are added to what this returns."""
    group = commands.add_parser(name, help=help, description=description)
    return group.add_subparsers(dest="action", required=True, parser_class=Parser)


def add_checkpoint_command(commands) -> None:
    """``ddpkit checkpoint export SOURCE DEST``."""
    actions = command_group(commands, "checkpoint",
                            help="work with checkpoints: export one's model weights as a plain state_dict",
                            description="Work with the checkpoints of `ddpkit train` (and the tutorials' layouts).")
    export = actions.add_parser(
        "export", help="the model weights of a checkpoint as a plain state_dict, like model.pt",
        description="Write the model weights of SOURCE as the plain state_dict that model.pt is (no `module.` "
                    "prefix), for torch.load(DEST, weights_only=True) into the bare model.")
    export.add_argument("source", metavar="SOURCE",
                        help="a checkpoint file, a checkpoint folder (its newest complete one) or a run's --output-dir")
    export.add_argument("destination", metavar="DEST", help="the file to write (replaced in one piece)")


def add_data_command(commands) -> None:
    """``ddpkit data pack|check|make-images``."""
    actions = command_group(commands, "data", help="image folders: pack into shards, check every file, make a test "
                                                   "folder",
                            description="Work with image data for `--data folder:PATH` and `--data shards:PATH` "
                                        "(docs/data.md).")
    pack = actions.add_parser(
        "pack", help="pack an image folder into tar shards and an index, for --data shards:OUT",
        description="Pack a class-per-folder tree of images (its train/ and val/ when it has them) into "
                    "WebDataset-layout tar shards with an index: --data shards:OUT then trains on exactly the "
                    "samples, order and crops of --data folder:FOLDER, from a few large files.")
    pack.add_argument("folder", metavar="FOLDER", help="the image folder (FOLDER/CLASS/IMAGE, or FOLDER/train and val)")
    pack.add_argument("out", metavar="OUT", help="a new (or empty) folder for the pack")
    pack.add_argument("--shard-mb", type=float, default=256, metavar="MB", help="size of each shard (default: 256)")
    check = actions.add_parser(
        "check", help="decode every image of a folder or pack, and list the ones that cannot be read",
        description="Decode every image of an image folder or a pack, on every core, as training would; list each "
                    "file that cannot be read (exit 1 if any), so it can be removed before a long run.")
    check.add_argument("source", metavar="folder:PATH|shards:PATH|PATH", help="what to check (a bare PATH: a folder)")
    check.add_argument("--workers", type=int, default=None, metavar="W", help="decoding processes (default: all cores)")
    make = actions.add_parser(
        "make-images", help="write a folder of photograph-like JPEGs for benchmarks and tests",
        description="Write JPEGs of ImageNet's sizes (500x375, 375x500) and quality (90) that decode like "
                    "photographs, in OUT/train/CLASS and OUT/val/CLASS (OUT/CLASS with --val 0).")
    make.add_argument("out", metavar="OUT", help="the folder to write (made if missing)")
    make.add_argument("--images", type=int, default=1000, help="training images (default: 1000)")
    make.add_argument("--val", type=int, default=None, metavar="N", help="validation images (default: a tenth)")
    make.add_argument("--classes", type=int, default=10, help="default: 10")
    make.add_argument("--size", default=None, metavar="WxH", help="every image this size (default: ImageNet's)")
    make.add_argument("--quality", type=int, default=90, help="JPEG quality, 1-95 (default: 90)")
    make.add_argument("--seed", type=int, default=0, help="default: 0")


def add_plot_command(commands) -> None:
    """``ddpkit plot OUTPUT_DIR``."""
    plot = commands.add_parser(
        "plot", help="draw a run's metrics per epoch to a PNG",
        description="Draw the metrics.jsonl of a `ddpkit train` run per epoch: losses, validation accuracy, "
                    "images per second and each rank's own step time (needs matplotlib: ddpkit[bench]).")
    plot.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's --output-dir")
    plot.add_argument("--output", default=None, metavar="FILE.png", help="default: OUTPUT_DIR/metrics.png")


MANIFEST_KINDS = ("trainjob", "pytorchjob", "indexed-job")  # what ddpkit.app.manifests writes


def add_manifest_command(commands) -> None:
    """``ddpkit manifest KIND -- COMMAND``."""
    manifest = commands.add_parser(
        "manifest", usage="ddpkit manifest {trainjob,pytorchjob,indexed-job} --image IMAGE [options] -- COMMAND",
        help="write a Kubernetes manifest that runs a ddpkit command on every node of a job",
        description="Write a TrainJob (Kubeflow Trainer), a PyTorchJob (Kubeflow training-operator) or an Indexed "
                    "Job with its headless Service, which runs the ddpkit command given after -- in every pod: its "
                    "--nnodes, --nproc-per-node and --max-restarts become the operator's fields, --nccl settings the "
                    "pods' environment, --replica-groups adds torchft's lighthouse (a Deployment and a Service), each pod gets a memory-backed /dev/shm. "
                    "The output (JSON documents, which are YAML) applies with `kubectl apply -f -`. "
                    "docs/kubernetes.md",
        epilog="example: ddpkit manifest trainjob --image ghcr.io/me/train:1 --gpus-per-node 8 -- "
               "train --nnodes 2 --model resnet50 --data folder:/data/imagenet")
    manifest.add_argument("kind", choices=MANIFEST_KINDS, help="the kind of job")
    manifest.add_argument("--image", required=True, help="the container image, with ddpkit and PyTorch installed")
    manifest.add_argument("--name", default="ddpkit", help="the job's name (a DNS label; default: ddpkit)")
    manifest.add_argument("--namespace", default=None, help="the Kubernetes namespace (default: kubectl's)")
    manifest.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                          help="nvidia.com/gpu per pod; --nproc-per-node auto is then one process per GPU (default: 0)")
    manifest.add_argument("--cpus-per-node", default=None, metavar="CPU", help="CPU request per pod, e.g. 16")
    manifest.add_argument("--memory-per-node", default=None, metavar="QUANTITY",
                          help="memory request and limit per pod, e.g. 200Gi")
    manifest.add_argument("--shm-size", default="16Gi", metavar="QUANTITY",
                          help="the memory-backed /dev/shm of each pod, for DataLoader workers (default: 16Gi)")


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[name]
