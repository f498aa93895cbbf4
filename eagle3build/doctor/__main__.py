"""`python -m eagle3build.doctor`: the preflight checks from the command line (`make doctor`)."""

import sys

from eagle3build.doctor import main

sys.exit(main())
