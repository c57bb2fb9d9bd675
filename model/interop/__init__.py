"""Published formats: MarianMT (OPUS-MT) import (``marian.py``) and export (``marian_export.py``),
CTranslate2 conversion and translation (``ct2.py``). The command line is ``python -m model.convert``."""
