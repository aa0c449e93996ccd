import sys

from nanotron_train.checkpoints.cli import main

sys.exit(main())
