"""ASGI entry point (`uvicorn ace.asgi:application`).

Static files (the project's static/ and the apps' assets) are served by Django's ASGIStaticFilesHandler
unless ACE_SERVE_STATIC=false, e.g. behind a reverse proxy or CDN that serves `collectstatic` output.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
application = get_asgi_application()

from ace.env import env_bool  # noqa: E402 - after Django is set up

if env_bool("ACE_SERVE_STATIC", True):
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    application = ASGIStaticFilesHandler(application)
