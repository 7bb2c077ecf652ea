import os
import sys

if os.environ["RANK"] == sys.argv[1]:
    raise ValueError("boom from rank " + sys.argv[1])
