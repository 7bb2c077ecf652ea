"""Copies of a step on other nodes: the ring exchange of a node's files to its partner (``peer``) and the
point-to-point file transfers it and restore use (``transfer``). Imports ``format`` and ``storage``."""
