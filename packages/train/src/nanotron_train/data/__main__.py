import sys

from nanotron_train.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
