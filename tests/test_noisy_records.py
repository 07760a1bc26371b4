"""The noisy table's records file: runs measured elsewhere are kept, a local run replaces the line of its own
rate, level, row and seed, and the table reads the union (scripts/experiments/noisy_table.py)."""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "experiments"))
import noisy_table  # noqa: E402


def test_local_runs_replace_their_own_line_and_keep_the_others(tmp_path):
    path = tmp_path / "records.json"
    elsewhere = [
        {"rate": 0.2, "level": "caption", "row": "bow", "build": "old", "seed": 0, "test": {"rsum": 202.0}},
        {"rate": 0.2, "level": "caption", "row": "bow", "build": "old", "seed": 1, "test": {"rsum": 205.6}},
        {"rate": 0.4, "level": "image", "row": "bow", "build": "old", "seed": 0, "test": {"rsum": 165.2}},
    ]
    path.write_text(json.dumps(elsewhere))
    local = {(0.2, "bow"): [{"seed": 1, "test": {"rsum": 207.5}, "train_time_s": 9.0}]}

    merged = noisy_table.merge_records(path, local, "caption", "new")

    assert [(r["rate"], r["seed"], r["build"], r["test"]["rsum"]) for r in merged] == [
        (0.2, 0, "old", 202.0),
        (0.2, 1, "new", 207.5),
        (0.4, 0, "old", 165.2),
    ]
    assert "train_time_s" not in merged[1]  # only the table's keys are kept
    found = noisy_table.from_records(merged, [0.2], [0, 1, 2], "caption")
    assert sorted(r["test"]["rsum"] for r in found[(0.2, "bow")]) == [202.0, 207.5]
    assert noisy_table.from_records(merged, [0.2], [0], "image") == {}


def test_records_keep_the_machine_a_run_started_on(tmp_path):
    machine = {"cpu": "Some CPU", "cpu_kernels": "AVX2", "cores": 2, "torch": "2.13.0+cpu", "device": "cpu"}
    local = {(0.2, "vse_infty_bigru"): [{"seed": 0, "test": {"rsum": 150.0}, "machine": machine}]}
    merged = noisy_table.merge_records(tmp_path / "records.json", local, "caption", "b")
    assert merged == [
        {"rate": 0.2, "level": "caption", "row": "vse_infty_bigru", "build": "b", "seed": 0}
        | {"test": {"rsum": 150.0}, "machine": machine}
    ]


def test_build_of_a_set_whose_manifest_records_no_hash_is_its_training_features_sha256(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "vsekit-wesnoth/1"}))
    frames = bytes(range(256)) * 1000
    (tmp_path / "train_frames.npy").write_bytes(frames)
    assert noisy_table.build_of(tmp_path) == hashlib.sha256(frames).hexdigest()[:12]
    recorded = {"files_sha256": {"train_ims.npy": "abcdef0123456789"}}
    (tmp_path / "manifest.json").write_text(json.dumps(recorded))
    assert noisy_table.build_of(tmp_path) == "abcdef012345"  # the manifest's, not re-hashed
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "train_frames.npy").unlink()
    assert noisy_table.build_of(tmp_path) == "unknown"
