"""``python -m service.bench_engine``: the engine benchmark, now in service/bench/engine.py."""
import sys

from service.bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
