"""The client zoo: LightningModules written as public fine-tuning scripts write them, run auto vs blockwise."""
