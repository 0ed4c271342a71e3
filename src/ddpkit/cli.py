"""The ``ddpkit`` command: ``train`` and ``run``.

    $ ddpkit train                                   # digits, net, one process per GPU (2 on a CPU machine)
    $ ddpkit train --model resnet18 --data folder:/data/imagenette --nproc-per-node 4
    $ ddpkit run --nproc-per-node 2 my_torchrun_script.py --its-own-flags

Every user mistake ends here as one line on stderr and exit status 2, before any process starts
where the mistake can be seen from the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence

from ddpkit import env as env_mod
from ddpkit import logs, signals
from ddpkit.errors import UsageError, said_once
from ddpkit.launch import (DEFAULT_RDZV_TIMEOUT_S, LAUNCHERS, LaunchOptions, elastic, parse_nnodes, resolve_nproc, spawn,
                           warn_earlier_run)
from ddpkit.logs import logger, report_usage_error
from ddpkit.process_group import LAUNCHED_BY_TORCHRUN, freeze_for_exit, read_environment


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (not usage + error) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _add_nccl_flag(group) -> None:
    group.add_argument("--nccl", action="append", default=[], metavar="KEY=VALUE|PRESET",
                       help="an NCCL setting for every rank, e.g. NCCL_ALGO=Ring (repeatable), or a preset: "
                            "debug, no-p2p, no-ib; echoed at start and recorded (docs/nccl.md)")


def _add_log_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=None, choices=logs.LEVELS,
                        help="debug: every rank's messages; info: rank 0's, and warnings and errors from every rank; "
                             "warning; error (default: info, or DDPKIT_LOG_LEVEL)")


def _add_launch_flags(parser: argparse.ArgumentParser, *, with_launcher: bool = False) -> None:
    group = parser.add_argument_group("launching (as torchrun)")
    if with_launcher:
        group.add_argument("--launcher", default="torchrun", choices=LAUNCHERS,
                           help="torchrun (its elastic agent) or spawn (torch.multiprocessing.spawn) (default: torchrun)")
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
    _add_nccl_flag(group)
    group.add_argument("--find-hangs", action="store_true",
                       help="TORCH_DISTRIBUTED_DEBUG=DETAIL for the workers: before each collective the ranks check "
                            "in, so a timeout names the rank(s) that never arrived (slower; for debugging)")
    group.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="restart the whole group up to K times when a process fails; `ddpkit train` then "
                            "resumes from its newest checkpoint (default: 0)")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    from ddpkit.config import add_flags
    from ddpkit.trainer import TrainConfig

    add_flags(parser, TrainConfig)  # flags, defaults, choices and help: TrainConfig's fields declare them
    parser.add_argument("--list-models", action="store_true", help="print the model names and exit")
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="settings from a TOML file whose keys are these flags' long names (batch-size = 64); "
                             "flags given on the command line override them. Every run writes its own to "
                             "OUTPUT_DIR/config.toml, which --config takes back to repeat it")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpkit", description="Data-parallel PyTorch training, launched and checked.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="train a built-in or torchvision model",
                                description="Train a model data-parallel on every device of this machine (or many).")
    _add_train_flags(train)
    _add_launch_flags(train, with_launcher=True)
    run = commands.add_parser(
        "run", help="start a torchrun-style script on N processes",
        description="Run SCRIPT on every process, like torchrun: each gets RANK, LOCAL_RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT in its environment.")
    _add_launch_flags(run)
    _add_log_flag(run)
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="collective timeout for scripts using ddpkit.distributed() (default: 1800)")
    run.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                     help="for scripts using ddpkit.Job: end the job, naming the rank that holds it up and its "
                          "stack, once no rank has advanced for this long (0: off) (default: 60)")
    run.add_argument("--local-rank-arg", action="store_true",
                     help="also pass --local-rank=N, like the old `python -m torch.distributed.launch`")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as in `python -m`")
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to SCRIPT unchanged")
    doctor = commands.add_parser(
        "doctor", help="versions, backends, GPUs, variables, leftovers; a connectivity check across processes",
        description="Explain this machine before a run and after a hang: versions, backends, GPUs and their "
                    "topology, the NCCL/GLOO/TORCH variables in effect with what each does, processes holding "
                    "the master port or GPU memory; with --nproc-per-node N (or under torchrun/srun) also an "
                    "all-reduce check across the processes, with latency, bandwidth and each rank's interface.")
    doctor.add_argument("--json", default=None, metavar="FILE|-", help="write the report as JSON (- for stdout)")
    doctor.add_argument("--port", type=int, default=None,
                        help="port to look for holders of (default: MASTER_PORT, else 29500)")
    _add_launch_flags(doctor)
    _add_log_flag(doctor)
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
    bench.add_argument("--data", default="synthetic", metavar="synthetic|loader|folder:PATH",
                       help="synthetic: one batch already on the device; loader: a DataLoader over pinned host "
                            "memory, copied each step; folder:PATH: an ImageFolder decoded by CPU loader "
                            "processes (default: synthetic)")
    bench.add_argument("--image-size", type=int, default=None, metavar="PIXELS",
                       help="side of the square input (default: 224 for torchvision's classifiers, as ImageNet "
                            "numbers are quoted; a built-in model's own size)")
    bench.add_argument("--warmup", type=int, default=5,
                       help="untimed steps of each variant first, rounded up to whole rounds of --steps (default: 5)")
    bench.add_argument("--steps", type=int, default=20, help="steps per timed round (default: 20)")
    bench.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default: 3)")
    bench.add_argument("--link-gbps", default="100,400", metavar="LIST",
                       help="link bandwidths (Gb/s) to project DDP efficiency for (default: 100,400)")
    _add_nccl_flag(bench)
    _add_log_flag(bench)
    bench.add_argument("--sweep", action="store_true",
                       help="also time DDP on the most devices for bucket sizes 1/5/25/100 MB and the fp16, bf16 "
                            "and PowerSGD gradient-compression hooks, and name the best")
    bench.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    bench.add_argument("--csv", default=None, metavar="FILE", help="write the result rows as CSV")
    bench.add_argument("--plot", default=None, metavar="FILE.png", help="plot throughput and efficiency (matplotlib)")
    status = commands.add_parser(
        "status", help="every rank's step, phase, last heartbeat, step time and memory",
        description="Show a run of `ddpkit train` from its output folder, while it runs or after it ended: how it "
                    "stands (running, ended, failed, stopped, stalled), each rank's step, phase, last heartbeat, "
                    "step time and memory, and its last epoch's metrics.")
    status.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's --output-dir")
    status.add_argument("--watch", action="store_true", help="show it again every --every seconds while it runs")
    status.add_argument("--every", type=float, default=5.0, metavar="SECONDS", help="with --watch (default: 5)")
    checkpoint = commands.add_parser(
        "checkpoint", help="work with checkpoints: export one's model weights as a plain state_dict",
        description="Work with the checkpoints of `ddpkit train` (and the tutorials' layouts).")
    actions = checkpoint.add_subparsers(dest="action", required=True, parser_class=_Parser)
    export = actions.add_parser(
        "export", help="the model weights of a checkpoint as a plain state_dict, like model.pt",
        description="Write the model weights of SOURCE as the plain state_dict that model.pt is (no `module.` "
                    "prefix), for torch.load(DEST, weights_only=True) into the bare model.")
    export.add_argument("source", metavar="SOURCE",
                        help="a checkpoint file, a checkpoint folder (its newest complete one) or a run's --output-dir")
    export.add_argument("destination", metavar="DEST", help="the file to write (replaced in one piece)")
    plot = commands.add_parser(
        "plot", help="draw a run's metrics per epoch to a PNG",
        description="Draw the metrics.jsonl of a `ddpkit train` run per epoch: losses, validation accuracy, "
                    "images per second and each rank's own step time (needs matplotlib: ddpkit[bench]).")
    plot.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's --output-dir")
    plot.add_argument("--output", default=None, metavar="FILE.png", help="default: OUTPUT_DIR/metrics.png")
    return parser


def cmd_checkpoint(ns: argparse.Namespace) -> int:
    from ddpkit import checkpoint

    if os.path.isdir(ns.destination):
        raise UsageError(f"{ns.destination} is a folder; give the file to write, e.g. {ns.destination}/model.pt")
    chosen, count = checkpoint.export_model(ns.source, ns.destination)
    print(f"wrote {ns.destination}: the {count} tensors of {chosen}'s model")
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from ddpkit import plot

    print(f"wrote {plot.draw(ns.output_dir, ns.output)}")
    return 0


def cmd_doctor(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    import json

    from ddpkit import doctor

    if _already_a_rank():
        from ddpkit import process_group

        with process_group.distributed() as runtime:
            check = doctor.connectivity(runtime)
            if not runtime.is_main:
                return 0 if check["ok"] else 1
    else:
        check = None
        if ns.nproc_per_node != "auto" or ns.nnodes != "1" or ns.rdzv_endpoint:
            options = _launch_options(ns)
            if options.world_size > 1:
                # Every process runs this command again as one rank; rank 0 prints the report.
                return elastic(options, ["-m", "ddpkit", *argv])
    report = doctor.machine_report(ns.port)
    if check is not None:
        report["connectivity"] = check
        report["port"], report["port_holders"] = None, []  # the job's own store is what holds it
    if ns.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(doctor.format_report(report))
        if ns.json:
            with open(ns.json, "w") as handle:
                json.dump(report, handle, indent=2)
    return 0 if check is None or check["ok"] else 1


def cmd_status(ns: argparse.Namespace) -> int:
    from ddpkit import status

    if not (math.isfinite(ns.every) and ns.every > 0):
        raise UsageError(f"--every must be a number of seconds above 0, got {ns.every}")
    return status.show(ns.output_dir, watch=ns.watch, every_s=ns.every)


def cmd_bench(ns: argparse.Namespace) -> int:
    from ddpkit import bench

    options = bench.BenchOptions(
        model=ns.model, strategies=bench.parse_list(ns.strategies, str, "--strategies"),
        nproc=bench.parse_list(ns.nproc, int, "--nproc") if ns.nproc else None, batch_size=ns.batch_size,
        device=ns.device, precision=ns.precision, channels_last=ns.channels_last, compile=ns.compile, data=ns.data,
        image_size=ns.image_size, warmup=ns.warmup, steps=ns.steps, repeats=ns.repeats,
        link_gbps=bench.parse_list(ns.link_gbps, float, "--link-gbps"), sweep=ns.sweep, json_path=ns.json, csv_path=ns.csv,
        plot_path=ns.plot,
    )
    try:
        bench.run(options)
    except RuntimeError as error:
        logger.error("%s", error)
        return 1
    return 0


def _train_config(ns: argparse.Namespace):
    from ddpkit.config import from_namespace
    from ddpkit.trainer import TrainConfig

    return from_namespace(TrainConfig, ns)


def _launch_options(ns: argparse.Namespace, launcher: str = "torchrun", one_process: bool = False) -> LaunchOptions:
    # single and dp are one process per node by nature: there `auto` means 1.
    nproc = 1 if one_process and ns.nproc_per_node == "auto" else resolve_nproc(ns.nproc_per_node)
    min_nodes, nnodes = parse_nnodes(ns.nnodes)
    return LaunchOptions(
        nproc_per_node=nproc, nnodes=nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, max_restarts=ns.max_restarts, launcher=launcher, rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id, min_nodes=min_nodes, rdzv_timeout_s=ns.rdzv_timeout,
    )


def _check_before_launch(cfg, options: LaunchOptions) -> None:
    """Refuse what this machine or the world size cannot run, before starting any process."""
    import torch

    from ddpkit import zoo
    from ddpkit.process_group import choose_backend, choose_device
    from ddpkit.trainer import strategy_for

    strategy = strategy_for(cfg)
    nproc, cuda_count = options.nproc_per_node, torch.cuda.device_count()
    # The last local rank is the one that runs out of GPUs first.
    device = choose_device(cfg.device, local_rank=nproc - 1, local_world_size=nproc, cuda_count=cuda_count)
    choose_backend(cfg.backend, device=device, local_world_size=nproc, cuda_count=cuda_count)

    data_kind = zoo.parse_data_spec(cfg.data).kind

    def build_model():
        channels, image_size = zoo.model_input(cfg.model, data_kind, cfg.image_size)
        return zoo.build_model(cfg.model, in_channels=channels, num_classes=10, image_size=image_size,
                               arguments=cfg.model_arguments())

    # An elastic job may run at any size from its least to its most nodes. A data set of the user's own decides
    # the model's input only once loaded, by the workers: they check what needs the model.
    for nodes in sorted({options.min_nodes or options.nnodes, options.nnodes}):
        strategy.check(world_size=nodes * nproc, cuda_count=cuda_count, batch_size=cfg.batch_size,
                       build_model=None if data_kind == zoo.USER_DATA else build_model)


def _spawn_train_worker(rank: int, world_size: int, port: int, cfg) -> None:
    from ddpkit import trainer

    signals.end_with_parent()  # the launcher is the parent: if it is killed, this rank ends too
    environment = env_mod.from_spawn(rank, world_size, master_port=port)
    try:
        trainer.run(cfg, environment=environment)
    except UsageError as error:
        sys.exit(report_usage_error(_in_flag_terms(error)))
    freeze_for_exit()


CONFIG_WRITTEN_ENV = "DDPKIT_CONFIG_WRITTEN"  # set by the launcher that wrote config.toml, for its workers


def _write_resolved_config(ns: argparse.Namespace, parser: argparse.ArgumentParser, cfg, nproc_per_node: int) -> None:
    """OUTPUT_DIR/config.toml: every setting of this run, with what ``auto`` and the defaults came to, so that
    ``ddpkit train --config OUTPUT_DIR/config.toml`` repeats it (on a machine with other device counts too)."""
    from ddpkit import checkpoint, config, trainer

    resolved = {"nproc-per-node": nproc_per_node, "lr": trainer.optimizer_settings(cfg.optimizer, cfg.lr)[1]["lr"]}
    settings, unset = config.resolved_settings(ns, parser, resolved)
    text = config.config_text(settings, unset, "ddpkit train")
    path = os.path.join(cfg.output_dir, config.CONFIG_FILE)
    checkpoint.atomic_write(path, lambda handle: handle.write(text.encode()))


def cmd_train(ns: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    from ddpkit import trainer, zoo

    if ns.list_models:
        print("\n".join(["net", "convnet", *zoo.torchvision_classifiers()]))
        return 0
    with _same_on_every_rank():
        cfg = _train_config(ns)
        cfg.validate()
        trainer.check_output_dir(cfg.output_dir)
    if _already_a_rank():
        # Already one rank of a job (torchrun, Slurm's srun, the legacy launcher): train, launch nothing.
        environment = read_environment(argv=())
        if environment.rank == 0 and CONFIG_WRITTEN_ENV not in os.environ:  # no launcher of ours wrote it
            _write_resolved_config(ns, parser, cfg, environment.local_world_size)
        trainer.run(cfg)
        freeze_for_exit()  # done, and the group is down: end in a fraction of a second, not two
        return 0
    options = _launch_options(ns, ns.launcher, one_process=trainer.strategy_for(cfg).one_process)
    _check_before_launch(cfg, options)
    warn_earlier_run(cfg.output_dir)
    _write_resolved_config(ns, parser, cfg, options.nproc_per_node)
    if options.world_size == 1 and options.rdzv_endpoint is None:
        trainer.run(cfg)
        freeze_for_exit()
        return 0
    if options.launcher == "spawn":
        return _workers_done(spawn(_spawn_train_worker, options.nproc_per_node, (cfg,)))
    os.environ[CONFIG_WRITTEN_ENV] = "1"  # its workers run this command again: they need not write it again
    # Each rank's whole output kept in OUTPUT_DIR/logs/rank<N>.log; the console shows rank 0 and the others'
    # warnings and errors (ddpkit.rank_logs).
    options = dataclasses.replace(options, rank_logs=os.path.join(cfg.output_dir, trainer.LOGS_FOLDER))
    return _workers_done(elastic(options, ["-m", "ddpkit", *argv]))


def _workers_done(status: int) -> int:
    """The launcher's work is over once its workers are: end it in a fraction of a second, not one."""
    freeze_for_exit()
    return status


def _in_flag_terms(error: UsageError) -> UsageError:
    """The library's error with its parameter names said as this command's flags."""
    if "`" not in str(error):
        return error  # nothing to translate: no need to import the trainer (and torch) for it
    from ddpkit.config import said_in_flags
    from ddpkit.trainer import OTHER_FLAGS, TrainConfig

    return said_in_flags(error, TrainConfig, OTHER_FLAGS)


def _speaks_for_the_job() -> bool:
    """Whether this process says what every rank of its job would say alike: one not started as a rank, or
    rank 0 of a job that another launcher (srun, mpirun, torchrun) started with the same command line."""
    try:
        return not env_mod.is_launched(os.environ) or env_mod.detect(os.environ).rank == 0
    except ValueError:  # the launcher's variables are themselves the mistake: every rank says so
        return True


def _same_on_every_rank():
    """A block whose mistakes (in the command line) are the same on every rank: rank 0 says them."""
    return said_once(_speaks_for_the_job())


def _already_a_rank() -> bool:
    try:
        return env_mod.is_launched(os.environ)
    except ValueError as error:
        raise UsageError(f"cannot read the launcher's environment: {error}") from None


def torchrun_variables(environment: env_mod.DistEnv) -> dict[str, str]:
    """The variables torchrun gives each worker, for a rank some other launcher (Slurm) started."""
    return {
        "RANK": str(environment.rank),
        "LOCAL_RANK": str(environment.local_rank),
        "WORLD_SIZE": str(environment.world_size),
        "LOCAL_WORLD_SIZE": str(environment.local_world_size),
        "GROUP_RANK": str(environment.node_rank),
        "MASTER_ADDR": environment.master_addr,
        "MASTER_PORT": str(environment.master_port),
    }


def cmd_run(ns: argparse.Namespace) -> int:
    if ns.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(ns.script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"module {ns.script!r} cannot be imported from here")
    elif not os.path.isfile(ns.script):
        raise UsageError(f"script {ns.script!r} does not exist")
    script = (["-m"] if ns.module else []) + [ns.script]
    if _already_a_rank():
        # srun -n N ddpkit run script.py: this task is one rank. Give the script torchrun's variables
        # (rank, world, master from Slurm) and become it; starting N more processes would be wrong.
        environment = read_environment(argv=())
        os.environ.update(torchrun_variables(environment))
        # Where torchrun puts it: right after the script, before the script's own arguments.
        local_rank = [f"--local-rank={environment.local_rank}"] if ns.local_rank_arg else []
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-u", *script, *local_rank, *ns.script_args])
    return _workers_done(elastic(_launch_options(ns), [*script, *ns.script_args], local_rank_arg=ns.local_rank_arg))


FLIGHT_RECORDER_FOLDER = "ddpkit-flight-recorder"  # in the temporary folder of each machine


def _says_it_once() -> bool:
    """Whether this process speaks for the job: ddpkit's launcher (not the workers torchrun starts with the
    same flags), or under srun or mpirun, where every process is a rank, rank 0."""
    return LAUNCHED_BY_TORCHRUN not in os.environ and _speaks_for_the_job()


def _flight_recorder() -> str | None:
    """On GPUs, PyTorch's NCCL flight recorder: every rank keeps its last collectives and writes them out
    when one times out, for ``torchfrtrace FOLDER -p rank_``. Returns the folder (None without CUDA).

    One fixed folder per machine, so that the launcher, its workers and srun's tasks agree on it without
    talking; the newest hang's records replace the last one's.
    """
    import tempfile

    import torch

    if not torch.cuda.is_available():
        return None  # it records NCCL's collectives only
    folder = os.path.join(tempfile.gettempdir(), FLIGHT_RECORDER_FOLDER)
    os.makedirs(folder, exist_ok=True)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder, "rank_"))
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_FR_DUMP_ON_TIMEOUT", "1")
    if _says_it_once():
        logger.info(f"flight recorder on: a timed-out collective leaves each rank's record in {folder} "
                    f"(read it with `torchfrtrace {folder} -p rank_`)")
    return folder


def _export_debug_settings(ns: argparse.Namespace) -> None:
    """Settings the workers read from their environment (they inherit the launcher's)."""
    from ddpkit import nccl

    level = "debug" if getattr(ns, "debug", False) else getattr(ns, "log_level", None)
    if level is not None:
        os.environ[logs.LEVEL_ENV] = level
    logs.configure(level=level)  # this process's lines; each worker configures its own, with its rank

    nccl.apply(nccl.settings(getattr(ns, "nccl", [])), echo=_says_it_once())
    if getattr(ns, "find_hangs", False):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        _flight_recorder()
    timeout = getattr(ns, "timeout", None)
    if ns.command == "run" and timeout is not None:
        from ddpkit.process_group import TIMEOUT_ENV, check_timeout

        os.environ[TIMEOUT_ENV] = str(check_timeout(timeout))  # its `timeout_s` is said as --timeout
    stall = getattr(ns, "stall_timeout", None)
    if ns.command == "run" and stall is not None:
        from ddpkit import heartbeat

        try:
            os.environ[heartbeat.STALL_ENV] = str(heartbeat.stall_setting(stall))
        except UsageError as error:
            raise UsageError(str(error).replace("`stall_timeout_s`", "--stall-timeout")) from None


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[name]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line, with a ``train --config FILE``'s settings put before the command line's own flags
    (which therefore override them)."""
    ns = parser.parse_args(argv)
    if ns.command == "train" and ns.config is not None:
        from ddpkit.config import read_config_file

        flags = read_config_file(ns.config, _subcommand(parser, "train"))
        ns = parser.parse_args([argv[0], *flags, *argv[1:]])
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        logs.configure()
        parser = build_parser()
        with _same_on_every_rank():
            ns = _parse(parser, argv)
            _export_debug_settings(ns)
        if ns.command == "train":
            return cmd_train(ns, argv, _subcommand(parser, "train"))
        if ns.command == "bench":
            return cmd_bench(ns)
        if ns.command == "doctor":
            return cmd_doctor(ns, argv)
        if ns.command == "status":
            return cmd_status(ns)
        if ns.command == "plot":
            return cmd_plot(ns)
        if ns.command == "checkpoint":
            return cmd_checkpoint(ns)
        return cmd_run(ns)
    except UsageError as error:
        return report_usage_error(_in_flag_terms(error))
    except SystemExit as stop:
        # ddpkit.distributed() reports a UsageError found inside the job and exits 2 (or a stop signal's
        # status): main() returns it, as it does every status.
        if isinstance(stop.code, int):
            return stop.code
        raise
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
