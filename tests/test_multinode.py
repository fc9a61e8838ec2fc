"""Two "nodes" on one machine: two `accelerate launch` commands with the multi-node template
(`--num_machines 2`, machine ranks 0 and 1, rendezvous on 127.0.0.1), one CPU process each over
gloo, sharing one output folder as nodes share a filesystem. They must train as one 2-rank job:
the same losses and samples as the 2-process single-node run of the same command. Both templates:
DDP (through accelerate's CPU path) and FSDP2 (through the CPU harness, from the fixture's weights)."""

from __future__ import annotations

import socket
import subprocess

from train_extras.resume import checkpoint
import pytest

from conftest import ACCELERATE, HARNESS, ROOT, TWO_RANK_ARGS, Run, launch_env, probe_dir, warm_workers_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# template -> (the single-node fixture run it must equal, how its CPU processes run, distributed type)
TEMPLATES = {
    "multi_node_ddp.yaml": ("train.py/ddp.yaml", {"ACCELERATE_USE_CPU": "true"}, "MULTI_CPU"),
    "multi_node_fsdp.yaml": ("train.py/fsdp.yaml", HARNESS, "FSDP"),
}


@pytest.mark.parametrize("template", TEMPLATES)
def test_two_nodes_train_like_one_node_with_two_processes(tmp_path, hf_home, two_process_runs, initial_model,
                                                          template):
    pair, cpu_env, distributed_type = TEMPLATES[template]
    out = tmp_path / "shared_output"
    port = str(free_port())
    args = TWO_RANK_ARGS + ["--save_every", "30", "--sample_length", "8", "--output_dir", str(out)]  # as the fixture
    if distributed_type == "FSDP":
        args += ["--model_name_or_path", str(initial_model)]  # as the fixture
    # each node's launcher and torchrun for real, its worker forked warm (tests/warm_launch.py)
    env = warm_workers_env({**launch_env(hf_home), **cpu_env, "ACCELERATE_RECIPES_PROBE_DIR": str(probe_dir(out))})
    nodes = []
    for machine_rank in (0, 1):
        cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / template),
               "--num_machines", "2", "--machine_rank", str(machine_rank), "--num_processes", "2",
               "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               "--num_cpu_threads_per_process", "1", "--mixed_precision", "no", str(ROOT / "recipes" / "train.py"),
               *args]
        nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        results = [node.communicate(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (stdout, stderr) in zip(nodes, results):
        assert node.returncode == 0, stdout[-2000:] + stderr[-4000:]

    multi_run, single_run = Run(out, None), two_process_runs(pair)
    multi_node, single_node = multi_run.summary, single_run.summary
    assert multi_node["setup"]["distributed_type"] == distributed_type
    assert multi_node["setup"]["world_size"] == 2
    assert [r["rank"] for r in multi_run.parameters_per_rank] == [0, 1]
    assert multi_node["losses"] == single_node["losses"]  # every step's loss, lr and grad norm, bitwise
    assert multi_run.batches == single_run.batches
    assert multi_node["eval"] == single_node["eval"]
    # the checkpoints both nodes wrote into the shared folder are complete (every file, its size),
    # with each rank's RNG state
    for step in (30, 60):
        meta = checkpoint.verify(out / "checkpoints" / f"step_{step}")
        assert meta["step"] == step and meta["setup"]["world_size"] == 2
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(meta["files"])


@pytest.mark.quick
def test_a_hostname_on_a_loopback_address_stops_a_job_across_machines(monkeypatch):
    """gloo binds what the hostname resolves to: 127.0.1.1 on many images, which no other machine can
    reach. A job across machines stops with one line naming GLOO_SOCKET_IFNAME; one on one host runs."""
    import socket

    from common.config import ConfigError
    from train_extras.data import at_scale

    addresses = {"gpu-node-7": "127.0.1.1", "10.0.0.1": "10.0.0.1", "127.0.0.1": "127.0.0.1"}
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")
    monkeypatch.setattr(socket, "gethostbyname", addresses.__getitem__)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    with pytest.raises(ConfigError, match="hostname gpu-node-7 resolves to 127.0.1.1, a loopback address: gloo would "
                                          "bind it.* set GLOO_SOCKET_IFNAME"):
        at_scale.check_gloo_address()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # the interface named: gloo binds that
    at_scale.check_gloo_address()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # every machine on this host (the tests' drills)
    at_scale.check_gloo_address()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "8")  # one machine
    at_scale.check_gloo_address()
