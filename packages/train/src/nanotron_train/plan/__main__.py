import sys

from nanotron_train.plan.cli import main

sys.exit(main())
