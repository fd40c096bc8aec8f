"""Test helpers: tiny models, workers, callbacks. Importing them sets the one process-wide test setting below."""

import bitsandbytes.nn.modules

# On a CPU with AVX512-BF16, bitsandbytes moves an eval-mode 4-bit linear fed an input without grad to its
# inference-only kernel, repacking the weight with `in_features // blocksize` absmax columns: 0 for the tiny
# test models (32 features, blocksize 64), and the reshape raises ("shape '[32, 0]' is invalid"). Real models are
# far wider; the strategy and the demo keep their layers off that kernel anyway (NOTE [ bitsandbytes CPU inference
# kernel ] in compat/bitsandbytes/cpu_kernel.py), but the tests' resident arms (`strategy="auto"`, a PEFT model's
# reference logits) would take it in validation. So every test process behaves as on a CPU without AVX512-BF16,
# the same on every machine CI may run on. Tests of that kernel set the layer's flag themselves.
bitsandbytes.nn.modules.has_avx512bf16 = lambda: False
