"""Region replay (docs/regions.md): the graph cut into regions with content keys, their states at the split stored and
checked, served region by region inside the TOSA pipeline and spliced; TOSA's canonical form for comparing up to names."""
