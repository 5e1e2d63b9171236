"""Whether the Hub is offline is read as huggingface_hub reads it: HF_HUB_OFFLINE (or, where that is
unset or empty, TRANSFORMERS_OFFLINE) is true for 1, ON, YES, TRUE in any case and false for
anything else, so HF_HUB_OFFLINE=0 is online and is not reported as "HF_HUB_OFFLINE is set"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pretrain.data.hub_client import offline_error, offline_variable

# (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE), None: unset.
SETTINGS = [
    ("0", None),
    ("false", None),
    ("", None),
    ("no", None),
    ("off", None),
    ("2", None),
    ("1", None),
    ("yes", None),
    ("ON", None),
    ("True", None),
    (None, None),
    (None, "1"),
    ("", "yes"),
    ("0", "1"),  # HF_HUB_OFFLINE decides when it is set
    (None, "0"),
]


def environment(hub: str | None, transformers: str | None) -> dict[str, str]:
    values = {"HF_HUB_OFFLINE": hub, "TRANSFORMERS_OFFLINE": transformers}
    return {name: value for name, value in values.items() if value is not None}


def huggingface_hubs_reading(settings: list[tuple[str | None, str | None]]) -> list[bool]:
    """constants.HF_HUB_OFFLINE as huggingface_hub computes it on import, for each setting, in one
    child process (reloading its constants here would change them for every other test)."""
    script = """
import importlib, json, os, sys
from huggingface_hub import constants
answers = []
for hub, transformers in json.loads(sys.argv[1]):
    for name, value in (("HF_HUB_OFFLINE", hub), ("TRANSFORMERS_OFFLINE", transformers)):
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    answers.append(importlib.reload(constants).HF_HUB_OFFLINE)
print(json.dumps(answers))
"""
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(settings)], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout)


def test_offline_is_read_as_huggingface_hub_reads_it():
    ours = [offline_variable(environment(*setting)) is not None for setting in SETTINGS]
    assert ours == huggingface_hubs_reading(SETTINGS)


@pytest.mark.parametrize("value", ["0", "false", "", "no"])
def test_hub_offline_false_or_empty_is_online(value):
    assert offline_variable({"HF_HUB_OFFLINE": value}) is None


@pytest.mark.parametrize("value", ["1", "yes", "ON", "TRUE", "true"])
def test_hub_offline_true_in_any_case_is_offline(value):
    assert offline_variable({"HF_HUB_OFFLINE": value}) == "HF_HUB_OFFLINE"


def test_transformers_offline_counts_only_where_hub_offline_is_unset_or_empty():
    assert offline_variable({"TRANSFORMERS_OFFLINE": "1"}) == "TRANSFORMERS_OFFLINE"
    assert offline_variable({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"}) == "TRANSFORMERS_OFFLINE"
    assert offline_variable({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}) is None


def test_hub_offline_zero_is_not_reported_as_the_reason_a_file_is_missing(monkeypatch):
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    message = str(offline_error("dataset owner/name", "`hf download owner/name`", "train on local files"))
    assert "(offline: no connection)" in message and "HF_HUB_OFFLINE" not in message


@pytest.mark.parametrize(("variable", "value"), [("HF_HUB_OFFLINE", "yes"), ("TRANSFORMERS_OFFLINE", "1")])
def test_the_variable_that_puts_the_hub_offline_is_named_with_its_value(monkeypatch, variable, value):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv(variable, value)
    message = str(offline_error("dataset owner/name", "`hf download owner/name`", "train on local files"))
    assert f"(offline: {variable}={value})" in message and f"or unset {variable};" in message
