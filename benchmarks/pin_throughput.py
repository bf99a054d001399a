"""Pin throughput against the field's baselines, in one interleaved run: ``pinpool bench``.

    ./dev bench                                   # 4 GiB, auto runtime (mlock without a GPU)
    python benchmarks/pin_throughput.py --runtime cuda --size 64GiB --reps 3 --json out.json

Everything lives in :mod:`pinpool._bench` so that an installed pinpool can run it too
(``pinpool bench --help``).
"""

import sys

from pinpool._bench import main

if __name__ == "__main__":
    sys.exit(main())
