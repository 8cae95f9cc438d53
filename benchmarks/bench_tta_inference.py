"""Inference cost and Dice of test-time augmentation on the synthetic bundle's trained model.

In one run, on the same test volumes: seconds per volume of plain inference, nnU-Net-style 8-flip
mirroring, and learned TEA with z = 4 and z = 8 (top ops of the run's TEA policy), the ratios of the
learned TEA to mirroring, and the mean Dice of each on the synthetic test split.

Needs a trained run of the default bundle (its checkpoint and policies.json):

    python -m monai.bundle run --config_file bundles/synthetic_lesion/configs/train.yaml
    python benchmarks/bench_tta_inference.py --run-dir runs/synthetic_lesion --dataset-dir data/synthetic_lesion
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from monai.bundle import ConfigParser
from monai.data import load_decathlon_datalist
from monai.inferers import SlidingWindowInferer
from synthetic_bundle import SYNTHETIC_TRAIN  # this folder's path to the synthetic bundle

from jcsaug.engine import latest_checkpoint
from jcsaug.evaluation import evaluate_cases
from jcsaug.inference import MirrorTTAInferer, NoTTAInferer, TEAInferer, load_tea_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/synthetic_lesion")
    parser.add_argument("--dataset-dir", default="data/synthetic_lesion")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the test volumes")
    args = parser.parse_args()

    config = ConfigParser()
    config.read_config(str(SYNTHETIC_TRAIN))
    config["dataset_dir"], config["output_dir"] = args.dataset_dir, args.run_dir
    network = config.get_parsed_content("network_def")
    checkpoint = latest_checkpoint(args.run_dir)
    network.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["network"])
    network.eval()
    load = config.get_parsed_content("load")
    datalist = Path(args.dataset_dir) / "dataset.json"
    cases = load_decathlon_datalist(datalist, data_list_key="test", base_dir=args.dataset_dir)
    volumes = [load(c)["image"].unsqueeze(0) for c in cases]

    sw = SlidingWindowInferer(roi_size=config["patch_size"], sw_batch_size=8, overlap=0.25, mode="gaussian")
    tea = load_tea_policy(Path(args.run_dir) / "policies.json")
    inferers = {
        "none": NoTTAInferer(sw),
        "mirror (8 flips)": MirrorTTAInferer(sw),
        "learned TEA z=4": TEAInferer.from_policy(tea, 4, sw),
        "learned TEA z=8": TEAInferer.from_policy(tea, 8, sw),
    }
    times: dict[str, list[float]] = {name: [] for name in inferers}
    with torch.no_grad():
        for volume in volumes[:1]:  # warm-up
            for inferer in inferers.values():
                inferer(volume, network)
        for _ in range(args.repeats):
            for name, inferer in inferers.items():  # interleaved: load changes hit every method alike
                start = time.perf_counter()
                for volume in volumes:
                    inferer(volume, network)
                times[name].append((time.perf_counter() - start) / len(volumes))
    metrics = evaluate_cases(network, cases, load, inferers, config["num_classes"], progress=False)
    mirror = statistics.median(times["mirror (8 flips)"])
    print(f"checkpoint {checkpoint}; {len(volumes)} test volumes of {tuple(volumes[0].shape[2:])}; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'method':<20} {'s/volume':>9} {'/ mirror':>9} {'mean Dice':>10}")
    for name in inferers:
        t = statistics.median(times[name])
        print(f"{name:<20} {t:>9.3f} {t / mirror:>9.2f} {metrics[name]['mean_dice']:>10.4f}")


if __name__ == "__main__":
    main()
