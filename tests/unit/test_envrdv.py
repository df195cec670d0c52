"""troupe's env:// variables under mpiexec and in a Slurm step (runtime/envrdv.py), read from a dict."""

from __future__ import annotations

from troupe.runtime import envrdv
from troupe.runtime.ticket import slurm_ticket

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77",
         "SLURM_STEP_NODELIST": "n[4-6]", "SLURM_STEP_TASKS_PER_NODE": "3,2"}


def test_a_slurm_task_gets_torchruns_variables_at_the_ticket_every_task_computes():
    env = dict(SLURM)
    assert envrdv.provide(env) == "slurm"
    ticket = slurm_ticket(env=SLURM)  # troupe's own rendezvous, where init_process_group is not the script's
    assert {k: env[k] for k in envrdv.KEYS} == {"RANK": "3", "WORLD_SIZE": "5", "LOCAL_RANK": "0",
                                                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n4",
                                                 "MASTER_PORT": str(ticket.port)}
    other = {**SLURM, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}
    envrdv.provide(other)
    assert (other["MASTER_ADDR"], other["MASTER_PORT"]) == (env["MASTER_ADDR"], env["MASTER_PORT"])
    assert 20000 <= int(env["MASTER_PORT"]) < 40000
    chosen = {**SLURM, "TROUPE_MASTER_ADDR": "10.0.0.9", "TROUPE_MASTER_PORT": "29411"}
    envrdv.provide(chosen)
    assert (chosen["MASTER_ADDR"], chosen["MASTER_PORT"]) == ("10.0.0.9", "29411")


def test_mpiexec_on_one_host_gets_loopback_and_the_jobs_port():
    ranks = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "prterun-vm-3248@1"} for r in range(2)]
    assert [envrdv.provide(env) for env in ranks] == ["mpi", "mpi"]
    assert [env["RANK"] for env in ranks] == ["0", "1"] and {env["WORLD_SIZE"] for env in ranks} == {"2"}
    assert {(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in ranks} == {("127.0.0.1", ranks[0]["MASTER_PORT"])}
    another = {**ranks[0], "PMIX_NAMESPACE": "prterun-vm-3301@1"}
    for key in envrdv.KEYS + (envrdv.MARK,):
        another.pop(key)
    envrdv.provide(another)
    assert another["MASTER_PORT"] != ranks[0]["MASTER_PORT"]  # another job, another port


def test_nothing_is_set_where_a_launcher_set_it_or_none_is_there():
    torchrun = {**SLURM, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert envrdv.provide(dict(torchrun)) is None
    assert envrdv.provide({**SLURM, "TROUPE_TICKET": "127.0.0.1:1:t"}) is None  # troupe run's rank
    bare: dict[str, str] = {}
    assert envrdv.provide(bare) is None and bare == {}


def test_withdraw_removes_only_what_provide_set():
    env = dict(SLURM)
    envrdv.provide(env)
    envrdv.withdraw(env)
    assert env == SLURM
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"}
    envrdv.withdraw(torchrun)
    assert torchrun == {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"}
