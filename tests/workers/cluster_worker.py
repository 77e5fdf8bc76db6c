"""A worker of a coordinated-cluster test: records where and as what it runs, then idles until told to finish.

argv: OUT TASK. Says ``hello`` (it can neither resume nor leave at a step boundary), writes
``OUT/TASK/started-<pid>.json`` ({rank, world, group_rank, node, restart}); exits 0 once
``OUT/TASK/finish`` exists.
"""

import json
import os
import sys
import time
from pathlib import Path

from unicron_elastic.worker import get_worker

out = Path(sys.argv[1]) / sys.argv[2]
out.mkdir(parents=True, exist_ok=True)
doc = {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
       "group_rank": int(os.environ["GROUP_RANK"]), "node": os.environ.get("UNICRON_NODE_DAEMON", ""),
       "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid()}
get_worker().hello()  # (a worker that cannot leave at a step boundary: a node asked to leave stops it at once)
tmp = out / f".started-{os.getpid()}"
tmp.write_text(json.dumps(doc))
tmp.rename(out / f"started-{os.getpid()}.json")
while not (out / "finish").exists():
    time.sleep(0.1)
