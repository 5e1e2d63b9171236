"""Reading a Slurm job's environment (launcher/nodes/slurm.py): the compressed node list, and the
nodes, rank and rendezvous address it gives, from a dictionary standing in for os.environ."""

from __future__ import annotations

import re

import pytest

from launcher.nodes.slurm import DERIVED_PORT_BASE, DERIVED_PORT_SPAN, MAX_HOSTS, SlurmError, SlurmJob, expand_nodelist


def slurm_env(**overrides: str) -> dict[str, str]:
    """The variables of node 1 of a 4-node sbatch job, with `overrides` on top."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "host[01-04]",
        "SLURM_NODELIST": "host[01-04]",
    }
    env.update(overrides)
    return env


def without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in names}


# The node list


def test_a_single_host_is_itself():
    assert expand_nodelist("host01") == ["host01"]


def test_a_range_keeps_its_zero_padding():
    assert expand_nodelist("host[01-04]") == ["host01", "host02", "host03", "host04"]


def test_padding_is_the_width_of_the_range_start():
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]


def test_commas_outside_brackets_separate_hosts_in_order():
    assert expand_nodelist("a,b[3-5]") == ["a", "b3", "b4", "b5"]


def test_commas_inside_brackets_list_numbers_and_ranges():
    assert expand_nodelist("gpu[1,3,7-8]") == ["gpu1", "gpu3", "gpu7", "gpu8"]


def test_text_after_the_bracket_is_kept_on_every_host():
    assert expand_nodelist("n[1-2]-ib,x") == ["n1-ib", "n2-ib", "x"]


def test_two_bracket_groups_expand_with_the_first_varying_slowest():
    assert expand_nodelist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]


def test_a_one_number_range_is_one_host():
    assert expand_nodelist("node[7-7]") == ["node7"]


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("host[01-04", "never closed"),
        ("host01-04]", "without '['"),
        ("host[[1-2]]", "inside brackets"),
        ("host[5-3]", "goes down"),
        ("host[a-c]", "is not a number"),
        ("host[1-x]", "is not a number"),
        ("host[]", "empty bracket"),
        ("host[1,,3]", "is not a number"),
        ("a,,b", "empty host name"),
        ("a,", "empty host name"),
        (f"n[1-{MAX_HOSTS + 1}]", f"more than {MAX_HOSTS}"),
        ("a[1-300]b[1-300]", f"more than {MAX_HOSTS}"),
    ],
)
def test_bad_syntax_is_refused_with_a_one_line_message_naming_the_text(text, fault):
    with pytest.raises(SlurmError) as raised:
        expand_nodelist(text)
    message = str(raised.value)
    assert repr(text) in message
    assert fault in message
    assert "\n" not in message


def test_a_slurm_error_is_a_value_error():
    with pytest.raises(ValueError):
        expand_nodelist("host[5-3]")


# The job


def test_the_first_host_of_the_node_list_is_the_master():
    assert SlurmJob.from_env(slurm_env()) == SlurmJob(nnodes=4, node_rank=1, master_addr="host01", master_port=23456)


def test_the_old_variable_names_are_used_when_the_new_ones_are_missing():
    env = without(slurm_env(SLURM_JOB_NUM_NODES="2", SLURM_NODELIST="x[7-8]"), "SLURM_NNODES", "SLURM_JOB_NODELIST")
    job = SlurmJob.from_env(env)
    assert job is not None
    assert (job.nnodes, job.master_addr) == (2, "x7")


def test_slurm_nnodes_wins_over_slurm_job_num_nodes():
    job = SlurmJob.from_env(slurm_env(SLURM_NNODES="2", SLURM_JOB_NUM_NODES="4"))
    assert job is not None and job.nnodes == 2


def test_master_port_in_the_environment_wins():
    job = SlurmJob.from_env(slurm_env(MASTER_PORT="29500"))
    assert job is not None and job.master_port == 29500


def test_master_addr_in_the_environment_wins_over_the_node_list():
    job = SlurmJob.from_env(slurm_env(MASTER_ADDR="10.0.0.5"))
    assert job is not None and job.master_addr == "10.0.0.5"


def test_master_addr_makes_the_node_list_unnecessary():
    env = without(slurm_env(MASTER_ADDR="10.0.0.5"), "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    job = SlurmJob.from_env(env)
    assert job is not None and job.master_addr == "10.0.0.5"


@pytest.mark.parametrize("job_id", ["0", "1", "9999", "10000", "123456", "987654321"])
def test_the_derived_port_is_in_its_range_and_below_the_ephemeral_ports(job_id):
    job = SlurmJob.from_env(slurm_env(SLURM_JOB_ID=job_id))
    assert job is not None
    assert DERIVED_PORT_BASE <= job.master_port < DERIVED_PORT_BASE + DERIVED_PORT_SPAN
    assert job.master_port < 32768
    assert job.master_port == DERIVED_PORT_BASE + int(job_id) % DERIVED_PORT_SPAN


def test_every_node_of_a_job_derives_the_same_port():
    ports = {SlurmJob.from_env(slurm_env(SLURM_NODEID=str(rank))) for rank in range(4)}
    assert len({job.master_port for job in ports if job is not None}) == 1


def test_jobs_with_neighbouring_ids_get_different_ports():
    first = SlurmJob.from_env(slurm_env(SLURM_JOB_ID="123456"))
    second = SlurmJob.from_env(slurm_env(SLURM_JOB_ID="123457"))
    assert first is not None and second is not None
    assert first.master_port != second.master_port


def test_not_under_slurm_gives_none():
    assert SlurmJob.from_env({}) is None
    assert SlurmJob.from_env({"PATH": "/usr/bin", "MASTER_PORT": "29500"}) is None


@pytest.mark.parametrize(
    "missing",
    [
        ("SLURM_JOB_ID",),
        ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
        ("SLURM_NODEID",),
        ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    ],
)
def test_incomplete_slurm_variables_give_none(missing):
    assert SlurmJob.from_env(without(slurm_env(), *missing)) is None


@pytest.mark.parametrize("value", ["x", "", "-1", "1.0", "+1"])
def test_a_bad_slurm_nodeid_is_refused_with_a_message_naming_it(value):
    with pytest.raises(SlurmError, match=re.escape(f"SLURM_NODEID={value!r} is not an integer")):
        SlurmJob.from_env(slurm_env(SLURM_NODEID=value))


@pytest.mark.parametrize("name", ["SLURM_JOB_ID", "SLURM_NNODES", "MASTER_PORT"])
def test_a_variable_that_is_not_an_integer_is_refused_by_name(name):
    with pytest.raises(SlurmError, match=f"^{name}='x' is not an integer$"):
        SlurmJob.from_env(slurm_env(**{name: "x"}))


def test_an_array_job_id_with_an_underscore_is_refused():
    with pytest.raises(SlurmError, match="SLURM_JOB_ID='1234_7'"):
        SlurmJob.from_env(slurm_env(SLURM_JOB_ID="1234_7"))


def test_a_node_rank_outside_the_job_is_refused():
    with pytest.raises(SlurmError, match="SLURM_NODEID='4' is not below SLURM_NNODES='4'"):
        SlurmJob.from_env(slurm_env(SLURM_NODEID="4"))


def test_a_job_of_no_nodes_is_refused():
    with pytest.raises(SlurmError, match="SLURM_NNODES='0'"):
        SlurmJob.from_env(slurm_env(SLURM_NNODES="0", SLURM_NODEID="0"))


@pytest.mark.parametrize("port", ["0", "65536"])
def test_a_master_port_that_is_no_port_is_refused(port):
    with pytest.raises(SlurmError, match=f"MASTER_PORT='{port}' is not a port"):
        SlurmJob.from_env(slurm_env(MASTER_PORT=port))


def test_an_empty_master_addr_is_refused():
    with pytest.raises(SlurmError, match="MASTER_ADDR"):
        SlurmJob.from_env(slurm_env(MASTER_ADDR=" "))


def test_a_bad_node_list_is_refused_naming_the_variable():
    with pytest.raises(SlurmError, match=r"^SLURM_JOB_NODELIST: bad Slurm nodelist 'host\[5-3\]'"):
        SlurmJob.from_env(slurm_env(SLURM_JOB_NODELIST="host[5-3]"))


def test_a_job_is_frozen():
    job = SlurmJob(nnodes=2, node_rank=0, master_addr="a", master_port=20001)
    with pytest.raises(AttributeError):
        job.nnodes = 3
