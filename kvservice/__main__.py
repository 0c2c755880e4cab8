"""`python -m kvservice serve ...`"""

import sys

from kvservice.cli import main

sys.exit(main())
