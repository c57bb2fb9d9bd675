"""The translation service: continuous-batching engine, Ray Serve deployments, HTTP API, load tester.

``python -m service`` runs it (see ``service/__main__.py``); ``service.app:build_app`` builds the Ray
Serve application for ``serve run`` and the Serve config files.
"""
