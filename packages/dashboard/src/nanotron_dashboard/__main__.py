"""python -m nanotron_dashboard"""

import sys

from .cli import main

sys.exit(main())
