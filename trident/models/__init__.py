"""Model families: one folder each, each with the `ModelAdapter` the parallel packages ask.

    gpt/           the reference GPT every parallel layout is checked against (and `gpt_pipe`)
    transformers/  what every transformers family shares (layout, stages, plans, cp attention)
    llama/         LLaMA, Mistral, Qwen2, Qwen3
    gpt2/          GPT-2
    gpt_neox/      GPT-NeoX
    mixtral/       Mixtral (mixture of experts)
    olmo/          OLMo (the worked example of docs/models.md)
    toy.py         tiny models and data for tests

Importing this package registers every family's adapter (trident.parallel.adapter); `import
trident` does. docs/models.md shows how a family is added.
"""

from trident.models import gpt2, gpt_neox, llama, mixtral, olmo, transformers
from trident.models.gpt import GPT, GPT_PRESETS, GPTConfig
from trident.models.toy import TinyMLP, make_regression_data

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "TinyMLP", "gpt2", "gpt_neox", "llama", "make_regression_data",
           "mixtral", "olmo",
           "transformers"]
