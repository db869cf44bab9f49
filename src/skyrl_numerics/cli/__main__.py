"""``python -m skyrl_numerics.cli``: the ``skyrl-numerics`` command."""
import sys

from skyrl_numerics.cli import main

sys.exit(main())
