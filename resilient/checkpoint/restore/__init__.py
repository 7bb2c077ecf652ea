"""Reading a step back: which tier holds what (``plan``), verified block loads (``load``), the DCP reader
(``reader``) and the restore itself (``restore``). Imports ``format``, ``storage`` and ``replicate``."""
