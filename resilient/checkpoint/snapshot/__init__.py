"""The snapshot tier: each rank's state copied into node memory (``/dev/shm``) after a step, with no collective and no
file system call but a small commit record, so that a restart on the same node resumes from the last step instead of
the last saved one. ``dirs`` (standard library only) is the agent's part: the node's snapshot directory, made at its
start and removed at its end; ``ring`` is the worker's: two slots a rank, written and restored.
"""
