"""Stored programs: an ``ExportedProgram``'s pickle-free stored form, a saved ``.pt2`` read as data, and the FX graph
rebuilt from torch.export's JSON; each checked before it is rebuilt."""
