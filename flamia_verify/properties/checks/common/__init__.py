"""What the checks of several families share; no check is registered here.

The family packages never import each other (pyproject.toml's import-linter contract "check families
independent"): what two of them need lives here, one module per concern, and only what crosses
families (what one family alone needs lives in that family's package):

    verdict      how every check records a case and ends: case_record, verdict, violations
    error_model  the rounding model's prediction (normalized_error) and the a-priori bound of a case
                 (bounds_for, bound_ratio), the report of its violations (bound_report), the bound of
                 one call (bound_of_call)
    cases        the bias family's cases on the MX-exact grid (bias, bound, special) and the calling
                 convention's packings (interface, special)
    pack         the suite's many-document pack (isolation.layout, determinism.repeat)
    noise        the kernel's run-to-run noise, which the information-flow checks judge beyond
    nonfinite    the poisoned runs of special.nonfinite and isolation.nonfinite
    captured     the captured calls of a run on a capture (``check --inputs``) and the information-flow
                 check over them; CAPTURED_CHECKS, the checks such a run runs

What the checks share with the fuzzer's search sits below both, in :mod:`flamia_verify.properties.perturb`
(perturbations of a pack's documents) and :mod:`flamia_verify.properties.bounds` (the a-priori bound of
a case's inputs).
"""
