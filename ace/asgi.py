"""ASGI entry point (`uvicorn ace.asgi:application`).

The gateway's /v1 paths (chat/completions, completions, models) are served by its lean ASGI app
(speculation.gateway.asgi: the same gateway code without Django's middleware chain and request signals); every
other path by Django. Static files (the project's static/ and the apps' assets) are served by Django's
ASGIStaticFilesHandler unless ACE_SERVE_STATIC=false, e.g. behind a reverse proxy or CDN that serves
`collectstatic` output.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
django_application = get_asgi_application()

from ace.env import env_bool  # noqa: E402 - after Django is set up
from speculation.gateway.asgi import GatewayApp  # noqa: E402

if env_bool("ACE_SERVE_STATIC", True):
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    django_application = ASGIStaticFilesHandler(django_application)

application = GatewayApp(fallback=django_application)
