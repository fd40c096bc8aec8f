"""Fine-tuning recipes: ``CausalLMFineTune``, data modules, schedules, random-init bases, adapter export."""
