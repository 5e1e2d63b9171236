"""pretrain/config/loading.py: how the layers of --set apply."""

from __future__ import annotations

import pytest

from pretrain import config as cfg


@pytest.mark.parametrize("order", ["float8 first", "use_amp first"])
def test_a_check_between_two_keys_sees_every_set_whatever_their_order(order):
    sets = ["training.float8=emulate", "training.use_amp=true"]
    config = cfg.resolve(preset="debug", sets=sets if order == "float8 first" else sets[::-1])
    assert (config.training.float8, config.training.use_amp) == ("emulate", True)


def test_a_later_set_of_one_key_changes_only_that_key_of_a_group_set_before_it():
    config = cfg.resolve(preset="debug", sets=['model.moe={"num_experts": 4, "top_k": 2}', "model.moe.top_k=1"])
    assert (config.model.moe.num_experts, config.model.moe.top_k) == (4, 1)


def test_the_last_set_of_a_key_wins_and_a_bad_value_is_refused_in_one_line():
    assert cfg.resolve(preset="debug", sets=["training.max_steps=3", "training.max_steps=5"]).training.max_steps == 5
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.resolve(preset="debug", sets=["training.float8=emulate"])  # the debug preset runs fp32
    assert "training.use_amp" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("value", ["maybe", "1", '"true"', "emulat"])
def test_a_value_that_is_neither_a_boolean_nor_a_name_of_its_union_lists_them_all(value):
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.resolve(preset="debug", sets=["training.use_amp=true", f"training.float8={value}"])
    assert "training.float8: " in str(caught.value) and 'is not one of true, false, "emulate"' in str(caught.value)
    assert "expected true or false" not in str(caught.value)


def test_a_json_file_gives_the_same_error_and_a_typo_gets_the_closest_name():
    with pytest.raises(cfg.ConfigError, match=r'1 \(an integer\) is not one of true, false, "emulate"'):
        cfg.apply_overrides(cfg.debug(), {"training": {"float8": 1}}, "run.json")
    with pytest.raises(cfg.ConfigError, match='did you mean "emulate"'):
        cfg.resolve(preset="debug", sets=["training.float8=emulat"])


def test_float8_without_autocast_says_where_each_float8_value_can_run():
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.resolve(preset="debug", sets=["training.float8=true"])  # on a CPU, the first hint must not lead to a second refusal
    assert "training.use_amp=true" in str(caught.value)
    assert "compute capability 8.9+" in str(caught.value) and '"emulate" runs anywhere' in str(caught.value)
