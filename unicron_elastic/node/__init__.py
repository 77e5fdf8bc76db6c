"""The node daemon (``unicron node``) and a local cluster; the environment it gives its launchers.

Two variables (:data:`~unicron_elastic.env.NODE_DAEMON`, :data:`~unicron_elastic.env.DAEMON_PID`,
set by :func:`~unicron_elastic.env.launcher_environment`) are the contract between a daemon and the
``unicron-run`` it starts: the agent then keeps no node record of its own (the daemon holds
it, with the node's slots), the rendezvous admits the node only as the plan
says (:class:`~unicron_elastic.rendezvous.gate.PlanGate`), and the launcher
stops when the daemon is gone.
"""
