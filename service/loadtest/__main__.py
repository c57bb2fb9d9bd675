"""``python -m service.loadtest``: see service/loadtest/cli.py for the flags."""
import sys

from .cli import main

sys.exit(main())
