"""The lifecycle: the machine (states, events, guards) and what drives it."""
