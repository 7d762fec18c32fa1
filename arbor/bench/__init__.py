"""Benchmark programs (``arbor bench NAME``): each runs the compared systems side by side in one
process, prints a ratio table and writes ``NAME.json`` and ``NAME.png``. Library code never
imports this package."""
