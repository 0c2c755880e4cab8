"""`python -m kvservice serve ...`"""

import sys

from kvservice.ops.cli import main

sys.exit(main())
