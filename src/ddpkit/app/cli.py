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
import shutil
import sys
import tempfile
from collections.abc import Sequence

from ddpkit.core import env as env_mod
from ddpkit.core import logs, signals
from ddpkit.core.errors import UsageError, said_once
from ddpkit.launch.launcher import LaunchOptions, elastic, parse_nnodes, resolve_nproc, spawn
from ddpkit.core.logs import logger, report_usage_error
from ddpkit.launch.processes import warn_earlier_run
from ddpkit.app.parser import build_parser, subcommand
from ddpkit.core.process_group import LAUNCHED_BY_TORCHRUN, freeze_for_exit, read_environment


def cmd_checkpoint(ns: argparse.Namespace) -> int:
    from ddpkit import checkpoint

    if os.path.isdir(ns.destination):
        raise UsageError(f"{ns.destination} is a folder; give the file to write, e.g. {ns.destination}/model.pt")
    chosen, count = checkpoint.export_model(ns.source, ns.destination)
    print(f"wrote {ns.destination}: the {count} tensors of {chosen}'s model")
    return 0


def cmd_manifest(ns: argparse.Namespace) -> int:
    from ddpkit.app import manifests

    pods = manifests.Pods(image=ns.image, name=ns.name, namespace=ns.namespace, gpus_per_node=ns.gpus_per_node,
                          cpus_per_node=ns.cpus_per_node, memory_per_node=ns.memory_per_node, shm_size=ns.shm_size)
    sys.stdout.write(manifests.render(manifests.build(ns.kind, ns.command_line, pods)))
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from ddpkit.app import plot

    print(f"wrote {plot.draw(ns.output_dir, ns.output)}")
    return 0


def cmd_doctor(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    import json

    from ddpkit.app import doctor

    if _already_a_rank() and not _in_ray_workers_group():
        from ddpkit.core import process_group

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


def _in_ray_workers_group() -> bool:
    """Whether this process runs beside a Ray Train worker's own process group (in the worker, or started by it
    other than as a ``--launcher ray`` rank): MASTER_PORT is Ray's, whose store is not for a check of ddpkit's."""
    from ddpkit.core.ray_reports import REPORTS_ENV

    return env_mod.detect(os.environ).launcher == "ray" and REPORTS_ENV not in os.environ


def cmd_status(ns: argparse.Namespace) -> int:
    from ddpkit.watch import status

    if not (math.isfinite(ns.every) and ns.every > 0):
        raise UsageError(f"--every must be a number of seconds above 0, got {ns.every}")
    return status.show(ns.output_dir, watch=ns.watch, every_s=ns.every)


def cmd_bench(ns: argparse.Namespace) -> int:
    from ddpkit.app import bench

    options = bench.BenchOptions(
        model=ns.model, strategies=bench.parse_list(ns.strategies, str, "--strategies"),
        nproc=bench.parse_list(ns.nproc, int, "--nproc") if ns.nproc else None, batch_size=ns.batch_size,
        device=ns.device, precision=ns.precision, channels_last=ns.channels_last, compile=ns.compile, static_graph=ns.static_graph,
        gradient_as_bucket_view=ns.gradient_as_bucket_view, data=ns.data,
        decode=ns.decode, image_size=ns.image_size, warmup=ns.warmup, steps=ns.steps, repeats=ns.repeats,
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
    from ddpkit.app.config import from_namespace
    from ddpkit.app.train.config import TrainConfig

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


def _from_platform(ns: argparse.Namespace) -> None:
    """Fill ``ns``'s launch flags from the platform that started this node (a Kubeflow TrainJob's or PyTorchJob's
    pod, an Indexed Job's, SkyPilot, dstack: ``ddpkit.core.platforms``), where the command line did not set them, and
    say once what was read. Nothing under ``--launcher ray``, which places the ranks itself."""
    import socket

    from ddpkit.core import platforms

    if ns.launcher == "ray":
        return
    try:
        asked_nodes = parse_nnodes(ns.nnodes)[1]
        fqdn = socket.getfqdn() if platforms.INDEX in os.environ and asked_nodes > 1 else ""
        shape = platforms.read_platform(os.environ, nnodes=asked_nodes, fqdn=fqdn)
        if shape is None:
            return
        import torch

        given = platforms.LaunchFlags(
            nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr, master_port=ns.master_port,
            nproc_per_node=ns.nproc_per_node, rdzv_endpoint=ns.rdzv_endpoint, rdzv_id=ns.rdzv_id,
            max_restarts=ns.max_restarts)
        flags = platforms.merge(shape, given, gpus=torch.cuda.device_count(), cpus=os.cpu_count() or 1)
    except platforms.PlatformError as error:
        raise UsageError(f"this node's platform variables: {error} (docs/kubernetes.md)") from None
    for name, value in dataclasses.asdict(flags).items():
        setattr(ns, name, value)
    logger.info(f"launching as a node of a job that {shape.line()}")


def _check_before_launch(cfg, options: LaunchOptions, cuda_count: int | None = None) -> None:
    """Refuse what this machine (or, given ``cuda_count``, each node of a cluster with that many GPUs for the job's
    processes on it) or the world size cannot run, before starting any process."""
    import torch

    from ddpkit import zoo
    from ddpkit.core.process_group import choose_backend, choose_device

    strategy = cfg.make_strategy()
    nproc = options.nproc_per_node
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
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
    from ddpkit.app.train import trainer

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
    from ddpkit import checkpoint
    from ddpkit.app import config
    from ddpkit.app.train import config as train_config

    resolved = {"nproc-per-node": nproc_per_node, "lr": train_config.optimizer_settings(cfg.optimizer, cfg.lr)[1]["lr"]}
    settings, unset = config.resolved_settings(ns, parser, resolved)
    text = config.config_text(settings, unset, "ddpkit train")
    path = os.path.join(cfg.output_dir, config.CONFIG_FILE)
    checkpoint.atomic_write(path, lambda handle: handle.write(text.encode()))


def cmd_train(ns: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    from ddpkit import zoo
    from ddpkit.app.train import config as train_config
    from ddpkit.app.train import trainer

    if ns.list_models:
        print("\n".join(["net", "convnet", *zoo.torchvision_classifiers()]))
        return 0
    with _same_on_every_rank():
        cfg = _train_config(ns)
        cfg.validate()
        train_config.check_output_dir(cfg.output_dir)
    if _already_a_rank():
        # Already one rank of a job (torchrun, Slurm's srun, the legacy launcher): train, launch nothing.
        environment = read_environment(argv=())
        if environment.rank == 0 and CONFIG_WRITTEN_ENV not in os.environ:  # no launcher of ours wrote it
            _write_resolved_config(ns, parser, cfg, environment.local_world_size)
        trainer.run(cfg)
        freeze_for_exit()  # done, and the group is down: end in a fraction of a second, not two
        return 0
    _from_platform(ns)
    if ns.replica_groups is not None:
        return _train_replica_groups(ns, argv, parser, cfg)
    _refuse_replica_flags_alone(ns)
    if ns.launcher == "ray":
        return _train_on_ray(ns, argv, parser, cfg)
    _refuse_address(ns)
    options = _launch_options(ns, ns.launcher, one_process=cfg.make_strategy().one_process)
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
    # warnings and errors (ddpkit.launch.rank_logs).
    options = dataclasses.replace(options, rank_logs=os.path.join(cfg.output_dir, trainer.LOGS_FOLDER))
    return _workers_done(elastic(options, ["-m", "ddpkit", *argv]))


def _train_on_ray(ns: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser, cfg) -> int:
    """``ddpkit train`` with one rank per Ray Train worker: each runs this command line again as its rank."""
    if cfg.make_strategy().one_process and ns.nproc_per_node == "auto":
        ns.nproc_per_node = "1"  # single and dp are one process per node by nature

    def prepare(nproc_per_node: int, use_gpu: bool) -> None:
        _check_before_launch(cfg, LaunchOptions(nproc_per_node=nproc_per_node, nnodes=parse_nnodes(ns.nnodes)[1],
                                                launcher="ray"), cuda_count=nproc_per_node if use_gpu else 0)
        warn_earlier_run(cfg.output_dir)
        _write_resolved_config(ns, parser, cfg, nproc_per_node)
        os.environ[CONFIG_WRITTEN_ENV] = "1"  # the ranks run this command again: they need not write it again

    return _on_ray(ns, ["-m", "ddpkit", *argv], name=f"ddpkit-train-{cfg.model}", want_gpu=cfg.device != "cpu",
                   prepare=prepare)


def _workers_done(status: int) -> int:
    """The launcher's work is over once its workers are: end it in a fraction of a second, not one."""
    freeze_for_exit()
    return status


def _in_flag_terms(error: UsageError) -> UsageError:
    """The library's error with its parameter names said as this command's flags."""
    if "`" not in str(error):
        return error  # nothing to translate: no need to import the trainer (and torch) for it
    from ddpkit.app.config import said_in_flags
    from ddpkit.app.train.config import OTHER_FLAGS, TrainConfig

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
    if ns.launcher == "spawn":
        raise UsageError("ddpkit run starts a script with torchrun's agent or on Ray: drop --launcher spawn (it is for "
                         "ddpkit train), or give --launcher torchrun or ray")
    _from_platform(ns)
    if ns.replica_groups is not None:
        if ns.unchanged:
            raise UsageError("--unchanged and --replica-groups do not go together: a replica group's script runs on "
                             "ddpkit.Job or ddpkit.ReplicaGroup; drop one of them")
        if ns.launcher != "torchrun":
            raise UsageError(f"--replica-groups starts each group with torchrun's agent: drop --launcher {ns.launcher}")
        return _run_replica_groups(ns, script)
    _refuse_replica_flags_alone(ns)
    # Each worker runs the script unedited, under ddpkit's watch (--timeout and the stall watch reach a script
    # that starts its own process group too): ddpkit.app.watched.
    watched = ["-m", WATCHED, *_unchanged_argument(ns)]
    if ns.launcher == "ray" and not _already_a_rank():
        if ns.log_dir is not None:
            raise UsageError("--log-dir: under --launcher ray each rank's output goes to Ray's logs and to this console, "
                             "prefixed with its Ray worker; drop --log-dir")
        return _on_ray(ns, [*watched, *script, *ns.script_args], name=os.path.basename(ns.script))
    _refuse_address(ns)
    if _already_a_rank():
        # srun -n N ddpkit run script.py: this task is one rank. Give the script torchrun's variables
        # (rank, world, master from Slurm) and become it; starting N more processes would be wrong.
        environment = read_environment(argv=())
        os.environ.update(env_mod.torchrun_variables(environment))
        # Where torchrun puts it: right after the script, before the script's own arguments.
        local_rank = [f"--local-rank={environment.local_rank}"] if ns.local_rank_arg else []
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-u", *watched, *local_rank, *script, *ns.script_args])
    # Each rank's output in a file of its own; the console shows rank 0's as it comes and the others' lines, those
    # that echo a line shown a moment ago but for its numbers shown once for all (ddpkit.launch.rank_logs).
    folder = ns.log_dir or tempfile.mkdtemp(prefix="ddpkit-run-")
    options = dataclasses.replace(_launch_options(ns), rank_logs=folder)
    if ns.unchanged:
        from ddpkit.launch import rank_logs

        os.environ[rank_logs.ONE_VOICE] = "1"  # every rank prints what one process would: rank 0 says it
    status = elastic(options, [*watched, *script, *ns.script_args], local_rank_arg=ns.local_rank_arg)
    from ddpkit.launch import rank_logs

    if ns.log_dir is None and (not os.listdir(folder) or (status == 0 and not rank_logs.folder_named())):
        # No rank wrote anything, or every line is on the console and nothing failed: no copy is needed.
        shutil.rmtree(folder, ignore_errors=True)
    return _workers_done(status)


def _unchanged_argument(ns: argparse.Namespace) -> list[str]:
    """What tells each worker to run the script under --unchanged (``ddpkit.unchanged.Setting``), as its first
    argument; nothing without --unchanged, where its own flags are refused."""
    if not ns.unchanged:
        for flag, value in (("--seed", ns.seed), ("--loss-reduction", ns.loss_reduction), ("--shard", ns.shard),
                            ("--find-unused-parameters", ns.find_unused_parameters)):
            if value is not None:
                raise UsageError(f"{flag} is for --unchanged (the script's own flags go after SCRIPT): add --unchanged, "
                                 f"or drop {flag}")
        return []
    from ddpkit.app.watched import source_of
    from ddpkit.unchanged import Setting, stands_aside

    setting = Setting(seed=ns.seed, loss_reduction=ns.loss_reduction or "mean", shard=ns.shard or "auto",
                      find_unused=bool(ns.find_unused_parameters))
    if setting.shard == "always":
        from ddpkit.core.version import require_torch
        from ddpkit.unchanged.layouts import SHARD_IN_PLACE

        require_torch(SHARD_IN_PLACE, "--unchanged --shard always")
    named = stands_aside(source_of(ns.script, ns.module) or "")
    if named is None:
        return [f"--unchanged={setting.encode()}"]
    if _says_it_once():
        from ddpkit.unchanged import TRAINER_BATCH

        logger.warning(f"--unchanged stood aside: {ns.script} distributes itself (it {named}), and runs as under ddpkit run"
                       + (f"; {TRAINER_BATCH}" if named.startswith("trains through") else ""))
    ns.unchanged = False
    from ddpkit.app.watched import STOOD_ASIDE

    return [f"{STOOD_ASIDE}{named}"]  # (a script that then trains copies, with no group, is stopped: ``watched``)


def _refuse_address(ns: argparse.Namespace) -> None:
    if getattr(ns, "address", None) is not None:
        raise UsageError("--address names a Ray cluster: add --launcher ray, or drop --address")


def _on_ray(ns: argparse.Namespace, command: list[str], *, name: str, want_gpu: bool = True, prepare=None) -> int:
    """``command`` as one rank per Ray Train worker on the cluster at --address (``ddpkit.launch.on_ray``), with
    the launch flags checked first: the nodes, the processes on each, the restarts. ``prepare(nproc_per_node,
    use_gpu)`` runs once the cluster said what it holds, before any rank starts."""
    from ddpkit.launch import on_ray

    min_nodes, nnodes = parse_nnodes(ns.nnodes)
    if min_nodes is not None and min_nodes != nnodes:
        raise UsageError(f"--launcher ray runs on a fixed number of nodes: give --nnodes {nnodes}, not {ns.nnodes} "
                         "(Ray restarts the whole group, --max-restarts times)")
    nproc = ns.nproc_per_node if ns.nproc_per_node == "auto" else resolve_nproc(ns.nproc_per_node)
    LaunchOptions(nproc_per_node=1 if nproc == "auto" else nproc, nnodes=nnodes, node_rank=ns.node_rank,
                  master_addr=ns.master_addr, master_port=ns.master_port, max_restarts=ns.max_restarts,
                  launcher="ray", rdzv_endpoint=ns.rdzv_endpoint, rdzv_id=ns.rdzv_id)
    status = on_ray.launch(command, address=ns.address, nnodes=nnodes, nproc_per_node=nproc,
                           max_restarts=ns.max_restarts, want_gpu=want_gpu, name=name, prepare=prepare)
    return _workers_done(status)


def _refuse_replica_flags_alone(ns: argparse.Namespace) -> None:
    """UsageError for a replica-group setting given without --replica-groups."""
    for flag, value in (("--replica-heartbeat-timeout", ns.replica_heartbeat_timeout), ("--lighthouse", ns.lighthouse),
                        ("--min-replicas", ns.min_replicas)):
        if value is not None:
            raise UsageError(f"{flag} is for --replica-groups R: add it, or drop {flag}")


def _replica_machines(ns: argparse.Namespace):
    """The machines the replica groups run on (--nnodes, --node-rank, --master-addr, --master-port), checked;
    UsageError for launch flags that --replica-groups does not take."""
    from ddpkit.launch import launcher
    from ddpkit.launch.replica_groups import Machines

    if ns.rdzv_endpoint or ns.rdzv_id:
        raise UsageError("--replica-groups meets its machines at machine 0, not at a rendezvous: drop --rdzv-endpoint "
                         "and --rdzv-id, and give every machine --nnodes M --node-rank K --master-addr HOST")
    if _already_a_rank():
        raise UsageError("--replica-groups starts its groups' processes itself: run it once per machine, not under "
                         "srun or mpirun (which make every task a rank already)")
    min_nodes, nnodes = parse_nnodes(ns.nnodes)
    if min_nodes is not None:
        raise UsageError(f"--replica-groups runs on a fixed number of machines: give --nnodes {nnodes}, not "
                         f"{ns.nnodes} (a group that dies is restarted by its own machine's launcher)")
    if nnodes == 1 and (ns.master_addr or ns.master_port is not None or ns.node_rank):
        raise UsageError("--master-addr, --master-port and --node-rank are for --replica-groups on several machines "
                         "(--nnodes M): drop them on one (each group gets a port of its own)")
    options = LaunchOptions(nnodes=nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                            master_port=ns.master_port, rdzv_timeout_s=ns.rdzv_timeout)  # their checks
    if nnodes == 1:
        return Machines(wait_s=options.rdzv_timeout_s)
    launcher.check_names(options)
    launcher.choose_gloo_interface(options)  # the groups' all-reduce across the machines is gloo's
    return Machines(count=nnodes, rank=ns.node_rank, master_addr=ns.master_addr,
                    master_port=ns.master_port or launcher.DEFAULT_MULTINODE_PORT, wait_s=options.rdzv_timeout_s)


def _train_replica_groups(ns: argparse.Namespace, argv: Sequence[str], parser, cfg) -> int:
    """``ddpkit train --replica-groups R``: R groups of --nproc-per-node processes, each ``ddpkit train`` as the ranks
    of its own launch (its restarts under --max-restarts), beside torchft's lighthouse; OUTPUT_DIR/logs/group<G>/
    each."""
    from ddpkit.app.train import trainer
    from ddpkit.launch import replica_groups
    from ddpkit.strategies.replica_groups import require_torchft

    machines = _replica_machines(ns)
    if getattr(ns, "launcher", None) not in (None, "torchrun"):
        raise UsageError(f"--replica-groups starts each group with torchrun's agent: drop --launcher {ns.launcher}")
    cfg.check_for_replica_groups()
    require_torchft()
    warn_earlier_run(cfg.output_dir)
    nproc = replica_groups.group_nproc(ns.nproc_per_node)
    _write_resolved_config(ns, parser, cfg, nproc)
    os.environ[CONFIG_WRITTEN_ENV] = "1"  # the groups' processes run this command again: written once, here
    command = replica_groups.group_command(nproc=nproc, max_restarts=ns.max_restarts, extra=[],
                                           script=["-m", "ddpkit", *argv])
    return _workers_done(replica_groups.run_groups(ns.replica_groups, command, **_lighthouse_settings(ns),
                                                   log_dir=os.path.join(cfg.output_dir, trainer.LOGS_FOLDER),
                                                   nproc=nproc, machines=machines))


def _run_replica_groups(ns: argparse.Namespace, script: list[str]) -> int:
    """``ddpkit run --replica-groups R``: R launches of --nproc-per-node processes each, beside torchft's
    lighthouse."""
    from ddpkit.launch import replica_groups

    machines = _replica_machines(ns)
    extra = [flag for name, flag in (("timeout", "--timeout"), ("stall_timeout", "--stall-timeout"),
                                     ("log_level", "--log-level"), ("rdzv_timeout", "--rdzv-timeout"))
             if getattr(ns, name) is not None for flag in (flag, str(getattr(ns, name)))]
    extra += ["--local-rank-arg"] if ns.local_rank_arg else []
    extra += ["--find-hangs"] if getattr(ns, "find_hangs", False) else []
    nproc = replica_groups.group_nproc(ns.nproc_per_node)
    command = replica_groups.group_command(nproc=nproc, max_restarts=ns.max_restarts, extra=extra,
                                           script=[*script, *ns.script_args])
    return replica_groups.run_groups(ns.replica_groups, command, **_lighthouse_settings(ns), log_dir=ns.log_dir,
                                     nproc=nproc, machines=machines)


def _lighthouse_settings(ns: argparse.Namespace) -> dict:
    """``run_groups``' lighthouse settings: --lighthouse, else TORCHFT_LIGHTHOUSE (one started elsewhere), else
    none (ddpkit starts one, with --replica-heartbeat-timeout and --min-replicas)."""
    return {"heartbeat_timeout_s": ns.replica_heartbeat_timeout, "min_replicas": ns.min_replicas,
            "lighthouse_address": ns.lighthouse or os.environ.get(env_mod.LIGHTHOUSE) or None}


WATCHED = "ddpkit.app.watched"  # the module each worker of `ddpkit run` runs the script under


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
    from ddpkit.launch import nccl

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
        from ddpkit.core.process_group import TIMEOUT_ENV, check_timeout

        os.environ[TIMEOUT_ENV] = str(check_timeout(timeout))  # its `timeout_s` is said as --timeout
    stall = getattr(ns, "stall_timeout", None)
    if ns.command == "run" and stall is not None:
        from ddpkit.watch import heartbeat

        try:
            os.environ[heartbeat.STALL_ENV] = str(heartbeat.stall_setting(stall))
        except UsageError as error:
            raise UsageError(str(error).replace("`stall_timeout_s`", "--stall-timeout")) from None


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line, with a ``train --config FILE``'s settings put before the command line's own flags
    (which therefore override them)."""
    if argv[:1] == ["manifest"]:  # ddpkit manifest KIND [options] -- COMMAND: the command is not manifest's flags
        split = argv.index("--") if "--" in argv else len(argv)
        ns = parser.parse_args(argv[:split])
        ns.command_line = argv[split + 1:]
        return ns
    ns = parser.parse_args(argv)
    if ns.command == "train" and ns.config is not None:
        from ddpkit.app.config import read_config_file

        flags = read_config_file(ns.config, subcommand(parser, "train"))
        ns = parser.parse_args([argv[0], *flags, *argv[1:]])
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signals.end_with_parent_if_asked()  # a rank a Ray worker started (ddpkit train --launcher ray) ends with it
    try:
        logs.configure()
        parser = build_parser()
        with _same_on_every_rank():
            ns = _parse(parser, argv)
            _export_debug_settings(ns)
        if ns.command == "train":
            return cmd_train(ns, argv, subcommand(parser, "train"))
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
        if ns.command == "manifest":
            return cmd_manifest(ns)
        if ns.command == "data":
            from ddpkit.app import data_tools

            return data_tools.main(ns)
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
