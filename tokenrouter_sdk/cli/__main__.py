"""``python -m tokenrouter_sdk.cli``: the ``tokenrouter`` command."""

import sys

from .main import main

sys.exit(main())
