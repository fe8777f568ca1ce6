import sys

from nestling.cli import main

sys.exit(main())
