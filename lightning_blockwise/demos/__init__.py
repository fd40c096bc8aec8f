"""The self-contained demo: a tiny random-init Qwen2 with LoRA on an NF4 base (``configs/demo.yaml``)."""
