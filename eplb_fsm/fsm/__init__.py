"""The lifecycle: the machine (states, events, guards) and what drives it.

Read top-down: ``machine`` (the table), ``decide`` (pure decisions), ``controller`` (the
step loop), then its collaborators ``collectives``, ``rearrange``, ``transfers``,
``planning``, ``reporting``, ``worker`` and ``watchdog``.
"""
