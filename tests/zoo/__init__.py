"""The test suite's zoo. Planted-bug kernels (tests/zoo/kernels.py, targeted.py and the other *_bugs.py
files), each a record of the known-bad registry (``flamia_verify.known_bad``, tag ``zoo``) that must fail
the checks it names (``catches``) and pass those its bug cannot reach (``quiet``); where a bug is one of
the package's own records (a wrapper or source-edit mutant), the zoo builds that record, on the base its
test needs, instead of writing it again. Correct kernels from outside the project (tests/zoo/correct.py)
must pass everything; they, and the engine's fixtures (kernels that raise, hang or crash), are not records."""

from zoo import kernels
from zoo.correct import sdpa_bf16

__all__ = ["kernels", "sdpa_bf16"]
