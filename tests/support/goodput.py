"""Goodput records made up for tests: attempt records, and damaged ones beside a good pair."""

from __future__ import annotations

import json
from pathlib import Path


T0 = 1_000_000.0


def attempt(launch: int, number: int, first_step: float, updated: float, start_step: int, steps_done: int, **extra):
    """A made-up attempt record: step_s spread evenly over its steps, a point every 5 steps."""
    step_s = extra.pop("step_s", (updated - first_step) * 0.8)
    per_step = step_s / max(1, steps_done - start_step)
    points = [[s, per_step * (s - start_step)] for s in range(start_step + 1, steps_done + 1) if s % 5 == 0]
    record = {
        "launch": launch,
        "attempt": number,
        "started": first_step - 3,
        "first_step": first_step,
        "start_step": start_step,
        "updated": updated,
        "steps_done": steps_done,
        "step_s": step_s,
        "checkpoint_stall_s": 0.1 * (updated - first_step),
        "evaluation_s": 0.05 * (updated - first_step),
        "points": points,
        "final": False,
    }
    return record | extra


DAMAGED = {  # file name -> its text: JSON each, but no record of its kind
    "launch_2.json": '{"launch": 2, "attempt": 0}',  # no "started", no "attempts"
    "launch_3.json": "null",
    "launch_4.json": '{"launch": 4, "started": "yesterday", "attempts": []}',
    "launch_1_attempt_1.json": json.dumps(attempt(1, 1, T0 + 10, T0 + 20, 0, 10) | {"step_s": None}),
    "launch_1_attempt_2.json": json.dumps(attempt(1, 2, T0 + 10, T0 + 20, 0, 10) | {"step_s": float("nan")}),
    "launch_1_attempt_3.json": json.dumps(attempt(1, 3, T0 + 10, T0 + 20, 0, 10) | {"steps_done": "10"}),
    "launch_1_attempt_4.json": json.dumps(attempt(1, 4, T0 + 10, T0 + 20, 0, 10) | {"points": [["5", 1.0]]}),
    "launch_1_attempt_5.json": json.dumps(attempt(7, 5, T0 + 10, T0 + 20, 0, 10)),  # says it is launch 7's
}


def damaged_records(run_dir: Path) -> tuple[dict, dict]:
    """A good launch record and attempt record in run_dir/goodput/, beside the DAMAGED ones."""
    launch = {"launch": 1, "started": T0, "ended": T0 + 112, "attempts": [{"attempt": 0, "spawned": T0 + 1, "ended": T0 + 111}]}
    good = attempt(1, 0, T0 + 10, T0 + 110, 0, 100, final=True)
    records = run_dir / "goodput"
    records.mkdir(parents=True)
    (records / "launch_1.json").write_text(json.dumps(launch))
    (records / "launch_1_attempt_0.json").write_text(json.dumps(good))
    for name, text in DAMAGED.items():
        (records / name).write_text(text)
    return launch, good


def unreadable_goodput_dir(monkeypatch) -> None:
    """Listing any goodput/ fails as for a directory without read permission (chmod does not stop root)."""
    iterdir = Path.iterdir

    def refusing(self: Path):
        if self.name == "goodput":
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)

    monkeypatch.setattr(Path, "iterdir", refusing)
