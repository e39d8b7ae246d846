"""`python -m pallet.cli`: the `pallet` console command."""
import sys

from pallet.cli import main

sys.exit(main())
