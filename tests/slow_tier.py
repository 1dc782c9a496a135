"""Write tests/slow_tests.txt from the output of a whole-suite run with ``--durations=0``:

    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python -m pytest -n 2 --dist loadgroup -q --durations=0 > durations.txt
    python tests/slow_tier.py durations.txt > tests/slow_tests.txt

or, from a run of the fast tier alone (`-m "not slow"`), keeping the slow tier already measured:

    python tests/slow_tier.py fast-durations.txt --keep tests/slow_tests.txt > new && mv new tests/slow_tests.txt

Every test whose setup, call and teardown together took at least ``--seconds`` (default 2) goes into the
slow tier (tests/conftest.py marks it ``slow``; `make test` leaves it to `make test-slow`).
"""

from __future__ import annotations

import argparse
import datetime
import re
from collections import defaultdict

LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+)$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("durations", help="pytest's output with --durations=0")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument(
        "--keep",
        metavar="SLOW_TESTS_TXT",
        help="a slow list whose entries stay where the durations have no line for them (the durations of "
        "a fast-tier run, `-m 'not slow'`, add the tests that grew slow and keep the measured slow tier)",
    )
    args = parser.parse_args()
    total: dict[str, float] = defaultdict(float)
    with open(args.durations) as fh:
        for line in fh:
            match = LINE.match(line.strip())
            if match:
                total[match.group(2)] += float(match.group(1))
    if args.keep:
        with open(args.keep) as fh:
            for line in fh:
                if line.strip() and not line.startswith("#"):
                    seconds, node = line.split(maxsplit=1)
                    total.setdefault(node.strip(), float(seconds))
    print("# Tests of the slow tier (`make test-slow`; `make test` runs every other test): seconds and pytest node id.")
    print(
        f"# Measured: every test whose setup, call and teardown took {args.seconds:g} s or more in one run of the whole suite"
    )
    print(f"# (pytest -n 2 --durations=0 on the 2-core CPU machine, {datetime.date.today()}); regenerate with")
    print("# tests/slow_tier.py DURATIONS_OUTPUT > tests/slow_tests.txt. A test missing here runs in the fast tier.")
    print("# tests/conftest.py also runs the files with the most measured seconds first (the long tests start early).")
    for node in sorted(n for n, s in total.items() if s >= args.seconds):
        print(f"{total[node]:.1f} {node}")


if __name__ == "__main__":
    main()
