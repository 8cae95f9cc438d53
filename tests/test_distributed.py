"""Distributed (DDP) training on CPU with gloo: the policies stay identical on every rank, and the bundle's
multi-GPU config runs under torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
import torch.distributed as dist
from ignite.engine import Events
from monai.engines import SupervisedTrainer
from monai.losses import DiceCELoss
from torch.nn.parallel import DistributedDataParallel

from helpers import CONFIGS, env_without_gpus, lesion_batch, tiny_unet
from jcsaug.data import make_synthetic_dataset
from jcsaug.engine import TEAPolicyUpdater, TRAPolicyUpdater, shutdown_distributed
from jcsaug.policy import make_tea_policy, make_tra_policy

ITERATIONS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(local_rank: int, out_dir: str) -> None:
    """One rank: DDP-wrapped tiny U-Net, joint TRA (with the look-ahead) + TEA learning on this rank's own data."""
    torch.set_num_threads(1)
    rank = idist.get_rank()
    net = DistributedDataParallel(tiny_unet(seed=rank))  # DDP broadcasts rank 0's weights
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    tra, tea = make_tra_policy("uniform", num_groups=2), make_tea_policy()
    initial = {"tra": tra.logits.detach().clone(), "tea": tea.logits.detach().clone()}
    data = [lesion_batch(4, seed=10 * rank + i, tra_policy=tra) for i in range(ITERATIONS)]
    if rank == 1:  # one class group only: rank 1 skips this TRA update but still joins the all-reduce
        data[1]["class_group"] = torch.ones_like(data[1]["class_group"])
    val = [lesion_batch(4, seed=100 + 10 * rank + i) for i in range(2)]
    tra_updater = TRAPolicyUpdater(tra, net, val, opt, lr=0.05, tea_policy=tea, seed=0, lookahead=4)
    tea_updater = TEAPolicyUpdater(tea, net, val, lr=0.05, num_copies=4, seed=0)
    trainer = SupervisedTrainer(
        device=torch.device("cpu"), max_epochs=1, train_data_loader=data, network=net, optimizer=opt,
        loss_function=DiceCELoss(to_onehot_y=True, softmax=True), train_handlers=[tra_updater, tea_updater],
    )  # fmt: skip
    records = []

    @trainer.on(Events.ITERATION_COMPLETED)  # attached after the updaters: runs after both updates
    def compare(engine):
        record = {"iteration": engine.state.iteration}
        for name, policy in (("tra", tra), ("tea", tea)):
            logits = policy.logits.detach().clone()
            gathered = idist.all_gather(logits.unsqueeze(0))  # [world, groups, logits]
            record[f"{name}_identical"] = all(torch.equal(g, logits) for g in gathered)
            record[f"{name}_changed"] = not torch.equal(logits, initial[name])
        records.append(record)

    trainer.run()
    params = torch.cat([p.detach().reshape(-1) for p in net.module.parameters()])
    seeds = idist.all_gather(
        torch.tensor([[tra_updater.generator.initial_seed(), tea_updater.generator.initial_seed()]])
    )
    result = {
        "records": records,
        "updates": [tra_updater.updates, tea_updater.updates],
        "skipped": [tra_updater.skipped, tea_updater.skipped],
        "model_identical": all(torch.equal(g, params) for g in idist.all_gather(params.unsqueeze(0))),
        "seeds": seeds.tolist(),
        "state_keys": sorted(tra_updater.state_dict()),
        "curvature": tra_updater.lookahead.curvature,  # tracked by the look-ahead: finite once it ran
    }
    # gloo's worker threads must stop before the interpreter does (else SIGABRT at exit): with the DDP wrapper
    # released, destroying the group (ignite's job here) joins them
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_distributed(net, destroy=False)


@pytest.mark.usefixtures("hide_gpus")  # the spawned ranks run on the CPU also where CUDA is available
def test_policies_stay_identical_on_two_gloo_ranks(tmp_path):
    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=_free_port()) as parallel:
        parallel.run(_train_rank, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert [r["iteration"] for r in result["records"]] == list(range(1, ITERATIONS + 1))
        for record in result["records"]:  # bit-identical after every update, and learned
            assert record["tra_identical"] and record["tea_identical"], (rank, record)
            assert record["tra_changed"] and record["tea_changed"], (rank, record)
        assert result["model_identical"]
        assert {"policy", "optimizer", "generator", "lookahead"} <= set(result["state_keys"])
        assert result["curvature"] > 0, result["curvature"]  # NaN (never ran) fails too
    assert results[1]["skipped"][0] == 1 and results[0]["skipped"][0] == 0  # rank 1 skipped one TRA update...
    assert results[0]["updates"] == results[1]["updates"] == [ITERATIONS, ITERATIONS]  # ...and stepped anyway
    seeds = results[0]["seeds"]  # every rank draws its own ops
    assert seeds[0][0] != seeds[1][0] and seeds[0][1] != seeds[1][1]


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _shutdown_rank(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    net = DistributedDataParallel(torch.nn.Linear(3, 2))
    net(torch.randn(4, 3)).sum().backward()
    dist.all_reduce(torch.ones(3))  # a CPU collective whatever the machine (ignite's would move it to a GPU)
    before = _native_threads()
    shutdown_distributed(net)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([before, _native_threads(), dist.is_initialized()]))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_shutdown_distributed_joins_the_process_group_threads(tmp_path):
    """The SIGABRT at exit: gloo threads alive while the interpreter finalises. After shutdown they are gone."""
    torch.multiprocessing.spawn(_shutdown_rank, args=(str(tmp_path),), nprocs=2)
    for rank in range(2):
        before, after, initialised = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not initialised
        assert after <= before - 2, (rank, before, after)  # gloo's two worker threads and its transport loop


def test_bundle_multi_gpu_config_runs_under_torchrun(tmp_path):
    make_synthetic_dataset(tmp_path / "data", num_train=4, num_val=2, num_test=2, shape=(32, 32, 32), progress=False)
    config_file = str([str(CONFIGS / "train.yaml"), str(CONFIGS / "multi_gpu_train.yaml")])
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
            "-m", "monai.bundle", "run", "--config_file", config_file,
            "--meta_file", str(CONFIGS / "metadata.json"), "--logging_file", str(CONFIGS / "logging.conf"),
            "--dataset_dir", str(tmp_path / "data"), "--output_dir", str(tmp_path / "run"),
            "--max_epochs", "1", "--epoch_length", "2", "--num_workers", "0",
            "--tra_update_every", "1", "--tea_update_every", "1",
            "--patch_size", "[16, 16, 16]", "--accelerator", "cpu"]  # fmt: skip
    # (--accelerator cpu and the GPUs hidden: two gloo ranks on the CPU also where CUDA is available, e.g. a
    # single-GPU machine)
    # (patches smaller than the volumes, so that a batch holds both class groups and TRA updates happen)
    env = env_without_gpus(OMP_NUM_THREADS="1")
    result = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "policies.json").is_file() and (run / "metrics.json").is_file()
    assert (run / "checkpoint_final_iteration=2.pt").is_file()
    log = result.stdout + result.stderr
    updates = json.loads((run / "metrics.json").read_text())["policy_updates"]
    for name in ("TRA", "TEA"):  # both policies were updated (rank 0 logs; the other ranks log warnings only)
        assert updates[name]["updates"] == 2, updates
        assert log.count(f"epoch 1: {name} policy 2 updates") == 1, log[-3000:]
    for path in (run / "checkpoint_final_iteration=2.pt", run / "resume.pt"):  # saved unwrapped from DDP
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint["network"] and not any(k.startswith("module.") for k in checkpoint["network"]), path
    ranks = checkpoint["rank_states"]  # resume.pt: rank 1's own updater states beside rank 0's, for an exact resume
    assert ranks["world_size"] == 2 and set(ranks["states"]) == {"tra_updater", "tea_updater"}
    for name, states in ranks["states"].items():
        assert not torch.equal(states[1]["generator"], checkpoint[name]["generator"]), name


def test_rank_device_picks_the_local_gpu_or_says_why_not(monkeypatch):
    from jcsaug.engine import rank_device

    assert rank_device("cpu", local_rank=3) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device("auto", local_rank=1) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        rank_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_device() == torch.device("cuda:0")
    monkeypatch.setenv("LOCAL_RANK", "1")  # two processes on a one-GPU machine: the failure CUDA machines saw
    with pytest.raises(RuntimeError, match=r"local rank 1 has no GPU: 1 CUDA device\(s\).*--accelerator cpu"):
        rank_device()
    with pytest.raises(ValueError, match="accelerator must be one of"):
        rank_device("tpu")
