"""Run the lowercache benchmark: ``python benchmarks/run.py --quick --out benchmarks/results/quick``."""
import sys

from lowercache.bench.harness import main

sys.exit(main(sys.argv[1:]))
