"""Who-am-I parsing for every launcher: pure functions over a mapping, no processes."""

import pytest

from ddpkit.core.env import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    DistEnv,
    detect,
    expand_nodelist,
    from_mpi,
    from_slurm,
    from_spawn,
    is_launched,
    local_rank_from_argv,
    tasks_per_node,
)

TORCHRUN = {
    "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_torchrun_environment():
    e = detect(TORCHRUN)
    assert e == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, master_addr="node0",
                        master_port=29400, restart_count=2, launcher="torchrun")
    assert e.num_nodes == 2 and not e.is_main and e.is_distributed


@pytest.mark.parametrize("argv", [["train.py", "--local-rank=1"], ["train.py", "--local_rank", "1"], ["x", "--local_rank=1"]])
def test_legacy_torch_distributed_launch(argv):
    environ = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "1234"}
    e = detect(environ, argv)
    assert (e.launcher, e.rank, e.local_rank, e.world_size, e.master_port) == ("torch.distributed.launch", 3, 1, 4, 1234)


def test_legacy_launcher_is_told_apart_from_torchrun_by_its_argument():
    # python -m torch.distributed.launch runs torchrun's agent, so TORCHELASTIC_RUN_ID is set as well.
    e = detect({**TORCHRUN, "LOCAL_RANK": "1"}, ["train.py", "--local-rank=1"])
    assert (e.launcher, e.local_rank) == ("torch.distributed.launch", 1)


def test_legacy_launcher_with_use_env_sets_local_rank_variable():
    e = detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["train.py"])
    assert (e.launcher, e.local_rank, e.world_size) == ("env", 0, 2)


def test_local_rank_argument_without_a_launcher_is_an_error():
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE are not set"):
        detect({}, ["train.py", "--local-rank=0"])


def test_local_rank_from_argv_absent():
    assert local_rank_from_argv(["train.py", "--lr", "0.1"]) is None


SLURM = {
    "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456",
}


def test_slurm_environment():
    e = detect(SLURM)
    assert e == DistEnv(rank=6, local_rank=2, world_size=8, local_world_size=4, node_rank=1, master_addr="gpu01",
                        master_port=SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN, launcher="slurm")


@pytest.mark.parametrize("spec, counts", [("4(x2)", [4, 4]), ("4(x2),2", [4, 4, 2]), ("1,3", [1, 3]), ("8", [8])])
def test_tasks_per_node(spec, counts):
    assert tasks_per_node(spec) == counts


def test_slurm_nodes_with_different_task_counts():
    environ = {**SLURM, "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
               "SLURM_TASKS_PER_NODE": "1,3"}
    assert from_slurm(environ).local_world_size == 3  # node 1's count, not node 0's


def test_slurm_master_port_and_addr_from_environment_win():
    e = from_slurm({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (e.master_addr, e.master_port) == ("head", 4000)


def test_slurm_single_task_is_not_a_launched_rank():
    # `sbatch --ntasks=1` then `ddpkit train --nproc-per-node 4`: ddpkit must launch the 4 itself.
    environ = {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert not is_launched(environ)
    assert detect(environ).launcher == "single"


def test_torchrun_variables_win_over_slurm():
    # torchrun started inside an allocation: its RANK is the truth, not SLURM_PROCID.
    assert detect({**SLURM, **TORCHRUN}).launcher == "torchrun"


OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_NAMESPACE": "prterun-h-4242@1",
            "MASTER_ADDR": "node0"}
MPICH = {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4", "PMI_KVSNAME": "kvs_77_0",
         "MASTER_ADDR": "node0"}


def test_a_port_derived_from_a_job_is_below_linuxs_default_ephemeral_range():
    """An outgoing connection may hold any port of 32768-60999 when rank 0 binds the derived one: that failed an
    mpirun test in CI once ("address already in use" at 33350)."""
    highest = from_slurm({**SLURM, "SLURM_JOB_ID": str(SLURM_PORT_SPAN - 1)}).master_port
    assert highest == SLURM_PORT_BASE + SLURM_PORT_SPAN - 1 < 32768
    ports = {from_mpi({**OPEN_MPI, "PMIX_NAMESPACE": f"prterun-h-{pid}@1"}).master_port for pid in range(2000)}
    assert len(ports) > 1800 and 10000 <= min(ports) and max(ports) < 32768


def test_open_mpi_and_mpich_environments():
    import zlib

    port = SLURM_PORT_BASE + zlib.crc32(b"prterun-h-4242@1") % SLURM_PORT_SPAN
    assert detect(OPEN_MPI) == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                                       master_addr="node0", master_port=port, launcher="mpi")
    e = detect(MPICH)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size, e.node_rank, e.launcher) == (6, 2, 8, 4, 1, "mpi")
    assert e.master_port == SLURM_PORT_BASE + zlib.crc32(b"kvs_77_0") % SLURM_PORT_SPAN
    assert is_launched(OPEN_MPI) and is_launched(MPICH)


def test_mpi_on_one_machine_needs_no_master_address_and_takes_a_given_port():
    one_node = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": "4000"}
    e = from_mpi(one_node)
    assert (e.master_addr, e.master_port, e.node_rank) == ("127.0.0.1", 4000, 0)


def test_mpi_across_machines_without_a_master_address_says_what_to_pass():
    with pytest.raises(ValueError, match="pass node 0's address, mpirun -x MASTER_ADDR=HOST"):
        from_mpi({key: value for key, value in OPEN_MPI.items() if key != "MASTER_ADDR"})


def test_mpirun_inside_a_slurm_allocation_is_read_as_mpi_and_one_process_is_not_launched():
    assert detect({**SLURM, **OPEN_MPI}).launcher == "mpi"  # the allocation's SLURM_PROCID describes the batch script
    single = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert not is_launched(single)  # `mpirun -np 1 ddpkit train --nproc-per-node 2`: ddpkit launches the 2


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node1", ["node1"]),
        ("a1,b2", ["a1", "b2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[1,3],login", ["gpu1", "gpu3", "login"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu01]", "gpu[a-b]", "gpu[5-3]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="Slurm node list"):
        expand_nodelist(bad)


def test_spawn_rank_comes_from_the_argument():
    e = from_spawn(1, 2, master_port=5555)
    assert (e.launcher, e.rank, e.local_rank, e.world_size, e.master_port) == ("spawn", 1, 1, 2, 5555)


def test_plain_single_process():
    e = detect({}, ["train.py"])
    assert (e.launcher, e.rank, e.world_size, e.is_main, e.is_distributed) == ("single", 0, 1, True, False)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rank": 2, "world_size": 2}, r"rank 2 is outside 0..1"),
        ({"world_size": 0}, r"world size must be at least 1, got 0"),
        ({"local_rank": 3, "local_world_size": 2, "world_size": 4}, r"local rank 3 is outside 0..1"),
    ],
)
def test_inconsistent_numbers_are_refused_with_the_numbers(fields, message):
    with pytest.raises(ValueError, match=message):
        DistEnv(**fields)


def test_non_integer_variable_is_named():
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        detect({"RANK": "0", "WORLD_SIZE": "two"})
