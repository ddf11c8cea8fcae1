"""The structured mutation fuzzer (``tests/modelclient.py``'s :class:`Fuzzer`) for many cases:
prints JSON with the cases run, the crashes found (an exception out of ``Broker.apply``, a reply
code the spec does not allow for the situation, an innocent client hurt, or owner and shadow
replicas that disagree), cases per second and the histogram of reply codes.

    python bench/fuzz_bench.py --cases 1000000 [--seed 1]

Single process; about 2,000 cases/s on one core. Never run two benchmarks at once on a 2-core
machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from modelclient import Fuzzer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    result = Fuzzer(args.seed).run(n=args.cases)
    print(json.dumps(result, indent=1))
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
