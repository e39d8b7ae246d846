"""`python -m benchmarks ...` from a checkout: forwards to `pallet bench ...`
(the suite is `pallet.bench`, src/pallet/bench/)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "src"))

from pallet.bench.__main__ import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
