"""Detection logic shared by the agent's detectors (pure functions and small state machines)."""
