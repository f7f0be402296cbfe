"""Mixtral (trident.models.mixtral): the mixture-of-experts family under tp, pp and the checks.

tp=2 by the model's own plan splits attention, the embedding and the head; the router and the
experts stay whole on both ranks (transformers' own plan for them uses styles trident's layers do
not have), so both ranks route every token alike. pp=2 splits the unmodified model into stages.
Both match one process running the unmodified model: losses, gradient norms and merged weights
(tiny, fp32, SGD with clipping active). With `output_router_logits` the router's loss lives in
the model's forward, which a pipeline stage and context parallelism do not keep: refused.
"""

from __future__ import annotations

import pytest
import transformers

from tests.parity.test_pp_hf import CONFIGS, MICRO, check, make, train_pp
from tests.parity.test_tp_hf import check_tp
from trident.parallel.adapter import adapter_for
from trident.pipeline import from_hf
from trident.testing.distributed import run_on_ranks


def test_mixtral_under_tp2_matches_one_process():
    check_tp("mixtral", "hf", 2, False)


def test_mixtral_pp2_from_config_matches_one_process():
    check("mixtral", run_on_ranks(2, train_pp, "mixtral", 2, 1, evaluate=True), MICRO * 2)


def test_mixtrals_own_plan_keeps_the_router_and_experts_out():
    plan = adapter_for(make("mixtral")).tensor_parallel_plan("hf", 2)
    assert "layers.*.self_attn.q_proj" in plan
    assert not [p for p in plan if ".mlp." in p], sorted(plan)


def test_router_loss_refuses_pipeline_and_context_parallelism():
    config = CONFIGS["mixtral"]()
    config.output_router_logits = True
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(ValueError, match=r"output_router_logits=True .*pipeline parallelism"):
        from_hf(model, 2, stage_id=0)
    with pytest.raises(ValueError, match=r"output_router_logits=True .*context parallelism"):
        adapter_for(model).parallelize_context(cp=None)
