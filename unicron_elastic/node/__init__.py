"""The node daemon (``unicron node``) and a local cluster; the environment it gives its launchers.

The two variables are the contract between a daemon and the ``unicron-run``
it starts: the agent then keeps no node record of its own (the daemon holds
it, with the node's slots), the rendezvous admits the node only as the plan
says (:class:`~unicron_elastic.rendezvous.gate.PlanGate`), and the launcher
stops when the daemon is gone.
"""

#: The node's name; set by ``unicron node`` for the launchers it starts.
NODE_DAEMON_ENV = "UNICRON_NODE_DAEMON"
#: The daemon's PID: the launcher stops when its parent is no longer that process.
DAEMON_PID_ENV = "UNICRON_NODE_DAEMON_PID"
