"""The HTTP API: each API's wire format read into the request pipeline (``service/pipeline``) and
its result written back. Nothing below imports this package.

    gateway.py          Gateway: the Ray Serve ingress replica; builds its Services, serves build_app(them)
    http.py             build_app(services): the FastAPI app, middleware and routers in the order they apply
    services.py         Services: what the routes share (handed in by Depends(services)); built once per replica
    routes/             one APIRouter per API: native.py (/v1/translate, /v1/models, health, /metrics,
                        explorer), stores.py (glossaries, memory), libre.py (LibreTranslate), deepl.py
                        (DeepL), deepl_glossaries.py (DeepL's /v2 and /v3 glossaries),
                        deepl_memories.py (/v3/translation_memories), documents.py (every
                        document route); common.py: shared OpenAPI responses
    middleware/         body.py (the one body reader, HEAD), guard.py (API keys, rate limits), cors.py,
                        access_log.py (log lines, HTTP metrics), headers.py (the proxy's header check)
    libretranslate.py   LibreTranslate's fields and answers (/translate, /detect, /languages)
    deepl.py            DeepL's fields, codes and answers (/v2/translate, /v2/languages, /v2/usage);
                        deepl_glossaries.py: DeepL's glossaries (v2, multilingual v3) in the glossary store
    deepl_memories.py   DeepL's translation memories over the memory: ids, import and export jobs
    documents.py        document uploads and downloads; deepl_documents.py: DeepL's document jobs
    suggest.py          LibreTranslate's /suggest and /frontend/settings
    glossaries.py       stored glossaries (the cluster's store); memory.py: memory import and export
    document_store.py   translated files and DeepL jobs kept for download
    schemas.py          the native request and response models; openapi.py: the served OpenAPI document
    errors.py           each API's error shape (the one mapping to ServiceError: service/replica.py)
    backends.py         how the pipeline reaches a translator: in-process, Ray handles, the model pool
    sse.py, explorer.py Server-Sent Events; the attention explorer's page
"""
