import sys

from dhelix.cli import main

sys.exit(main())
