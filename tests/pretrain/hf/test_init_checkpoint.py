"""The --init-from checkpoint's files as pretrain/hf/init_checkpoint.py checks them before any
worker starts: an index names only files beside it, a file that is not safetensors is refused
without its bytes said as a number, and the command that fetches a Hub model keeps its revision."""

from __future__ import annotations

import json

import pytest

from support.runs import assert_one_line_error
from pretrain.hf.init_checkpoint import InitFromError, find_checkpoint
from pretrain.hf.transformers_form import expected_hf_shapes
from test_init_from import DEBUG, SEQ, run_pretrain, write_checkpoint, model_cache  # noqa: F401 (a fixture)

PASSWD = b"root:x:0:0:root:/root:/bin/bash\n"
LEAKED = str(int.from_bytes(PASSWD[:8], "little"))
"""What a file's first 8 bytes read as a header length: text, never to be said as a number."""


@pytest.mark.parametrize("entry", ["../passwd", "{passwd}", "sub/model.safetensors", ".."])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused_without_opening_it(tmp_path, capsys, entry):
    (tmp_path / "passwd").write_bytes(PASSWD)
    write_checkpoint(tmp_path / "ckpt", DEBUG)
    entry = entry.format(passwd=tmp_path / "passwd")
    weight_map = dict.fromkeys(expected_hf_shapes(DEBUG, SEQ), "model.safetensors") | {"model.norm.weight": entry}
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    result = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"))

    assert_one_line_error(
        result,
        f"model.safetensors.index.json names {entry!r} for model.norm.weight, which is not a file beside it",
        "give a checkpoint whose index names only files in its own directory",
        prefix=f"pretrain: error: training.init_from: {tmp_path / 'ckpt'}: ",
    )
    assert LEAKED not in result.stderr


def test_a_file_that_is_not_safetensors_is_refused_without_its_first_bytes_as_a_number(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", DEBUG)
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(PASSWD)

    result = run_pretrain(tmp_path, capsys, "--init-from", str(tmp_path / "ckpt"))

    assert_one_line_error(
        result,
        "model.safetensors is not a readable safetensors file",
        f"(its header length is not plausible for a file of {len(PASSWD)} bytes)",
        prefix="pretrain: error: training.init_from: ",
    )
    assert LEAKED not in result.stderr


def test_the_command_that_fetches_a_hub_model_keeps_its_revision_and_quotes_every_word(model_cache):  # noqa: F811
    with pytest.raises(InitFromError) as excinfo:
        find_checkpoint("owner/absent@v2.0", log=print)

    message = str(excinfo.value)
    assert "model owner/absent@v2.0 (no directory owner/absent@v2.0 here either) is not in the Hugging Face cache" in message
    assert (
        "`hf download owner/absent --revision v2.0 --include config.json model.safetensors 'model-*.safetensors' "
        "model.safetensors.index.json tokenizer.json tokenizer_config.json`"
    ) in message
