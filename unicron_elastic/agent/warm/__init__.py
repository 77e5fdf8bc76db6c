"""Warm workers: a zygote that imported what the workers need forks each of them (docs/agent.md "Warm workers")."""
