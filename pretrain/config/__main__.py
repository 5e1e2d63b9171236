"""python -m pretrain.config: every config key as one Markdown table (docs/config.md has it by section)."""

from pretrain.config import reference_table

print(reference_table())
