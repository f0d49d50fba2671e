import sys

from rewindfs.cli import main

sys.exit(main())
