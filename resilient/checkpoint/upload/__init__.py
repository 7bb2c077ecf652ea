"""The persistent tier's upload: the uploader thread (``uploader``), whether to compress (``chooser``), the
streaming transcoder (``transcode``) and the collective hook that sends coded parts (``prepare``).
Imports ``format`` and ``storage``."""
