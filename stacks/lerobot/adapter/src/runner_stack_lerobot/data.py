"""The plan's data, made locally (generator "reacher-expert"): the scripted expert's episodes recorded as a
LeRobot dataset (LeRobotDataset.create / add_frame / save_episode, no videos) for training, and the held-out
evaluation episodes as the seeds the simulator is reset with. The expert's executed actions carry Gaussian
noise (`action_noise`) while the recorded action is the expert's own, so the demonstrations cover the states a
slightly-off policy visits (DART)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from runner_contracts import DATA_MANIFEST, DataSplit, DomainData, JsonlWriter, sha256_path, write_atomic
from runner_kit.domain import recipe_options

from . import task

GENERATOR = "reacher-expert"
DEFAULTS = {"action_noise": 0.1, "success_distance": 0.02}
TRAIN_DIR, HELDOUT_FILE = "train", "heldout.json"
REPO_ID = "local/reacher-expert"  # a local dataset: nothing is pushed or pulled


def seeds(spec: DomainData) -> tuple[range, range]:
    """The simulator seeds of the training and the held-out episodes: disjoint ranges."""
    base = spec.seed * 1_000_000
    return range(base, base + spec.train), range(base + 500_000, base + 500_000 + spec.heldout)


def features() -> dict[str, dict]:
    vector = lambda names: {"dtype": "float32", "shape": (len(names),), "names": names}  # noqa: E731
    return {"observation.state": vector(task.STATE_NAMES), "observation.environment_state": vector(task.ENVIRONMENT_NAMES),
            "action": vector(["shoulder_torque", "elbow_torque"]), "next.reward": vector(["reward"]),
            "next.success": {"dtype": "bool", "shape": (1,), "names": None}}


def make(spec: DomainData, out: Path) -> list[DataSplit]:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    opts = recipe_options(spec, "lerobot", GENERATOR, DEFAULTS)
    train_seeds, heldout_seeds = seeds(spec)
    root = out / TRAIN_DIR
    shutil.rmtree(root, ignore_errors=True)
    env = task.make(opts["success_distance"])
    dataset = LeRobotDataset.create(REPO_ID, fps=round(1 / env.unwrapped.dt), features=features(), root=root,
                                    robot_type="mujoco-reacher", use_videos=False)
    solved = 0
    for seed in train_seeds:
        noise = np.random.default_rng(seed)
        observation, _ = env.reset(seed=seed)
        done, info = False, {}
        while not done:
            action = task.expert(observation["agent_pos"], observation["environment_state"])[0]
            executed = np.clip(action + noise.normal(0.0, opts["action_noise"], action.shape), -1.0, 1.0)
            following, reward, terminated, truncated, info = env.step(executed)
            dataset.add_frame({"observation.state": observation["agent_pos"].astype(np.float32),
                               "observation.environment_state": observation["environment_state"].astype(np.float32),
                               "action": action.astype(np.float32), "next.reward": np.array([reward], np.float32),
                               "next.success": np.array([info["is_success"]]), "task": task.TASK})
            observation, done = following, terminated or truncated
        solved += bool(info["is_success"])
        dataset.save_episode()
    dataset.finalize()
    env.close()
    # LeRobot writes stats.json's features in set order, which differs between processes (string hashing is
    # randomised): the same statistics, sorted, so that the data job is byte-reproducible.
    stats = root / "meta" / "stats.json"
    write_atomic(stats, json.dumps(json.loads(stats.read_text()), indent=4, sort_keys=True).encode())
    write_atomic(out / HELDOUT_FILE, json.dumps({"env": task.ENV_ID, "first_seed": heldout_seeds.start,
                                                 "episodes": len(heldout_seeds), "success_distance": opts["success_distance"]},
                                                sort_keys=True, indent=1).encode())
    splits = [
        DataSplit(split="train", path=TRAIN_DIR, items=spec.train, sha256=sha256_path(root), generator=GENERATOR,
                  detail=f"LeRobot dataset of {spec.train} scripted-expert episodes of {task.ENV_ID} "
                         f"({dataset.meta.total_frames} frames, {solved} solved; executed actions with noise "
                         f"{opts['action_noise']}), seeds {train_seeds.start}.."),
        DataSplit(split="heldout", path=HELDOUT_FILE, items=spec.heldout, sha256=sha256_path(out / HELDOUT_FILE),
                  generator=GENERATOR, detail=f"{spec.heldout} evaluation episodes of {task.ENV_ID}, simulator seeds "
                                              f"{heldout_seeds.start}..{heldout_seeds.stop - 1}"),
    ]
    with JsonlWriter(out / DATA_MANIFEST) as writer:
        for split in splits:
            writer.write(split)
    return splits


def heldout(data_dir: Path) -> dict:
    return json.loads((data_dir / HELDOUT_FILE).read_text())
