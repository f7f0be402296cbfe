"""OLMo (trident.models.olmo), the family docs/models.md adds: under tp=2 by its own plan, and split
into 2 pipeline stages from the config, it matches one process running the unmodified model
(losses, gradient norms, merged weights; tiny, fp32, q/k/v clipping on, SGD with clipping active).
The single-process checks of the split (stages chained give the model's loss and names) run for it
in tests/parity/test_pp_hf.py with the other families."""

from __future__ import annotations

from tests.parity.test_pp_hf import MICRO, check, train_pp
from tests.parity.test_tp_hf import check_tp
from trident.testing.distributed import run_on_ranks


def test_olmo_under_tp2_matches_one_process():
    check_tp("olmo", "hf", 2, False)


def test_olmo_pp2_from_config_matches_one_process():
    check("olmo", run_on_ranks(2, train_pp, "olmo", 2, 1, evaluate=True), MICRO * 2)
