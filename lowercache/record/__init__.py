"""The record shared by direct mode and ``lowercache run``: what code read, and when a record may answer for it.

:mod:`.places` says where a path is and what it holds, :mod:`.recorder`
hears what code reads (Python's audit hook), and :mod:`.trust` says when a
record may answer: its identity, the one confirm rule, and its status.
Imports no torch: direct mode answers through it before torch is imported.
"""
