"""A module that is not fork-safe: importing it starts a thread (as a metrics client or a watchdog would)."""

import threading
import time

threading.Thread(target=lambda: time.sleep(3600), name="fork-unsafe-watchdog", daemon=True).start()
