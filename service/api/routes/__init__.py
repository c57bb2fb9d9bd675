"""One APIRouter per API (native, stores, LibreTranslate, DeepL, documents) and the OpenAPI responses they share."""
