import sys

from planner.cli import main

sys.exit(main())
