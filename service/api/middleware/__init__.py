"""The ASGI middleware of the ingress app (http.build_app lists their order)."""
