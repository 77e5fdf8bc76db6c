"""pluggy hook specifications and built-in detector plugins (agent issue)."""
