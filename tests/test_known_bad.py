"""The known-bad registry holds together: one record per bug, each with what it is and how to build it.

Every record (the package's mutant families and train-parity demos, and the zoo's, imported here) says
why it is wrong, names checks that exist, claims a recipe and builds a kernel from its base; names are
unique; no two records build the same bug (the same source edits and design, the same forwarding body,
or, for the bugs written around a kernel, the same numbers on the probe calls); and the bugs that
were written twice (in the zoo and in a mutant family) are one record read by both.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zoo.causal_bugs
import zoo.common_kinds
import zoo.convention_bugs
import zoo.dimension_bugs
import zoo.fuzz_bugs
import zoo.gate_bugs
import zoo.kernels
import zoo.realistic_bugs
import zoo.scale_rules
import zoo.state_bugs
import zoo.targeted
import zoo.value_bugs
import zoo.wild_bugs
from zoo.verdicts import assert_caught_and_quiet

from flamia_verify.known_bad import JUDGED_BY_THEIR_FAMILY, KNOWN_BAD, Forwarding, KnownBad, Registry, mutants
from flamia_verify.known_bad.edits import SourceEdit
from flamia_verify.known_bad.table import VARIANT_KIND_EDITS
from flamia_verify.known_bad.wrapper import PROBES, probe_call
from flamia_verify.properties import run_checks
from flamia_verify.properties.catalog import all_specs
from flamia_verify.settings import SUITES

RECORDS = tuple(KNOWN_BAD)

#: the bugs that were written twice: the name a zoo's test gives the kernel -> the one record it reads
TWINS = [
    (zoo.convention_bugs.CONVENTION_BUGS, "scale_none_as_one", "wrapper.defaults.scale-none-as-1"),
    (zoo.convention_bugs.CONVENTION_BUGS, "assumes_contiguous", "wrapper.stride.storage-as-contiguous"),
    (zoo.convention_bugs.CONVENTION_BUGS, "nan_to_num_output", "wrapper.nan.out-to-num"),
    (zoo.convention_bugs.CONVENTION_BUGS, "lse_in_log2", "wrapper.lse.log2"),
    (zoo.targeted.TARGETED, "ignores_softmax_scale", "wrapper.defaults.scale-ignored"),
    (zoo.targeted.TARGETED, "ds_nvfp4", "format.ds_quant-nvfp4"),
    (zoo.targeted.TARGETED, "fp8_on_e4m3_tensor_cores", "accumulator.mma-under-fp8"),
    (zoo.realistic_bugs.REALISTIC, "dst_e5m2", "format.dst_quant-e5m2"),
    (zoo.causal_bugs.CAUSAL_BUGS, "backward_mask_plus1", "mask.backward+1"),
    (zoo.common_kinds.__dict__, "nan_to_zero", "wrapper.nan.out-to-num"),
    (zoo.common_kinds.__dict__, "zero_scale_is_default", "zero_scale_is_default"),
    (zoo.wild_bugs.WILD, "nan_to_num_output", "wrapper.nan.out-to-num"),
    (zoo.wild_bugs.WILD, "assumes_contiguous_layout", "wrapper.stride.storage-as-contiguous"),
    (zoo.wild_bugs.WILD, "gqa_repeat_not_interleave", "wrapper.gqa.modulo"),
    (zoo.wild_bugs.WILD, "fp16_computed_in_bf16", "wrapper.dtype.fp16-via-bf16"),
    (zoo.wild_bugs.WILD, "scale_zero_means_default", "zero_scale_is_default"),
    (zoo.wild_bugs.WILD, "causal_top_left", "top_left_causal"),
    (zoo.wild_bugs.WILD, "causal_offset_from_max_seqlen", "offset_from_max_seqlens"),
]


def _check_names() -> set[str]:
    names = {s.name for s in all_specs()}
    families = {n.partition(".")[0] for n in names}
    # the checks of `flamia-verify fuzz`'s report, one per property the fuzzer searches
    return names | families | {f"{f}.fuzz" for f in ("causal", "isolation", "interface")}


def test_every_record_says_what_it_is():
    checks = _check_names()
    for r in RECORDS:
        assert r.name and r.family and r.why.strip(), r
        assert r.suite in SUITES or r.suite == "fuzz", r.name
        assert set(r.catches) <= checks and set(r.quiet) <= checks, (r.name, r.catches, r.quiet)
        assert not set(r.catches) & set(r.quiet), r.name
        if not r.correct and not set(r.tags) & set(JUDGED_BY_THEIR_FAMILY + ("wild",)):
            assert r.catches, f"{r.name} names no check that must fail on it"
        assert r.has("mutant") or r.has("train-demo") or r.has("zoo"), f"{r.name}: nothing reads it ({r.tags})"


def test_names_are_unique_across_the_registry():
    names = [r.name for r in RECORDS]
    assert len(names) == len(set(names))
    again = KNOWN_BAD.get("wrapper.gqa.modulo")
    with pytest.raises(ValueError, match="registered twice"):
        KNOWN_BAD.register(dataclasses.replace(again), origin="elsewhere")
    fresh = Registry()
    fresh.register(again, origin="a.py")
    fresh.register(again, origin="a.py")  # a module that runs twice registers its records again
    assert len(fresh) == 1


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.name)
def test_every_record_builds_a_kernel_from_its_base(record):
    kernel = record.kernel()
    assert callable(kernel) and kernel.known_bad is record
    assert isinstance(kernel.recipe, str) and kernel.recipe, f"{record.name} claims no recipe"
    assert kernel.catches == record.catches and kernel.quiet == record.quiet


def test_mutate_reads_the_two_mutant_families_from_the_registry():
    got = mutants()
    assert {r.has("source-edit") or r.has("wrapper") for r in got} == {True}
    assert len(got) == 161 and [r.name for r in got[:3]] == ["mask.forward+1", "mask.forward+2", "mask.forward-1"]
    assert not [r for r in got if r.has("zoo")]


@pytest.mark.parametrize(("table", "label", "record"), TWINS, ids=[f"{t[1]}-{t[2]}" for t in TWINS])
def test_a_bug_written_twice_is_one_record(table, label, record):
    assert table[label].known_bad is KNOWN_BAD.get(record)
    assert label not in KNOWN_BAD or label == record, f"{label} is a record of its own beside {record}"


def _design_key(design) -> tuple:
    fields = {f.name: getattr(design, f.name) for f in dataclasses.fields(design) if f.name != "name"}
    fields["quants"] = tuple(sorted((str(k), v) for k, v in design.quants.items()))
    return tuple(sorted((k, repr(v)) for k, v in fields.items()))


def test_no_two_records_build_the_same_emulation():
    """Records that build the emulation itself (source edits, another design) differ in what they build:
    their edits (the ones that only let a design name the mutants' roundings left out) and their design."""
    seen: dict[tuple, str] = {}
    for r in RECORDS:
        if isinstance(r.build, Forwarding):
            continue
        kernel = r.kernel()
        design = getattr(kernel, "design", None)
        if design is None:  # a kernel that patches the emulation while it runs, or is not the emulation
            continue
        edits = r.build.mutant.edits if isinstance(r.build, SourceEdit) else ()
        key = (_design_key(design), tuple(e for e in edits if e not in VARIANT_KIND_EDITS))
        assert key not in seen, f"{r.name} builds what {seen[key]} builds"
        seen[key] = r.name
    assert len(seen) > 100


def test_no_two_records_share_a_forwarding_body():
    bodies: dict[object, str] = {}
    for r in RECORDS:
        if isinstance(r.build, Forwarding):
            assert r.build.body not in bodies, f"{r.name} runs the body of {bodies[r.build.body]}"
            bodies[r.build.body] = r.name


#: probe calls of the wrapper family that reach many dimensions at once
_PROBES = [p for p in PROBES if p.name.startswith(("scale None", "scale 0.3", "5:1", "11 documents", "fp16", "NaN"))]


def _fingerprint(kernel, probe) -> tuple:
    torch.manual_seed(0)
    try:
        out, lse, grads, changed = probe_call(kernel, probe)
    except Exception as exc:  # a crash is what it shows
        return ("raises", type(exc).__name__, str(exc).splitlines()[0][:80] if str(exc) else "")

    def bits(t):
        return None if t is None else (tuple(t.shape), str(t.dtype), t.double().nan_to_num(7e7).sum().item())

    return (bits(out), bits(lse), tuple(bits(g) for g in grads), changed)


#: bugs whose common part (a front quantizer of V or of dO) is all the probe calls reach: each pair is
#: told apart below on the inputs of its own dimension
SIBLINGS = {
    frozenset({"e8m0_byte0_zero", "zero_block_nan"}),
    frozenset({"range_scale_do", "range_scale_do_flush"}),
}


def test_no_two_wrapper_bugs_compute_the_same_numbers():
    """Built on one base, the bugs written around a kernel (the wrapper family's and the zoo's) differ
    from each other on the probe calls wherever they differ from the base: a bug written twice,
    under two names, would not."""
    from flamia_verify.known_bad import base_kernel

    base = base_kernel("bf16")
    correct = tuple(_fingerprint(base, p) for p in _PROBES)
    seen: dict[tuple, str] = {}
    alike = []
    for r in RECORDS:
        if not isinstance(r.build, Forwarding) or r.correct or r.has("ladder"):
            continue
        got = tuple(_fingerprint(r.kernel(base), p) for p in _PROBES)
        if got == correct:
            continue  # the probes do not reach its dimension
        if got in seen:
            alike.append(frozenset({r.name, seen[got]}))
        seen.setdefault(got, r.name)
    assert set(alike) <= SIBLINGS, f"records that compute the same numbers on every probe: {alike}"
    assert len(seen) >= 40


def _call(kernel, v_rows=None, do_rows=None):
    """One causal 64-token document, 2:1 GQA, head_dim 32: out and dV, with V's first 32 rows and dO's
    first 32 rows replaced when given."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(64, h, 32, generator=g).bfloat16() for h in (2, 1, 1))
    dout = torch.randn(64, 2, 32, generator=g).bfloat16()
    if v_rows is not None:
        v[:32] = v_rows
    if do_rows is not None:
        dout[:32] = do_rows
    v.requires_grad_()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    out = kernel(q, k, v, cu, cu, 64, 64, softmax_scale=None, causal=True)
    (dv,) = torch.autograd.grad(out, (v,), dout)
    return out.detach(), dv


def test_the_siblings_differ_on_their_own_inputs():
    from flamia_verify.known_bad import base_kernel

    base = base_kernel("bf16")
    zero = _call(KNOWN_BAD.kernel("zero_block_nan", base), v_rows=0.0)[0]
    byte0 = _call(KNOWN_BAD.kernel("e8m0_byte0_zero", base), v_rows=0.0)[0]
    assert torch.isnan(zero).any() and torch.isfinite(byte0).all()
    tiny = _call(KNOWN_BAD.kernel("e8m0_byte0_zero", base), v_rows=2.0**-125)[0]
    assert (tiny[:1] == 0).all() and (_call(base, v_rows=2.0**-125)[0][:1] != 0).any()
    nan_dv = _call(KNOWN_BAD.kernel("range_scale_do", base), do_rows=1.0)[1]
    flushed_dv = _call(KNOWN_BAD.kernel("range_scale_do_flush", base), do_rows=1.0)[1]
    assert torch.isnan(nan_dv).any() and torch.isfinite(flushed_dv).all()


def test_a_record_builds_on_another_base():
    """The same record around another correct kernel: the zoo builds the wrapper family's bugs on the
    bases its tests need."""
    record = KNOWN_BAD.get("wrapper.nan.out-to-num")
    assert isinstance(record, KnownBad) and record.base == "bf16"
    on_sdpa = record.kernel(zoo.correct.sdpa_bf16)
    q, k, v = (torch.randn(6, 2, 16).bfloat16() for _ in range(3))
    q[2, 0, 0] = float("nan")
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    out = on_sdpa(q, k, v, cu, cu, 3, 3, softmax_scale=None, causal=True)
    assert torch.isfinite(out).all() and on_sdpa.recipe == "bf16"
    assert not torch.isfinite(zoo.correct.sdpa_bf16(q, k, v, cu, cu, 3, 3, causal=True)).all()


@pytest.mark.parametrize("name", ["demo.future-leak", "demo.next-token-leak"])
def test_train_paritys_planted_kernels_fail_the_causal_checks(name):
    """What train-parity plants (a kernel that sees the byte it must predict) is what the causal
    checks catch, call by call."""
    kernel = KNOWN_BAD.kernel(name)
    assert kernel.recipe == "mxfp8" and kernel.catches
    assert_caught_and_quiet(name, kernel, run_checks(kernel, suite="quick", only=list(kernel.catches)))
