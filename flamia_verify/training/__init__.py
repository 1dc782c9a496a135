"""Training parity: does a model trained with a quantized attention kernel end where BF16 ends?

``flamia-verify train-parity`` trains one small decoder-only transformer per kernel (same seed,
same initial weights, same packed variable-length batches, BF16 elsewhere; the kernel in every
attention layer through the varlen convention) on a byte-level corpus that ships with every
Python installation (the standard library's own source), and compares each kernel's final
validation loss with the spread of BF16 over several seeds. See docs/training.md.
"""

from flamia_verify.training.corpus import Corpus, build_corpus
from flamia_verify.training.model import ModelConfig, TinyLM
from flamia_verify.training.parity import PRESETS, ParityConfig, run_parity

__all__ = ["Corpus", "build_corpus", "ModelConfig", "TinyLM", "PRESETS", "ParityConfig", "run_parity"]
