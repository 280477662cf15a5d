"""The built-in trainer (``loop``) and what a run needs around any loop: session, guard, logs, prediction."""
