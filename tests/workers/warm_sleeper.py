"""A worker that waits until the file ``argv[1]`` exists (at most 120 s)."""

import os
import sys
import time

deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
