"""Export: a trained adapter written atomically as a PEFT directory (``adapter.py``), or merged into its base.

The merge (``merge.py``) reads the adapter from a directory or a checkpoint (``sources.py``,
``trained_adapter.py``, the compute dtype training recorded beside an adapter directory in
``training_record.py``), plans every output tensor before the first is read (``merge_plan.py``), adds each
weight's delta (``weights.py``) and streams the result into safetensors shards (``shards.py``) beside the
base's config, tokenizer and a model card (``model_card.py``). ``leftovers.py`` names scratch directories for
their process so that the next start removes what a killed one left.
"""
