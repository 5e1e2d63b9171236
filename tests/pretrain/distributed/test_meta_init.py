"""Meta-device initialisation under FSDP2 (pretrain/distributed/parallel.py materialize): a model shaped like
Llama-3 8B, cut to two layers and a small vocabulary, on two gloo ranks (tests/support/workers/meta_init_worker.py).
No rank ever holds the whole model, and the weights are those of the model built whole."""

from __future__ import annotations

import pytest

from support.processes import run_gloo_ranks

pytestmark = pytest.mark.slow  # two ranks build the cut-down 8B shape sharded, and rank 0 once whole: about 15 s


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("meta")
    return run_gloo_ranks("meta_init_worker.py", out, timeout=600)


def test_a_sharded_model_initialised_on_the_meta_device_gives_the_loss_of_the_model_built_whole(ranks):
    whole = ranks[0]["eager"]  # built once, by rank 0 after its sharded pass, for both ranks' batches
    for rank, seen in enumerate(ranks):
        assert seen["sharded_loss"] == whole["losses"][rank]  # the same weights, bit for bit
    assert ranks[0]["sharded_loss"] != ranks[1]["sharded_loss"]  # each rank's own batch: a real comparison
    assert all(seen["rope_cos"] == whole["rope_cos"] for seen in ranks)  # the rotary tables are not to_empty's garbage


def test_no_rank_ever_holds_the_whole_model_while_it_is_built_and_initialised(ranks):
    # Each rank keeps half the weights; initialising draws one whole parameter at a time (the
    # largest here, a feed-forward matrix, is an eighth of the model), never the model.
    for seen in ranks:
        growth = seen["initialised_peak"] - seen["rss_before"]
        assert seen["full_bytes"] / 2 <= growth < 0.75 * seen["full_bytes"], seen
