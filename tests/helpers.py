"""Small synthetic volumes and networks shared by the engine tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from ignite.engine import Engine
from monai.bundle import ConfigParser
from monai.networks.nets import UNet

from jcsaug.data import make_synthetic_dataset
from jcsaug.engine import get_loss
from jcsaug.engine.losses import per_sample_training_losses
from preloaded import run_module

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
CONFIGS = BUNDLES / "synthetic_lesion" / "configs"


def bundle_parser(bundle: str, *extra: str, **overrides) -> ConfigParser:
    """A bundle's ``train.yaml`` merged with the ``extra`` configs of its folder, its ``metadata.json`` and the
    ``overrides``, not yet parsed: what ``python -m monai.bundle run`` reads."""
    folder = BUNDLES / bundle / "configs"
    parser = ConfigParser()
    parser.read_config([str(folder / "train.yaml"), *(str(folder / e) for e in extra)])
    parser.read_meta(str(folder / "metadata.json"))
    parser.update(overrides)
    return parser


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


#: a target shift no name stands for (a quarter turn about the longitudinal axis, a mirror and a blur), as a mapping
COMBINED_SHIFT = {"long_axis": 1, "mirror_axis0": True, "blur": [0.8, 1.0]}
#: the same shift as ``dataset.json`` records it (every key of a target shift)
COMBINED_SHIFT_RECORDED = {
    "long_axis": 1,
    "mirror_axis0": True,
    "gamma": None,
    "blur": [0.8, 1.0],
    "scale": None,
    "noise": None,
    "low_resolution": None,
}


def retaining_stats(bent: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """``bent`` (an image's intensity curve bent by a gamma) moved back to ``image``'s mean and standard deviation:
    the expected output of the catalogues' gamma, written out by hand."""
    return (bent - bent.mean()) / bent.std() * image.std() + image.mean()


def synthetic_tra_policy(preset: str = "nnunet", num_groups: int = 2):
    """A TRA policy of the synthetic bundle's own catalogue (its ``tra_catalogue``), as its runs build them."""
    import yaml

    from jcsaug.policy import make_tra_policy

    catalogue = yaml.safe_load((CONFIGS / "train.yaml").read_text())["tra_catalogue"]
    return make_tra_policy(preset, num_groups, catalogue=catalogue)


def spy_posthoc_tea_updater(monkeypatch) -> dict:
    """The keyword arguments the post-hoc TEA learning builds its ``TEAPolicyUpdater`` with, filled once it does."""
    import jcsaug.engine.posthoc as posthoc

    seen: dict = {}
    real = posthoc.TEAPolicyUpdater

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(posthoc, "TEAPolicyUpdater", spy)
    return seen


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (a script folder, not a package) as a module, with the folder on ``sys.path``
    as when the script runs (a benchmark may import a sibling's helpers)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Hides the GPUs from child processes that must run on the CPU whatever the machine (gloo ranks). ignite's
#: distributed context calls ``torch.cuda.set_device(local_rank)`` and moves its own collectives to the current GPU
#: whenever CUDA is visible: on a one-GPU machine, rank 1 of two gloo ranks then fails and rank 0 waits for it; a
#: forked child cannot use a CUDA that its parent initialised.
NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def epoch_orders(sampler, epochs) -> list[list[int]]:
    """The indices a sampler with ``set_epoch`` (e.g. a ``DistributedSampler``) yields at each of ``epochs``."""
    orders = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def env_without_gpus(**extra: str) -> dict[str, str]:
    """This process's environment for a CPU-only child process: :data:`NO_GPUS` and ``extra`` on top."""
    return {**os.environ, **NO_GPUS, **extra}


def tiny_unet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return UNet(3, 1, 2, channels=(4, 8), strides=(2,), num_res_units=0)


class TwoHeadNet(torch.nn.Module):
    """A deep-supervision network in miniature: in training mode ``(head, aux(head))`` (two full-resolution heads
    sharing the trunk, as ``NnUNetDynUNet`` returns), in eval mode the first head alone."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.trunk = tiny_unet(seed)
        self.aux = torch.nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor):
        out = self.trunk(x)
        return (out, self.aux(torch.tanh(out))) if self.training else out


def lesion_batch(n: int = 4, size: int = 16, seed: int = 0, tra_policy=None) -> dict:
    """Bright cubes on noise; even samples centred on the lesion (group 1), odd ones on background."""
    rng = np.random.RandomState(seed)
    img = torch.as_tensor(rng.randn(n, 1, size, size, size).astype(np.float32)) * 0.5
    lab = torch.zeros(n, 1, size, size, size)
    c = size // 2
    for i in range(n):
        r = int(rng.randint(2, 4))
        lo, hi = (c - r, c + r) if i % 2 == 0 else (0, 2 * r)
        lab[i, 0, lo:hi, lo:hi, lo:hi] = 1
        img[i, 0, lo:hi, lo:hi, lo:hi] += 2.0
    batch = {"image": img, "label": lab, "class_group": torch.tensor([1 - i % 2 for i in range(n)])}
    if tra_policy is not None:
        groups = batch["class_group"].tolist()
        batch["tra_ops"] = torch.as_tensor(np.stack([tra_policy.sample_ops(g, rng) for g in groups]))
    return batch


def paired_batch(image: torch.Tensor, label: torch.Tensor) -> dict:
    """A two-sample training batch as ``TRACascaded(counterfactuals=2)`` makes it for a ``[3, 2]`` policy: the drawn
    ops, class groups, each sample's two counterfactual ops and copies (here the samples themselves)."""
    return {
        "image": image, "label": label, "tra_ops": torch.tensor([[1, 0], [2, 1]]), "class_group": torch.tensor([0, 1]),
        "tra_cf_ops": torch.tensor([[[0, 0], [1, 1]], [[0, 0], [1, 0]]]),
        "image_cf": image[:, None].expand(2, 2, *image.shape[1:]),
        "label_cf": label[:, None].expand(2, 2, *label.shape[1:]),
    }  # fmt: skip


def train_engine(net: torch.nn.Module, opt: torch.optim.Optimizer, loss: str = "ce+dice", train: bool = True) -> Engine:
    """A plain Ignite engine running a user's own supervised step (or no step with ``train=False``)."""
    loss_fn = get_loss(loss)

    def step(engine, batch):
        if not train:
            return 0.0
        net.train()
        opt.zero_grad()
        value = per_sample_training_losses(loss_fn, net(batch["image"]), batch["label"]).mean()
        value.backward()
        opt.step()
        return value.item()

    return Engine(step)


def paired_tra_training(start: float = 0.0) -> tuple:
    """``(policy, engine, updater)``: a plain Ignite engine training a tiny U-Net, and a paired-estimator updater of
    its uniform two-group TRA policy every 2nd iteration after a warm-up of ``start`` (call after
    ``set_determinism``). The runs that check where the counterfactual copies are made build on it."""
    from jcsaug.engine import TRAPolicyUpdater
    from jcsaug.policy import make_tra_policy

    policy = make_tra_policy("uniform", num_groups=2)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = train_engine(net, opt)
    updater = TRAPolicyUpdater(policy, net, [lesion_batch(4, seed=99)], opt, lr=0.05, estimator="paired",
                               update_every=2, start=start)  # fmt: skip
    return policy, engine, updater


#: a ``filterwarnings`` mark's filter for the bundle's word that it keeps :func:`small_dataset`'s volumes (made with
#: other settings than its own): expected wherever a test runs a bundle on them, not a finding
SMALL_DATASET_KEPT = "ignore:.*exists but was not made with:UserWarning"


def small_dataset(tmp_path: Path) -> None:
    """A smaller dataset than the bundle's default, generated first: the bundle then reuses it."""
    make_synthetic_dataset(tmp_path / "data", num_train=4, num_val=2, num_test=2, shape=(32, 32, 32), progress=False)


def bundle_run_args(folder: Path, *configs: str) -> list[str]:
    """The arguments of ``python -m monai.bundle`` that run the ``configs`` of a bundle's configs ``folder`` (merged
    in order) with its ``metadata.json`` and ``logging.conf``, as its README runs them; overrides follow."""
    files = [str(folder / c) for c in configs]
    config_file = files[0] if len(files) == 1 else str(files)
    return ["run", "--config_file", config_file, "--meta_file", str(folder / "metadata.json"),
            "--logging_file", str(folder / "logging.conf")]  # fmt: skip


def run_bundle(tmp_path: Path, *configs: str, check: bool = True, **overrides) -> subprocess.CompletedProcess:
    """``python -m monai.bundle run`` of the default bundle's ``configs`` with ``overrides`` (forked from the preloaded
    test server: :mod:`preloaded`); ``check``: assert rc 0."""
    args = bundle_run_args(CONFIGS, *configs)
    # patches smaller than small_dataset's 32³ volumes, so crops centre on both classes (both class groups); no
    # figures unless a test asks (plots=True): drawing them is a few seconds per run, and tests/test_viz.py tests them
    defaults = {"dataset_dir": tmp_path / "data", "output_dir": tmp_path / "run", "patch_size": "[24,24,24]",
                "plots": False}  # fmt: skip
    overrides = {**defaults, **overrides}
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    result = run_module("monai.bundle", args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0 or not check, result.stdout[-3000:] + result.stderr[-3000:]
    return result
