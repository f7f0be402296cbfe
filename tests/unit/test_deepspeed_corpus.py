"""Real DeepSpeed configs from public repositories (tests/data/deepspeed_configs, sources in
SOURCES.json): each is accepted, or refused only for a feature trident lacks, named in the
message; none crashes. Configs written for the Hugging Face Trainer are filled from a
`TrainingArguments` first. `deepspeed_verdicts.json` is what DeepSpeed 0.19.8 itself said of each
file (bench/ds_config_corpus.py): every file DeepSpeed accepts, trident accepts or refuses by name.
"""

import json
import warnings
from pathlib import Path

import pytest

import trident  # noqa: F401  (registers the optimizer and scheduler rules)
from trident.config import ConfigError, fill_auto, load_config
from trident.config.hf_auto import auto_paths

from tests.unit.deepspeed_corpus_args import MODEL, training_args

CORPUS = Path(__file__).resolve().parent.parent / "data" / "deepspeed_configs"
FILES = sorted(p for p in CORPUS.glob("*.json") if p.name not in ("SOURCES.json", "deepspeed_verdicts.json"))
VERDICTS = json.loads((CORPUS / "deepspeed_verdicts.json").read_text())
SOURCES = json.loads((CORPUS / "SOURCES.json").read_text())

# What a refusal must say: the feature is one trident lacks, named with its key; or, for a value
# DeepSpeed's config parser lets through but its `initialize` refuses (`max_grad_norm` among the
# optimizer's params), that DeepSpeed refuses it too.
REFUSAL_WORDS = ("does not implement", "not supported", "DeepSpeed rejects it too")




def _verdict(path: Path):
    """("accepted", notes) or ("refused", issues); an exception other than ConfigError escapes."""
    data = json.loads(path.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if auto_paths(data):
            data = fill_auto(data, training_args(data), model=MODEL)
        try:
            cfg = load_config(data)
        except ConfigError as err:
            return "refused", err.issues
    return "accepted", cfg._notes


def test_corpus_is_large_and_sourced():
    assert len(FILES) >= 40
    for path in FILES:
        source = SOURCES[path.name]
        assert source["repo"] and source["path"] and len(source["commit"]) == 40
    assert set(VERDICTS) == {p.name for p in FILES}


@pytest.mark.parametrize("path", FILES, ids=[p.name[:70] for p in FILES])
def test_config_is_accepted_or_refused_by_feature(path):
    kind, details = _verdict(path)
    if kind == "refused":
        for issue in details:
            assert any(w in issue.message for w in REFUSAL_WORDS) or VERDICTS[path.name]["accepted"] is False, \
                f"{path.name}: refused for something other than a missing feature: {issue}"
            if VERDICTS[path.name]["accepted"]:
                assert any(w in issue.message for w in REFUSAL_WORDS), f"{path.name}: {issue}"


def test_acceptance_figures():
    """trident accepts what DeepSpeed accepts (as written, or with the "auto" values filled), less
    the files that switch on a feature it lacks; and more than DeepSpeed does unfilled."""
    counts = {"deepspeed": 0, "deepspeed_filled": 0, "trident_filled": 0, "both": 0}
    for path in FILES:
        verdict = VERDICTS[path.name]
        ds = bool(verdict["accepted"] or verdict["accepted_after_fill"])
        ours = _verdict(path)[0] == "accepted"
        counts["deepspeed"] += verdict["accepted"]
        counts["deepspeed_filled"] += ds
        counts["trident_filled"] += ours
        counts["both"] += ds and ours
    print("corpus acceptance:", counts, "of", len(FILES))
    # One file DeepSpeed 0.19 refuses is accepted: a `compression_training` block with every
    # technique switched off, which DeepSpeed now refuses outright (its library was removed) and
    # trident ignores like any other switched-off section. Nothing else DeepSpeed refuses gets through.
    assert counts["trident_filled"] - counts["both"] == 1
    assert counts["trident_filled"] >= 37 and counts["deepspeed"] == 41
