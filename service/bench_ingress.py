"""``python -m service.bench_ingress``: the ingress benchmark, now in service/bench/ingress.py."""
from service.bench.ingress import main

if __name__ == "__main__":
    main()
